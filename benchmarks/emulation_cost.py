"""Cost of emulated tying (tying_mode="emulated", what FSDP2 runs use) in the tied phase, against plain tied Trainer.

Both arms train the same randomly initialised GPT-2-small-shaped model (tied, vocabulary 50257, d 768) on the same
random tokens, each in a fresh subprocess, arms alternating:

* ``tied``: Trainer, no callback: one shared parameter;
* ``emulated``: Trainer + UntieCallback(untie_at=None, untie_when=None, tying_mode="emulated",
  metrics_every=0): the head has its
  own parameter, kept tied by folding its gradient into the embedding's and copying the embedding after each step.

Reports, per arm: mean step time (the ratio is the per-step cost), bytes held by parameters and optimizer state at
the end, gradient bytes when the optimizer steps, the head's transient gradient during backward, and peak RSS.

    python benchmarks/emulation_cost.py --steps 30 --repeats 2
"""

from __future__ import annotations

import json
import os
import resource
import statistics
from dataclasses import dataclass, field

import torch
import transformers as tf
from common import RandomTokens, StepTimer, benchmark_training_arguments, run_arms_alternating

import untie

ARMS = ("tied", "emulated")


@dataclass
class EmulationBenchmarkArguments:
    steps: int = field(default=30, metadata={"help": "Optimizer steps per arm (the first 5 are not timed)."})
    batch_size: int = 2
    sequence_length: int = 128
    layers: int = field(default=12, metadata={"help": "GPT-2 small: 12."})
    repeats: int = field(default=2, metadata={"help": "Run the arms this many times, alternating; report medians."})
    output_dir: str = "runs/bench-emulation"
    arm: str | None = field(default=None, metadata={"help": "Internal: run one arm in this process."})


class GradientBytes(tf.TrainerCallback):
    """Gradient bytes when the optimizer steps, and the largest gradient the head held during a backward."""

    def __init__(self) -> None:
        self.at_step = 0
        self.head_transient = 0

    def watch_head(self, head: torch.nn.Parameter) -> None:
        def record(param: torch.Tensor) -> None:
            self.head_transient = max(self.head_transient, param.grad.untyped_storage().nbytes())

        head.register_post_accumulate_grad_hook(record)

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        grads = {
            p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes()
            for p in model.parameters()
            if p.grad is not None
        }
        self.at_step = max(self.at_step, sum(grads.values()))


def held_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    params = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return {"parameters": sum(params.values()), "optimizer_state": sum(v.untyped_storage().nbytes() for v in state)}


def run_arm(args: EmulationBenchmarkArguments) -> dict:
    tf.set_seed(0)
    config = tf.GPT2Config(n_layer=args.layers, n_positions=max(1024, args.sequence_length))
    model = tf.GPT2LMHeadModel(config)
    timer, gradients = StepTimer(), GradientBytes()
    callbacks = [timer, gradients]
    if args.arm == "emulated":
        callbacks.append(untie.UntieCallback(untie_at=None, untie_when=None, tying_mode="emulated", metrics_every=0))
    training = benchmark_training_arguments(os.path.join(args.output_dir, args.arm), args.steps, args.batch_size)
    dataset = RandomTokens(args.steps * args.batch_size, args.sequence_length, config.vocab_size)
    trainer = tf.Trainer(model=model, args=training, train_dataset=dataset, callbacks=callbacks)
    if args.arm == "emulated":  # the callback gave the head its own parameter when the Trainer was built
        gradients.watch_head(model.get_output_embeddings().weight)
    trainer.train()
    head, embedding = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    timed = [d for s, d in timer.durations.items() if s > 5]
    return {
        "arm": args.arm,
        "mean_step_s": statistics.fmean(timed),
        **held_bytes(model, trainer.optimizer),
        "gradients_at_step": gradients.at_step,
        "head_gradient_during_backward": gradients.head_transient,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "head_equals_embedding": bool(torch.equal(head, embedding)),
    }


def main() -> None:
    (args,) = tf.HfArgumentParser(EmulationBenchmarkArguments).parse_args_into_dataclasses()
    if args.arm:
        print("RESULT " + json.dumps(run_arm(args)))
        return
    runs = run_arms_alternating(
        __file__,
        ARMS,
        args.repeats,
        lambda run: f"mean step {run['mean_step_s']:.3f} s, RSS {run['peak_rss_mib']:.0f} MiB",
    )
    median = {
        arm: {
            key: statistics.median(r[key] for r in runs if r["arm"] == arm)
            for key in runs[0]
            if key not in ("arm", "head_equals_embedding")
        }
        for arm in ARMS
    }
    extra = {key: median["emulated"][key] - median["tied"][key] for key in median["tied"]}
    summary = {
        "settings": vars(args),
        "step_time_ratio": median["emulated"]["mean_step_s"] / median["tied"]["mean_step_s"],
        "extra": extra,
        "head_equals_embedding": all(r["head_equals_embedding"] for r in runs),
        "runs": runs,
    }
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, "results.json"), "w") as f:
        json.dump(summary, f, indent=2)
    mib = 2**20
    print(
        f"emulated vs tied: step time x{summary['step_time_ratio']:.4f}; extra parameters "
        f"{extra['parameters'] / mib:.1f} MiB, optimizer state {extra['optimizer_state'] / mib:.1f} MiB, gradients "
        f"at the step {extra['gradients_at_step'] / mib:.1f} MiB, head gradient during backward "
        f"{median['emulated']['head_gradient_during_backward'] / mib:.1f} MiB, peak RSS {extra['peak_rss_mib']:+.0f} "
        f"MiB; head == embedding at the end: {summary['head_equals_embedding']}"
    )


if __name__ == "__main__":
    main()
