"""Worker for test_untier.py: an accelerate loop with `untie.Untier`, under `torchrun` (DDP on gloo) or one process.

Trains a tiny GPT-2 for STEPS optimizer steps of MICRO_BATCHES micro-batches each (gradient accumulation through
`accelerator.accumulate`, clipping on the synchronised gradients), unties at UNTIE_AT and saves `accelerator.save_state`
folders at SAVE_AT. Then, in the same process, resumes from each saved folder into a fresh model and finishes the run.
Each rank saves every run's final parameters and untie state to `<out>/<run>-rank<r>.pt`.
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch
import torch.distributed as dist
import transformers as tf
import worker_exit
from accelerate import Accelerator
from footprint import foreign_installs, foreign_installs_kept, library_leftovers
from torch.nn.parallel import DistributedDataParallel

import untie
import untie.core.run
from untie.testing import ToyLMDataset, tiny_model

STEPS, MICRO_BATCHES, UNTIE_AT, SAVE_AT = 10, 2, 4, (3, 6)


def batch(step: int, micro: int, rank: int) -> torch.Tensor:
    """The micro-batch of optimizer step `step` on `rank`: a function of the three, so a resumed run sees the same."""
    start = (step * 8 + micro * 4 + rank * 64) % 124
    return ToyLMDataset(n=128).ids[start : start + 4]


def train(accelerator: Accelerator, out_dir: str, name: str, resume_from: str | None = None) -> None:
    model = _no_dropout(tiny_model("gpt2"))
    foreign = foreign_installs(model)  # someone else's hooks, installed before the run: they must survive it
    untier = untie.Untier(
        model,
        max_steps=STEPS,
        accelerator=accelerator,
        untie_when=None,
        untie_at=UNTIE_AT,
        metrics_every=2,
        pairs=[(3, 4)],
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    untier.start(optimizer)
    first = 1
    if resume_from is not None:
        accelerator.load_state(resume_from)
        first = untier.global_step + 1
    rank = accelerator.process_index
    logged = []
    for step in range(first, STEPS + 1):
        for micro in range(MICRO_BATCHES):
            with accelerator.accumulate(model):
                ids = batch(step, micro, rank)
                accelerator.backward(model(input_ids=ids, labels=ids).loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 0.5)
                optimizer.step()
                optimizer.zero_grad()
            logs = untier.step()
            if logs:
                logged.append((untier.global_step, logs))
        if resume_from is None and step in SAVE_AT:
            accelerator.save_state(os.path.join(out_dir, f"state-{step}"))
    extra = {"distributed_type": accelerator.distributed_type.name, "untie_reason": untier.untie_reason}
    extra.update(global_step=untier.global_step, history=untier.history, logged=logged)
    untier.close()
    extra["leftovers"] = library_leftovers(model=model, optimizer=optimizer, accelerator=accelerator)
    extra["foreign_kept"] = foreign_installs_kept(foreign)
    dump(accelerator.unwrap_model(model), untier, os.path.join(out_dir, f"{name}-rank{rank}.pt"), **extra)
    accelerator.free_memory()


def train_plain_ddp(out_dir: str) -> None:
    """The same run in a plain PyTorch loop: torch's DistributedDataParallel, `no_sync` for accumulation."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = _no_dropout(tiny_model("gpt2"))
    foreign = foreign_installs(model)
    untier = untie.Untier(model, max_steps=STEPS, untie_when=None, untie_at=UNTIE_AT, metrics_every=2, pairs=[(3, 4)])
    wrapped = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=5e-3, weight_decay=0.1)
    untier.start(optimizer)
    for step in range(1, STEPS + 1):
        for micro in range(MICRO_BATCHES):
            ids = batch(step, micro, rank)
            sync = contextlib.nullcontext() if micro == MICRO_BATCHES - 1 else wrapped.no_sync()
            with sync:
                (wrapped(input_ids=ids, labels=ids).loss / MICRO_BATCHES).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
        untier.step()
    untier.close()
    leftovers = library_leftovers(model=wrapped, optimizer=optimizer)
    dump(
        model,
        untier,
        os.path.join(out_dir, f"plain-rank{rank}.pt"),
        leftovers=leftovers,
        foreign_kept=foreign_installs_kept(foreign),
    )


def dump(model, untier, path: str, **extra) -> None:
    """Save a run's untie step, structure and final parameters (and `extra`) for the test to compare."""
    layout = untie.embedding_layout(model)
    result = {
        "untie_step": untier.untie_step,
        "tied": untie.is_tied(model),
        "input": model.get_parameter(layout.input_weight).detach().clone(),
        "output": model.get_parameter(layout.output_weight).detach().clone(),
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }
    torch.save({**result, **extra}, path)


def _no_dropout(model):
    for module in model.modules():  # the same numbers on every resume: no dropout
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


def main(out_dir: str, mode: str) -> None:
    tf.logging.set_verbosity_error()
    if mode == "plain":
        train_plain_ddp(out_dir)
        return
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=MICRO_BATCHES)
    if mode == "nosync":  # negative control: without the head's gradient sync the ranks drift apart
        untie.core.model_structure.sync_grads_across_ranks = lambda param: None
        train(accelerator, out_dir, "nosync")
        return
    train(accelerator, out_dir, "run")
    for step in SAVE_AT:
        accelerator.wait_for_everyone()
        train(accelerator, out_dir, f"resume-{step}", resume_from=os.path.join(out_dir, f"state-{step}"))


if __name__ == "__main__":
    worker_exit.start()
    main(sys.argv[1], sys.argv[2])
    worker_exit.finish()
