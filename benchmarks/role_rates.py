"""Cost per step of the per-role learning rates (`UntieConfig.embedding_lr_scale`, `head_lr_scale`), against plain
Trainer, in one run.

Each arm trains the same untied GPT-2-shaped model (a 50,257-token vocabulary, so that the embedding and the head are
most of the optimizer's work) on the same random tokens, in a fresh subprocess, the arms alternating:

* ``plain``: Trainer, no callback;
* ``callback``: Trainer + UntieCallback() (the scales at 1: no groups of their own);
* ``split``: Trainer + UntieCallback(embedding_lr_scale=0.1, head_lr_scale=2.0): two more param groups, and the
  follower that sets their rates before every optimizer step.

    python benchmarks/role_rates.py --steps 40 --repeats 3 --output_dir runs/bench-role-rates
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field

import torch
import transformers as tf
from common import RandomTokens, StepTimer, arm_or_arms, benchmark_training_arguments, machine, write_results

import untie

ARMS = ("plain", "callback", "split")


class CpuStepTimer(StepTimer):
    """Wall time and CPU time of every optimizer step: on one thread the process's CPU time is the step's compute,
    which other jobs on a shared machine do not inflate as they inflate wall time."""

    def __init__(self) -> None:
        super().__init__()
        self.cpu: dict[int, float] = {}
        self._cpu_start = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._cpu_start = time.process_time()
        super().on_step_begin(args, state, control, **kwargs)

    def on_step_end(self, args, state, control, **kwargs):
        super().on_step_end(args, state, control, **kwargs)
        self.cpu[state.global_step] = time.process_time() - self._cpu_start


@dataclass
class BenchmarkArguments:
    steps: int = field(default=40, metadata={"help": "Optimizer steps per arm (the first 5 are not timed)."})
    layers: int = 2
    width: int = 256
    batch_size: int = 4
    sequence_length: int = 64
    threads: int = field(default=1, metadata={"help": "torch threads (1: steadier on a shared machine)."})
    repeats: int = field(default=3, metadata={"help": "Run the arms this many times, alternating; report medians."})
    output_dir: str = "runs/bench-role-rates"
    arm: str | None = field(default=None, metadata={"help": "Internal: run one arm in this process."})


def run_arm(args: BenchmarkArguments) -> dict:
    torch.set_num_threads(args.threads)
    tf.set_seed(0)
    config = tf.GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=4, tie_word_embeddings=False)
    model = tf.GPT2LMHeadModel(config)
    timer = CpuStepTimer()
    callbacks: list = [timer]
    if args.arm == "callback":
        callbacks.append(untie.UntieCallback())
    elif args.arm == "split":
        callbacks.append(untie.UntieCallback(embedding_lr_scale=0.1, head_lr_scale=2.0))
    training = benchmark_training_arguments(os.path.join(args.output_dir, args.arm), args.steps, args.batch_size)
    dataset = RandomTokens(args.steps * args.batch_size, args.sequence_length, config.vocab_size)
    trainer = tf.Trainer(model=model, args=training, train_dataset=dataset, callbacks=callbacks)
    trainer.train()
    timed = [d for s, d in timer.durations.items() if s > 5]
    cpu = [d for s, d in timer.cpu.items() if s > 5]
    return {"arm": args.arm, "mean_step_s": statistics.fmean(timed), "mean_step_cpu_s": statistics.fmean(cpu),
            "groups": len(trainer.optimizer.param_groups)}  # fmt: skip


def describe(run: dict) -> str:
    return f"mean step {run['mean_step_s']:.4f} s, {run['mean_step_cpu_s']:.4f} CPU s"


def main() -> None:
    args, runs = arm_or_arms(BenchmarkArguments, run_arm, ARMS, describe)
    if runs is None:
        return
    step = {arm: statistics.median(r["mean_step_s"] for r in runs if r["arm"] == arm) for arm in ARMS}
    cpu = {arm: statistics.median(r["mean_step_cpu_s"] for r in runs if r["arm"] == arm) for arm in ARMS}
    groups = {arm: next(r["groups"] for r in runs if r["arm"] == arm) for arm in ARMS}
    lines = [
        f"Per-role learning rates, cost per step on {machine()}, {args.threads} thread(s): GPT-2 {args.layers} x "
        f"{args.width}, 50,257-token vocabulary, untied, batch {args.batch_size} x {args.sequence_length}, "
        f"{args.steps} steps, median of {args.repeats} alternating runs.",
        "",
        "| arm | param groups | CPU s per step | vs plain Trainer | wall s per step | vs plain Trainer |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {arm} | {groups[arm]} | {cpu[arm]:.4f} | x{cpu[arm] / cpu['plain']:.3f} | {step[arm]:.4f} | "
        f"x{step[arm] / step['plain']:.3f} |"
        for arm in ARMS
    ]
    results = {"settings": vars(args), "step_s": step, "step_cpu_s": cpu, "runs": runs}
    write_results(args.output_dir, results, "\n".join(lines))


if __name__ == "__main__":
    main()
