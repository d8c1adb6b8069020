"""Worker for test_fsdp2.py: under `torchrun --nproc_per_node 2`, train a tiny GPT-2 sharded with FSDP2 (gloo, CPU).

Mode "tied" shares one parameter between the embedding and the head (accelerate's layout: both in one FSDP group);
mode "emulated" gives the head its own parameter and keeps it tied with `EmulatedTying` until RELEASE_STEP (accelerate's
untied layout: the embedding in its own group, the head with the final norm); mode "untier" does the same through the
public custom-loop API, `untie.Untier(..., tying_mode="emulated")`. Each rank saves its losses, pre-clip
gradient norms, full matrices at the release step and at the end, and its local shards.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import worker_exit
from footprint import foreign_installs, foreign_installs_kept, library_leftovers
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import untie
from untie.engines.emulation import EmulatedTying
from untie.testing import ToyLMDataset, tiny_model

STEPS, RELEASE_STEP, MICRO_BATCHES = 12, 7, 2


def full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def main(out_dir: str, mode: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = tiny_model("gpt2")
    foreign = foreign_installs(model)  # someone else's hooks, installed before the run: they must survive it
    emulation = untier = None
    if mode == "emulated":
        untie.untie_embeddings(model)
        emulation = EmulatedTying(model)  # before sharding: the hooks live on the modules, which fully_shard keeps
    elif mode == "untier":  # the public custom-loop API: the Untier sets emulated tying up before sharding
        untier = untie.Untier(
            model, max_steps=STEPS, untie_when=None, untie_at=RELEASE_STEP, tying_mode="emulated", metrics_every=0
        )
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    shard(model, separate_head=mode in ("emulated", "untier"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.1)
    if emulation is not None:
        emulation.attach_optimizer(optimizer)
    if untier is not None:
        untier.start(optimizer)
    data = ToyLMDataset(n=128).ids
    losses, norms, at_release = [], [], {}
    for step in range(1, STEPS + 1):
        total = 0.0
        for micro in range(MICRO_BATCHES):
            start = (step * 8 + micro * 4 + rank * 64) % 124
            ids = data[start : start + 4]
            loss = model(input_ids=ids, labels=ids).loss / MICRO_BATCHES
            loss.backward()
            total += loss.item()
        norms.append(full(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3)).item())  # clipping bites
        optimizer.step()
        optimizer.zero_grad()
        if untier is not None:
            untier.step()
        losses.append(total)
        if step == RELEASE_STEP:
            assert untier is None or (untier.untie_step, untier.untie_reason) == (RELEASE_STEP, "deadline")
            if emulation is not None:
                emulation.release(optimizer)
            at_release = {"embedding": full(embedding.weight), "head": full(head.weight)}
    teardown = {}
    if untier is not None:
        untier.close()
        teardown = {"leftovers": library_leftovers(model=model, optimizer=optimizer)}
        teardown.update(foreign_kept=foreign_installs_kept(foreign), ends_tied=run_that_ends_tied())
    torch.save(
        {
            **teardown,
            "losses": losses,
            "norms": norms,
            "at_release": at_release,
            "embedding": full(embedding.weight),
            "head": full(head.weight),
            "sharded": isinstance(embedding.weight, DTensor) and isinstance(head.weight, DTensor),
            "local_rows": embedding.weight.to_local().shape[0],
        },
        os.path.join(out_dir, f"{mode}-rank{rank}.pt"),
    )


def shard(model, separate_head: bool) -> None:
    """accelerate's FSDP2 layouts: tied (embedding and head in one group) or untied (the embedding alone)."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    for block in model.transformer.h:
        fully_shard(block)
    if separate_head:
        fully_shard(embedding)
        fully_shard([model.transformer.ln_f, head], reshard_after_forward=False)
    else:
        fully_shard([model.transformer.ln_f, embedding, head], reshard_after_forward=False)
    fully_shard(model)


def run_that_ends_tied() -> dict:
    """An Untier run that ends still tied (emulated, measuring): what its close() leaves on the sharded model."""
    model = tiny_model("gpt2")
    foreign = foreign_installs(model)
    untier = untie.Untier(model, max_steps=2, untie_when=None, untie_at=None, tying_mode="emulated", metrics_every=1)
    shard(model, separate_head=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    untier.start(optimizer)
    ids = ToyLMDataset(n=8).ids[:4]
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        untier.step()
    measured = [h["step"] for h in untier.history]
    untier.close()
    leftovers = library_leftovers(model=model, optimizer=optimizer)
    return {"measured": measured, "leftovers": leftovers, "foreign_kept": foreign_installs_kept(foreign)}


if __name__ == "__main__":
    worker_exit.start()
    main(sys.argv[1], sys.argv[2])
    worker_exit.finish()
