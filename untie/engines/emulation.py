"""Emulated tying: a model whose LM head has its own parameter from step 0 but trains exactly as if tied.

Sharded engines cannot take a live untie: FSDP2 silently reverts a head parameter created after `fully_shard`, and
FSDP1 / DeepSpeed cannot add parameters after wrapping. So the head exists from the start, as a copy of the input
embedding, and `EmulatedTying` keeps the two identical while the run is "tied":

* at the end of every backward (after DDP's all-reduce or FSDP2's reduce-scatter), the head's gradient is folded
  into the embedding's: ``W_e.grad += W_h.grad`` and ``W_h.grad = None``. The embedding then holds the tied gradient
  g_in + g_out, gradient clipping sees exactly the tied norm, and the optimizer skips the head (no gradient: no
  update, no weight decay, no state);
* after every optimizer step, the head's values are copied from the embedding. Both have one shape and one sharding,
  so under FSDP2 this is a copy of local shards.

Untying is `release()`: the hooks stop and the head gets a copy of the embedding's optimizer state (or none), the
same fork as a live untie. The extra memory while tied is the head's parameter and, during backward, its gradient.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from untie import _compat
from untie.decision.settings import OptimizerStateInit
from untie.distributed import full_shape
from untie.errors import UntieValueError
from untie.registry import Registry
from untie.roles import embedding_modules
from untie.structure.surgery import inner_optimizer, start_state_like


def separate_roles(model: nn.Module, owner: str) -> tuple[Any, Any]:
    """The model's embedding and head modules, refused unless the head has its own parameter of the embedding's
    shape (what an emulation of tying keeps equal to the embedding)."""
    embedding, head = embedding_modules(model)
    if embedding.weight is head.weight:
        raise UntieValueError(
            f"{owner} needs a model whose head has its own parameter; this one is really tied. Call "
            "untie.untie_embeddings(model) first (the head starts as an exact copy of the embedding)."
        )
    if full_shape(embedding.weight) != full_shape(head.weight):
        raise UntieValueError(
            f"{owner}: the embedding {tuple(embedding.weight.shape)} and the head {tuple(head.weight.shape)} differ "
            "in shape, so they cannot be tied."
        )
    return embedding, head


class EmulatedTying:
    """Keeps an untied model's LM head equal to its input embedding, with the tied gradient, until `release()`.

    Attach it to the model before wrapping (DDP / FSDP2) and call `attach_optimizer` once the optimizer exists.
    Hooks are registered on the modules, so they survive `fully_shard` and DDP, which keep the module objects.
    """

    reads_at_step = False
    """The tied gradient sits in the embedding's `.grad` once folded; `after_fold` listeners read it (`TiedPhase`)."""

    def __init__(self, model: nn.Module, registry: Registry | None = None) -> None:
        self.embedding: Any
        self.head: Any
        self.embedding, self.head = separate_roles(model, "EmulatedTying")
        self.active = True
        self._fold_queued = False
        #: Every hook it installs, with its removal: a child of the run's registry, so that closing the run closes it.
        self.registry = registry.child("emulated tying") if registry is not None else Registry("emulated tying")
        for module in model.modules():
            if module is not self.head and getattr(module, "weight", None) is self.embedding.weight:
                self.registry.hook("emulated tying: lookup forward hook", module.register_forward_hook(self._on_lookup))
        self._on_optimizer: Registry | None = None
        """The optimizer hooks of `attach_optimizer` (None while detached)."""
        #: Called after every fold, when the embedding holds the step's tied gradient so far (the probe reads it).
        self.after_fold: list = []

    # -- hooks ---------------------------------------------------------------------------------------------------------
    def _on_lookup(self, module, args, output) -> None:
        if self.active and isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(self._queue_fold)

    def _queue_fold(self, grad: torch.Tensor) -> None:
        # The lookup's output gradient arrives near the end of backward, but before the embedding's own weight
        # gradient: DDP queues its gradient finalisation (copying the averaged buckets into .grad) only once that one
        # is ready, i.e. after this point. So queue a callback that queues the fold: callbacks queued while the
        # queue runs go to its end, after DDP's finalisation and FSDP2's reduce-scatter (queued at backward start).
        if not self._fold_queued:
            self._fold_queued = True
            _compat.queue_autograd_callback(self._queue_fold_last)

    def _queue_fold_last(self) -> None:
        _compat.queue_autograd_callback(self.fold_gradients)

    def fold_gradients(self) -> None:
        """Move the head's gradient into the embedding's: the embedding holds the tied gradient, the head none."""
        self._fold_queued = False
        if not self.active:
            return
        embedding, head = self.embedding.weight, self.head.weight
        if head.grad is not None:
            if embedding.grad is None:
                embedding.grad = head.grad.clone()
            else:
                embedding.grad.add_(head.grad)
            head.grad = None
        for listener in self.after_fold:
            listener()

    def mirror_weights(self, *_args) -> None:
        """Copy the embedding's values into the head (after an optimizer step)."""
        if self.active:
            self.head.weight.grad = None
            with torch.no_grad():
                self.head.weight.copy_(self.embedding.weight)

    # -- API -----------------------------------------------------------------------------------------------------------
    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Mirror the head after each step of `optimizer`, and start it equal to the embedding.

        Call it after a resumed run loaded its checkpoint: the head's optimizer state saved with a tied-phase
        checkpoint (see `_add_head_state`) is dropped again, as the head has none while tied.
        """
        inner = inner_optimizer(optimizer)
        if self._on_optimizer is None:
            self._on_optimizer = self.registry.child("optimizer")
            self._on_optimizer.hook(
                "emulated tying: mirror after step", inner.register_step_post_hook(self.mirror_weights)
            )
            hook = inner.register_state_dict_post_hook(self._add_head_state)
            self._on_optimizer.hook("emulated tying: head state in state_dict", hook)
        inner.state.pop(self.head.weight, None)
        self.mirror_weights()

    def _add_head_state(self, optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
        """Save the embedding's optimizer state for the head too (the same tensors: no copy) while tied.

        A checkpoint then holds state for every parameter, which torch.distributed.checkpoint's loader (FSDP2
        resume) requires: it plans one entry per parameter of the freshly initialised optimizer.
        """
        if self.active:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            index = {id(p): i for i, p in enumerate(params)}
            embedding, head = index.get(id(self.embedding.weight)), index.get(id(self.head.weight))
            state = state_dict["state"]
            if embedding in state and head is not None and head not in state:
                state[head] = state[embedding]
        return state_dict

    def release(
        self, optimizer: torch.optim.Optimizer | None = None, optimizer_state: OptimizerStateInit = "copy"
    ) -> None:
        """Untie: stop folding and mirroring; the head's optimizer state starts as a copy of the embedding's or empty.

        Call it between optimizer steps (the head was mirrored by the last one). Nothing is copied into the weights,
        so releasing a model resumed from a checkpoint saved after the untie keeps its trained head.
        """
        self.active = False
        self.remove()
        if optimizer is not None:
            start_state_like(optimizer, new=self.head.weight, like=self.embedding.weight, state=optimizer_state)

    def remove(self) -> None:
        """Take every hook off, the model's and the optimizer's."""
        self.registry.close()
        self._on_optimizer = None

    def detach_optimizer(self) -> None:
        """Take `attach_optimizer`'s hooks off the optimizer (the run is over; `attach_optimizer` puts them back)."""
        if self._on_optimizer is not None:
            self._on_optimizer.close()
            self._on_optimizer = None
