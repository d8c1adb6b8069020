"""Worker for test_role_rates.py: an accelerate loop with `untie.Untier` and per-role learning rates, under `torchrun`
(DDP on gloo, 2 ranks) or one process.

A warm-up + cosine LambdaLR is built before `untier.start` (and passed to it), the model unties at UNTIE_AT, and
`accelerator.save_state` folders are written at SAVE_AT; then each is resumed into a fresh model in the same process.
Each rank saves, per run, the final parameters, the role rates it saw at every step (read by an optimizer step
post-hook, the rates the step used) and the source group's rate, to `<out>/<run>-rank<r>.pt`.
"""

from __future__ import annotations

import os
import sys

import torch
import transformers as tf
import worker_exit
from accelerate import Accelerator

import untie
from untie.testing import ToyLMDataset, tiny_model

STEPS, UNTIE_AT, SAVE_AT = 10, 4, (3, 6)
SCALES = dict(embedding_lr_scale=0.25, head_lr_scale=2.0)


def batch(step: int, rank: int) -> torch.Tensor:
    start = (step * 8 + rank * 64) % 120
    return ToyLMDataset(n=128).ids[start : start + 8]


def train(accelerator: Accelerator, out_dir: str, name: str, resume_from: str | None = None) -> None:
    torch.manual_seed(0)
    model = tiny_model("llama")
    untier = untie.Untier(model, max_steps=STEPS, accelerator=accelerator, untie_when=None, untie_at=UNTIE_AT, **SCALES)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.1)
    # accelerate steps a prepared scheduler once per process per optimizer step (split_batches=False)
    total = STEPS * accelerator.num_processes
    scheduler = tf.get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=3, num_training_steps=total)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    untier.start(optimizer, lr_scheduler=scheduler)
    seen = {}

    def record(opt, *_):
        groups = {g.get("untie_role"): g for g in opt.param_groups}
        seen[untier.global_step + 1] = (groups[None]["lr"], groups["input_embedding"]["lr"], groups["head"]["lr"])

    handle = untie.structure.surgery.inner_optimizer(optimizer).register_step_post_hook(record)
    first = 1
    if resume_from is not None:
        accelerator.load_state(resume_from)
        first = untier.global_step + 1
    rank = accelerator.process_index
    for step in range(first, STEPS + 1):
        ids = batch(step, rank)
        accelerator.backward(model(input_ids=ids, labels=ids).loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        untier.step()
        if resume_from is None and step in SAVE_AT:
            accelerator.save_state(os.path.join(out_dir, f"state-{step}"))
    handle.remove()
    untier.close()
    unwrapped = accelerator.unwrap_model(model)
    torch.save(
        {
            "untie_step": untier.untie_step,
            "rates": seen,
            "params": {n: p.detach().clone() for n, p in unwrapped.named_parameters()},
            "world_size": accelerator.num_processes,
        },
        os.path.join(out_dir, f"{name}-rank{rank}.pt"),
    )
    accelerator.free_memory()


def main(out_dir: str) -> None:
    accelerator = Accelerator(cpu=True)
    train(accelerator, out_dir, "run")
    for step in SAVE_AT:
        train(accelerator, out_dir, f"resume-{step}", os.path.join(out_dir, f"state-{step}"))


if __name__ == "__main__":
    worker_exit.start()
    main(sys.argv[1])
    worker_exit.finish()
