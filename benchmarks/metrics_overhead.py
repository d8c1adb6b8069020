"""Cost of UntieCallback's role-signal metrics on a GPT-2-small-shaped model, against plain tied Trainer.

Each arm trains the same randomly initialised GPT-2 small (12 layers, d 768, vocabulary 50257, tied) on the same
random tokens, in a fresh subprocess so that peak memory is its own:

* ``plain``: Trainer, no callback;
* ``metrics``: Trainer + UntieCallback(untie_at=None, untie_when=<the evidence rule>, pairs=<256 pairs>,
  metrics_every=50), what the defaults run when Trainer has a tokenizer (its 256 most frequent case and word-start
  pairs; here ids (0, 1), (2, 3), ...): the role signals, the pairs' gaps and evidence and the cross-entropy are
  measured and fed to the trigger every 50 steps. The rule's warm-up is set past the run, so the model stays tied
  and the cost measured is the tied phase's.

Reports the mean step time of each arm, the ratio, the extra time of a measuring step, and peak memory.

    python benchmarks/metrics_overhead.py --steps 105 --repeats 2 --output_dir runs/bench-metrics
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import statistics
from dataclasses import dataclass, field

import torch
import transformers as tf
from common import RandomTokens, StepTimer, benchmark_training_arguments, run_arms_alternating

import untie


@dataclass
class BenchmarkArguments:
    steps: int = field(default=150, metadata={"help": "Optimizer steps per arm (the first 5 are not timed)."})
    metrics_every: int = field(default=50, metadata={"help": "UntieCallback(metrics_every=...) of the metrics arm."})
    pairs: int = field(default=256, metadata={"help": "Pairs measured (the tokenizer default reads 256)."})
    batch_size: int = 2
    sequence_length: int = 128
    layers: int = field(default=12, metadata={"help": "GPT-2 small: 12."})
    threads: int = field(default=0, metadata={"help": "torch threads (0: torch's default)."})
    repeats: int = field(default=1, metadata={"help": "Run the arms this many times, alternating; report medians."})
    output_dir: str = "runs/bench-metrics"
    arm: str | None = field(default=None, metadata={"help": "Internal: run one arm in this process."})


def run_arm(args: BenchmarkArguments) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    tf.set_seed(0)
    config = tf.GPT2Config(n_layer=args.layers, n_positions=max(1024, args.sequence_length))
    model = tf.GPT2LMHeadModel(config)
    timer = StepTimer()
    callbacks = [timer]
    if args.arm == "metrics":
        # Measure everything the default measures, never fire: time the tied phase.
        rule = dataclasses.replace(untie.RULES["evidence"], warmup=args.steps + 1)
        pairs = [(2 * i, 2 * i + 1) for i in range(args.pairs)]
        callbacks.append(
            untie.UntieCallback(untie_at=None, untie_when=rule, pairs=pairs, metrics_every=args.metrics_every)
        )
    training = benchmark_training_arguments(os.path.join(args.output_dir, args.arm), args.steps, args.batch_size)
    dataset = RandomTokens(args.steps * args.batch_size, args.sequence_length, config.vocab_size)
    tf.Trainer(model=model, args=training, train_dataset=dataset, callbacks=callbacks).train()
    timed = {s: d for s, d in timer.durations.items() if s > 5}
    measuring = [d for s, d in timed.items() if s % args.metrics_every == 0]
    other = [d for s, d in timed.items() if s % args.metrics_every != 0]
    return {
        "arm": args.arm,
        "mean_step_s": statistics.fmean(timed.values()),
        "median_other_step_s": statistics.median(other),
        "measuring_steps_s": measuring,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "tied": untie.is_tied(model),
    }


def main() -> None:
    (args,) = tf.HfArgumentParser(BenchmarkArguments).parse_args_into_dataclasses()
    if args.arm:
        print("RESULT " + json.dumps(run_arm(args)))
        return
    runs = run_arms_alternating(
        __file__,
        ("plain", "metrics"),
        args.repeats,
        lambda run: f"mean step {run['mean_step_s']:.3f} s, peak RSS {run['peak_rss_mib']:.0f} MiB",
    )
    plain = [r for r in runs if r["arm"] == "plain"]
    metrics = [r for r in runs if r["arm"] == "metrics"]
    plain_step = statistics.median(r["mean_step_s"] for r in plain)
    extra = statistics.median(statistics.fmean(r["measuring_steps_s"]) - r["median_other_step_s"] for r in metrics)
    summary = {
        "settings": vars(args),
        "torch_threads": torch.get_num_threads(),
        "step_time_ratio": statistics.median(r["mean_step_s"] for r in metrics) / plain_step,
        "step_time_ratio_from_measuring_steps": 1 + extra / args.metrics_every / plain_step,
        "measuring_step_extra_s": extra,
        "peak_rss_extra_mib": statistics.median(r["peak_rss_mib"] for r in metrics)
        - statistics.median(r["peak_rss_mib"] for r in plain),
        "runs": runs,
    }
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, "results.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(
        f"metrics_every={args.metrics_every}: step time x{summary['step_time_ratio']:.4f} of plain tied Trainer "
        f"(x{summary['step_time_ratio_from_measuring_steps']:.4f} from the measuring steps' extra time alone); "
        f"a measuring step costs {summary['measuring_step_extra_s']:.3f} s extra; "
        f"peak memory +{summary['peak_rss_extra_mib']:.0f} MiB"
    )


if __name__ == "__main__":
    main()
