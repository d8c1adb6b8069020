"""Distributed training: which engine runs, which tying mode it allows, and keeping ranks in step (DDP, FSDP2)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from untie import _compat
from untie.errors import UntieRuntimeError

_WHY = {
    "FSDP1": "FSDP1 flattens every parameter of a unit into one FlatParameter at wrap time: a head created later is "
    "never sharded, and the emulated mode's gradient fold needs row-aligned shards. Use FSDP2 (accelerate "
    "`fsdp_version: 2`, or `fsdp_config={'version': 2}`), where tying_mode='auto' picks the emulated mode.",
    "MEGATRON_LM": "Megatron-LM manages (and ties) the embeddings itself.",
    "XLA": "XLA/TPU re-ties the weights when the model is moved to the device.",
}
#: Engines with a separate head parameter from the start only: a head created after wrapping is not managed.
_EMULATED_ONLY = {
    "FSDP2": "a live untie under FSDP2 is silently reverted: fully_shard re-assigns the head's parameter to the "
    "shared embedding at every unshard, and the new parameter never trains.",
    "DEEPSPEED": "ZeRO builds its flat fp32 partitions at engine init, so a head created later is never trained (the "
    "emulated mode ties the two roles in autograd instead, `untie.engines.zero_tying`).",
}


def training_engine(args=None) -> str | None:
    """The engine that trains the model: "FSDP2", "FSDP1", "DEEPSPEED", "MEGATRON_LM", "XLA" or None (DDP, one device).

    Trainer creates its Accelerator before `on_init_end`, so accelerate's state is what will actually run (e.g.
    `fsdp=True` on CPU trains unsharded). Without that state, read the arguments and accelerate's launch environment.
    """
    try:
        from accelerate.state import AcceleratorState, PartialState, is_initialized

        if is_initialized():  # an Accelerator exists (public since accelerate 1.0; it creates nothing)
            state = AcceleratorState()
            name = state.distributed_type.name
            if name == "FSDP":
                return f"FSDP{getattr(state.fsdp_plugin, 'fsdp_version', 1)}"
            return name if name in _WHY or name in _EMULATED_ONLY else None
        if _compat.partial_state_exists() and PartialState().distributed_type.name == "XLA":
            return "XLA"
    except (ImportError, AttributeError, ValueError):
        pass
    fsdp_config = getattr(args, "fsdp_config", None) or {}
    if getattr(args, "fsdp", None) or os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        version = fsdp_config.get("version", os.environ.get("FSDP_VERSION", 2))
        return f"FSDP{int(version)}"
    if getattr(args, "deepspeed", None) or os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        return "DEEPSPEED"
    return None


def resolve_tying_mode(requested: str, engine: str | None) -> str:
    """The tied phase's implementation for `engine`: "live" or "emulated"; raise where neither can work.

    "auto" picks "live" (one shared parameter, the cheapest) on one device and under DDP, and "emulated" where a
    head created after wrapping would not train (FSDP2, DeepSpeed). A forced mode is honoured unless the engine rules
    it out.
    """
    if engine in _WHY:
        raise UntieRuntimeError(
            f"untie does not support {engine}: {_WHY[engine]} A single device and DDP work in either tying_mode."
        )
    if engine in _EMULATED_ONLY:
        if requested == "live":
            raise UntieRuntimeError(
                f"tying_mode='live' cannot work under {engine}: {_EMULATED_ONLY[engine]} Use tying_mode='auto' or "
                "'emulated' (the head gets its own parameter before wrapping and trains exactly as if tied)."
            )
        return "emulated"
    return "live" if requested == "auto" else requested


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


@contextlib.contextmanager
def gathered(*params: torch.Tensor) -> Iterator[None]:
    """Within the block, DeepSpeed ZeRO-3 partitioned `params` hold their full values (read-only); others are left
    alone, as are those ZeRO-3 has gathered already (inside their module's forward). Every rank must enter it (it
    all-gathers)."""
    partitioned = [p for p in params if _compat.is_deepspeed_partitioned(p) and _compat.deepspeed_needs_gather(p)]
    if not partitioned:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None):
        yield


def full_shape(param: torch.Tensor) -> torch.Size:
    """A parameter's whole shape under every engine, without a collective: the one place the library reads a live
    parameter's rows and width.

    A DeepSpeed ZeRO-3 parameter holds only its partition between forwards (shape `[0]` when `from_pretrained`
    built it under `zero.Init`), so its `shape` is not the model's; its whole shape is ZeRO-3's record. FSDP2's
    DTensor reports its global shape. Dtypes need no helper (a partition keeps its parameter's dtype); values do:
    read them inside `gathered`.
    """
    return _compat.deepspeed_full_shape(param) if _compat.is_deepspeed_partitioned(param) else param.shape


def is_sharded(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a distributed tensor (an FSDP2 parameter), of which each rank holds a part."""
    return isinstance(tensor, DTensor)


def is_split(param: torch.Tensor) -> bool:
    """Whether each rank holds only a part of `param` (an FSDP2 shard, a ZeRO-3 partition)."""
    return is_sharded(param) or _compat.is_deepspeed_partitioned(param)


def union_rows(ids: torch.Tensor) -> torch.Tensor:
    """The sorted union of every rank's sorted, duplicate-free ids (lengths may differ). Every rank must call it."""
    sizes = [torch.zeros(1, dtype=torch.long, device=ids.device) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor([len(ids)], device=ids.device))
    longest = int(max(size.item() for size in sizes))
    padded = torch.full((longest,), -1, dtype=torch.long, device=ids.device)
    padded[: len(ids)] = ids
    gathered = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(gathered, padded)
    every = torch.cat(gathered)
    return torch.unique(every[every >= 0])


def gather_rows(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of a (V, d) matrix as a plain tensor on every rank, also when FSDP2 shards it by rows.

    Every rank must call it with the same ids. A row-sharded matrix costs one (len(ids), d) all-reduce, not the
    (V, d) all-gather of `full_tensor()`; other placements fall back to that.
    """
    if not is_sharded(weight):
        return weight.detach()[ids.to(weight.device)]
    assert isinstance(weight, DTensor)
    if tuple(weight.placements) != (Shard(0),):
        return weight.full_tensor().detach()[ids.to(weight.device)]
    local = weight.to_local().detach()
    group = weight.device_mesh.get_group()
    sizes = [torch.zeros(1, dtype=torch.long, device=local.device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, torch.tensor([local.shape[0]], device=local.device), group=group)
    offset = int(sum(size.item() for size in sizes[: dist.get_rank(group)]))
    ids = ids.to(local.device)
    mine = (ids >= offset) & (ids < offset + local.shape[0])
    rows = torch.zeros(len(ids), local.shape[1], dtype=local.dtype, device=local.device)
    rows[mine] = local[ids[mine] - offset]
    dist.all_reduce(rows, op=dist.ReduceOp.SUM, group=group)
    return rows
