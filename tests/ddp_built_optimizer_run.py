"""Worker for test_ddp.py: a loaded (trained) tied model wrapped by DDP and given an optimizer before
`untie.Untier(model, optimizer)`: the default unties it at the start of training, the copied head joins the optimizer
and its gradient is averaged over the ranks. Each rank dumps its run and final parameters."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import transformers as tf
import worker_exit

import untie
from untie.testing import step_llama_config, step_task, train_on_step_task


def main(out_dir: str) -> None:
    tf.logging.set_verbosity_error()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = train_on_step_task(tf.LlamaForCausalLM(step_llama_config()), 30, 1e-2)  # the same weights on each rank
    wrapped = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    untier = untie.Untier(wrapped, optimizer, max_steps=3)
    data = step_task()
    for _ in range(3):
        batch = data[rank * 16 : (rank + 1) * 16]  # each rank its own rows
        wrapped(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        untier.step()
    head = model.lm_head.weight
    in_optimizer = any(p is head for group in optimizer.param_groups for p in group["params"])
    torch.save(
        {
            "untie": (untier.untie_step, untier.untie_reason),
            "head_init": untier.run.decision.head_init,
            "in_optimizer": in_optimizer,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        },
        os.path.join(out_dir, f"rank{rank}.pt"),
    )
    untier.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    worker_exit.start()
    main(sys.argv[1])
    worker_exit.finish()
