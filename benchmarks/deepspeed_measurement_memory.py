"""The extra memory of a measuring step under DeepSpeed ZeRO: the divergence trigger's reading of the tied gradient.

Launches `torchrun --nproc_per_node <ranks>` once per ZeRO stage; each rank trains, through Trainer with a DeepSpeed
config, a one-block GPT-2 whose vocabulary and width make the embedding most of the model (`--vocab`, `--width`), tied
in autograd under DeepSpeed (`untie.engines.zero_tying`), with `UntieCallback` measuring every `--metrics_every` steps
and never untying. A step's peak is read per rank as the growth of the process's peak resident memory (`ru_maxrss`) over
the step: after the plain steps that precede it, a measuring step grows it only by what the measurement adds on top of a
plain step's peak. Reports per stage, on rank 0: the largest growth of a plain step after the first two, of a measuring
step, the difference as the measurement's extra peak, and that as a share of the embedding's fp32 bytes (V x d x 4).

    DS_ACCELERATOR=cpu python benchmarks/deepspeed_measurement_memory.py --stages 2 3

CPU only as written (gloo, `use_cpu=True`): on GPUs, read `torch.cuda.max_memory_allocated` instead.
"""

from __future__ import annotations

import json
import os
import resource
import sys
from dataclasses import dataclass, field

import torch
import transformers as tf
from common import RandomTokens, machine, print_result, run_ranks, write_results

import untie


@dataclass
class BenchmarkArguments:
    stages: list[int] = field(default_factory=lambda: [2, 3], metadata={"help": "ZeRO stages to run."})
    ranks: int = field(default=2, metadata={"help": "Processes (CPU, gloo)."})
    vocab: int = field(default=131072, metadata={"help": "Vocabulary size V."})
    width: int = field(default=1024, metadata={"help": "Width d (the embedding is V x d)."})
    steps: int = field(default=8, metadata={"help": "Optimizer steps; with metrics_every 4, steps 4 and 8 measure."})
    metrics_every: int = 4
    batch_size: int = 2
    sequence_length: int = 32
    output_dir: str = "runs/bench-deepspeed-measurement"
    stage: int | None = field(default=None, metadata={"help": "Internal: run this stage on this rank."})


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PeakGrowth(tf.TrainerCallback):
    """How much each optimizer step raised the process's peak resident memory."""

    def __init__(self) -> None:
        self.growth: dict[int, int] = {}
        self._before = 0

    def on_step_begin(self, args, state, control, **kwargs):
        self._before = peak_rss()

    def on_step_end(self, args, state, control, **kwargs):
        self.growth[state.global_step] = peak_rss() - self._before


def run_rank(args: BenchmarkArguments) -> dict | None:
    torch.set_num_threads(1)
    config = tf.GPT2Config(
        vocab_size=args.vocab,
        n_embd=args.width,
        n_layer=1,
        n_head=max(1, args.width // 64),
        n_positions=args.sequence_length,
    )
    ds_config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": args.stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    training = tf.TrainingArguments(
        output_dir=os.path.join(args.output_dir, f"z{args.stage}"),
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=1e-4,
        logging_steps=args.steps,
        save_strategy="no",
        report_to=[],
        deepspeed=ds_config,
        use_cpu=True,
        disable_tqdm=True,
    )
    tf.set_seed(0)
    model = tf.GPT2LMHeadModel(config)
    rule = untie.UntieWhen(signal="cancellation", threshold=0.5, warmup=10**9)  # measure, never fire
    callback = untie.UntieCallback(
        untie_at=None, untie_when=rule, metrics_every=args.metrics_every, pairs=[(2 * i, 2 * i + 1) for i in range(64)]
    )
    growth = PeakGrowth()
    dataset = RandomTokens(args.batch_size * args.steps * args.ranks, args.sequence_length, args.vocab)
    trainer = tf.Trainer(model=model, args=training, train_dataset=dataset, callbacks=[growth, callback])
    trainer.train()
    measured = {entry["step"] for entry in callback.history}
    plain = [bytes_ for step, bytes_ in growth.growth.items() if step not in measured and step > 2]
    measuring = [bytes_ for step, bytes_ in growth.growth.items() if step in measured]
    if int(os.environ["RANK"]) != 0:
        return None
    return {
        "stage": args.stage,
        "measured_steps": sorted(measured),
        "plain_growth_mib": max(plain) / 2**20,
        "measuring_growth_mib": max(measuring) / 2**20,
        "embedding_mib": args.vocab * args.width * 4 / 2**20,
        "peak_mib": peak_rss() / 2**20,
    }


def main() -> None:
    (args,) = tf.HfArgumentParser(BenchmarkArguments).parse_args_into_dataclasses()
    if args.stage is not None:
        print_result(run_rank(args))
        return
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    runs = []
    for stage in args.stages:
        runs.append(run_ranks(__file__, args.ranks, *sys.argv[1:], "--stage", str(stage)))
        print(json.dumps(runs[-1]), flush=True)
    rows = [
        "| ZeRO stage | plain step: peak growth | measuring step: peak growth | measurement's extra peak | "
        "share of the embedding (V x d fp32) |",
        "|---|---|---|---|---|",
    ]
    for run in runs:
        extra = max(0.0, run["measuring_growth_mib"] - run["plain_growth_mib"])
        rows.append(
            f"| {run['stage']} | {run['plain_growth_mib']:.0f} MiB | {run['measuring_growth_mib']:.0f} MiB "
            f"| {extra:.0f} MiB | {extra / run['embedding_mib']:.1%} |"
        )
    table = "\n".join(rows) + (
        f"\n\nPer rank (rank 0), {args.ranks} ranks, V {args.vocab} x d {args.width} (embedding "
        f"{args.vocab * args.width * 4 / 2**20:.0f} MiB in fp32). Machine: {machine()}; "
        f"`python benchmarks/deepspeed_measurement_memory.py {' '.join(sys.argv[1:])}`."
    )
    write_results(args.output_dir, runs, table)


if __name__ == "__main__":
    main()
