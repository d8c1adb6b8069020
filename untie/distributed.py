"""Distributed-training guards: refuse sharded engines, and keep a live-untied head in sync across DDP ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

_UNSUPPORTED = (
    "untie does not support {engine} yet: {why} Train with DDP (plain `accelerate launch` / torchrun) or a single "
    "device, or untie before wrapping and train the untied model."
)
_WHY = {
    "FSDP": "a live untie under FSDP2 is silently reverted (the head snaps back to the shared embedding) and FSDP1 "
    "cannot take a new parameter after wrapping.",
    "DEEPSPEED": "ZeRO builds its flat parameter partitions at engine init and cannot take a new parameter.",
    "MEGATRON_LM": "Megatron-LM manages embeddings itself.",
    "XLA": "XLA/TPU re-ties weights when the model is moved to the device.",
}


def refuse_unsupported_engines(args=None) -> None:
    """Raise a clear error under FSDP, DeepSpeed, Megatron-LM or TPU, where a live untie cannot work."""
    engines = []
    if args is not None:
        if getattr(args, "fsdp", None):
            engines.append("FSDP")
        if getattr(args, "deepspeed", None):
            engines.append("DEEPSPEED")
    try:
        from accelerate.state import PartialState

        if PartialState._shared_state:
            engines.append(PartialState().distributed_type.name)
    except (ImportError, AttributeError, ValueError):
        pass
    for engine in engines:
        for key, why in _WHY.items():
            if key in engine:
                raise RuntimeError(_UNSUPPORTED.format(engine=engine, why=why))


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def sync_grads_across_ranks(param: nn.Parameter) -> torch.utils.hooks.RemovableHandle | None:
    """Average `param.grad` over ranks whenever gradients are synchronised, as DDP does for the params it wrapped.

    DDP registers its all-reduce hooks at construction, so a parameter created after wrapping (the live-untied
    head) would otherwise train on each rank's local gradient and drift apart. The hook runs during backward, so
    gradient clipping sees the averaged gradient, and it skips gradient-accumulation micro-batches (no_sync).
    """
    if world_size() == 1:
        return None
    from accelerate.state import GradientState

    gradient_state = GradientState()
    # A group of its own: DDP's bucket all-reduces run asynchronously on the default group during the same backward,
    # and collectives interleaved on one group in a rank-dependent order can mismatch and hang.
    group = dist.new_group(backend=dist.get_backend())

    def all_reduce_mean(p: torch.Tensor) -> None:
        if p.grad is not None and gradient_state.sync_gradients:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=group)
            p.grad.div_(dist.get_world_size())

    return param.register_post_accumulate_grad_hook(all_reduce_mean)


def broadcast_decision(decision: bool) -> bool:
    """Rank 0's decision, on every rank: a trigger computed from local metrics must fire everywhere at once."""
    if world_size() == 1:
        return decision
    flag = torch.tensor([int(decision)], device=_collective_device())
    dist.broadcast(flag, src=0)
    return bool(flag.item())


def _collective_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
