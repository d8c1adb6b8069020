"""`RoleGradientProbe`: split a tied matrix's gradient into its input-role and output-role parts, in the same backward.

The shared matrix W is used twice: looked up by the input embedding and multiplied by the LM head. Autograd sums
the two contributions into ``W.grad``. The probe hooks the two modules' outputs and, while armed, recomputes each
contribution from the output gradient that backward hands over anyway:

* output role: for a linear head, G_out = dL/dlogits^T @ h, the head's own weight-gradient product;
* input role: the embedding lookup's weight gradient, a scatter-add of dL/dembeddings onto the looked-up rows.

Modules of other types (a scaled embedding, a custom head) are differentiated generically, by re-running their
forward on a detached copy of W under autograd. No extra backward pass over the model is needed; the cost is one
(V, d) float32 buffer per role on the steps where the probe is armed.

Given symbol ``pairs``, the probe also sums their conditional gaps (`untie.metrics.conditional_gaps`) over the
positions that carry a loss (those whose logits receive a gradient), from the logits the head produces.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.func import functional_call

from untie.distributed import is_sharded, world_size
from untie.metrics import Pairs, pair_gap_sums, pair_key
from untie.surgery import _embedding_modules


class RoleGradientProbe:
    """Hooks on a tied (or emulated-tied) model's embedding and head that, while ``armed``, sum the two role gradients.

    The gradients accumulate over the micro-batches of an optimizer step, like ``W.grad`` does; before any
    clipping or all-reduce. Call `collect` after the step's last backward to get them (averaged over ranks,
    as DDP averages ``W.grad``), and `remove` to take the hooks off.
    """

    def __init__(self, model: nn.Module, pairs: Pairs = (), emulated: bool = False) -> None:
        embedding, self.head = _embedding_modules(model)
        if emulated:
            # `untie.emulation.EmulatedTying`: the head has its own parameter, kept equal to the embedding, and the
            # embedding receives the tied gradient; the roles are the same two module uses.
            if embedding.weight is self.head.weight or embedding.weight.shape != self.head.weight.shape:
                raise ValueError(
                    "RoleGradientProbe(emulated=True) needs a head with its own parameter of the embedding's shape "
                    "(untie.emulation.EmulatedTying); this model is really tied or its matrices differ in shape."
                )
        elif embedding.weight is not self.head.weight:
            raise ValueError(
                "RoleGradientProbe needs a tied model: the input embedding and the LM head share no weight (for "
                "emulated tying pass emulated=True)."
            )
        self.weight: nn.Parameter = embedding.weight
        # Every other module holding W is an input use: T5 and BART look it up through encoder and decoder modules.
        self.lookups = [m for m in model.modules() if m is not self.head and getattr(m, "weight", None) is self.weight]
        if is_sharded(self.weight):
            plain = [_module_type(m) is nn.Embedding for m in self.lookups] + [_module_type(self.head) is nn.Linear]
            if not all(plain):
                raise ValueError(
                    "RoleGradientProbe on a sharded (FSDP2) matrix supports plain nn.Embedding lookups and an "
                    f"nn.Linear head; this model has {[_module_type(m).__name__ for m in (*self.lookups, self.head)]}. "
                    "Measure on one device or under DDP, or untie at a fixed step (untie_at)."
                )
        self.armed = False
        self.input_grad: torch.Tensor | None = None
        self.output_grad: torch.Tensor | None = None
        self.pairs = list(pairs)
        vocab = self.weight.shape[0]
        if any(not 0 <= token < vocab for pair in self.pairs for token in pair):
            raise ValueError(
                f"pairs={self.pairs} holds token ids outside the model's vocabulary of {vocab}: pass ids in "
                f"[0, {vocab})."
            )
        self._gap_sums: tuple[torch.Tensor, torch.Tensor] | None = None
        #: Which pair symbols have occurred as input in any measured step so far.
        self._seen = torch.zeros(len(self.pairs), 2, dtype=torch.bool)
        self._handles = [m.register_forward_hook(self._on_embedding_forward, with_kwargs=True) for m in self.lookups]
        self._handles.append(self.head.register_forward_hook(self._on_head_forward, with_kwargs=True))

    # -- hooks ------------------------------------------------------------------------------------------------------
    def _on_embedding_forward(self, module, args, kwargs, output) -> None:
        if self.armed and isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(
                lambda grad: self._accumulate("input_grad", self._input_role(module, args, kwargs, grad))
            )

    def _on_head_forward(self, module, args, kwargs, output) -> None:
        if self.armed and isinstance(output, torch.Tensor) and output.requires_grad:
            logits = output.detach() if self.pairs else None

            def on_grad(grad: torch.Tensor) -> None:
                self._accumulate("output_grad", self._output_role(module, args, kwargs, grad))
                if logits is not None:
                    self._accumulate_gaps(logits, grad)

            output.register_hook(on_grad)

    def _input_role(self, module, args, kwargs, grad: torch.Tensor) -> torch.Tensor:
        if (
            _module_type(module) is nn.Embedding
            and module.max_norm is None
            and not module.scale_grad_by_freq
            and not kwargs
        ):
            ids = args[0].reshape(-1)
            role = torch.zeros(self.weight.shape, dtype=torch.float32, device=grad.device)
            role.index_add_(0, ids, grad.reshape(-1, grad.shape[-1]).float())
            if module.padding_idx is not None:
                role[module.padding_idx] = 0  # the lookup never sends gradient to the padding row
            return role
        return self._generic_role(module, args, kwargs, grad)

    def _output_role(self, module, args, kwargs, grad: torch.Tensor) -> torch.Tensor:
        if _module_type(module) is nn.Linear and not kwargs:
            hidden = args[0]
            return (grad.reshape(-1, grad.shape[-1]).T @ hidden.reshape(-1, hidden.shape[-1]).to(grad.dtype)).float()
        return self._generic_role(module, args, kwargs, grad)

    def _generic_role(self, module, args, kwargs, grad: torch.Tensor) -> torch.Tensor:
        """d<output, grad>/dW for any module, by re-running its forward on a detached copy of W."""
        weight = self.weight.detach().requires_grad_(True)
        detached_args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
        armed, self.armed = self.armed, False  # the re-run must not hook itself again
        try:
            with torch.enable_grad():
                output = functional_call(module, {"weight": weight}, detached_args, kwargs)
                (role,) = torch.autograd.grad(output, weight, grad)
        finally:
            self.armed = armed
        return role.float()

    def _accumulate_gaps(self, logits: torch.Tensor, grad: torch.Tensor) -> None:
        """Add this micro-batch's conditional-gap sums, over the positions whose logits carry a loss."""
        carries_loss = grad.reshape(-1, grad.shape[-1]).ne(0).any(dim=1)
        sums = pair_gap_sums(logits, self.pairs, carries_loss)
        if self._gap_sums is None:
            self._gap_sums = sums
        else:
            for mine, new in zip(self._gap_sums, sums, strict=True):
                mine.add_(new)

    def _accumulate(self, name: str, role: torch.Tensor) -> None:
        current = getattr(self, name)
        setattr(self, name, role if current is None else current.add_(role))

    # -- API --------------------------------------------------------------------------------------------------------
    def dense_weight(self) -> torch.Tensor:
        """W as one plain (V, d) tensor on every rank, for the pair pushes of `role_signals`: the parameter itself,
        or under FSDP2 its full tensor (an all-gather; every rank must call it)."""
        return self.weight.full_tensor() if is_sharded(self.weight) else self.weight

    def collect(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The step's (input_grad, output_grad), averaged over ranks; None if no backward ran while armed.

        Every rank must call it on the same steps (it all-reduces under torch.distributed).
        """
        grads, self.input_grad, self.output_grad = (self.input_grad, self.output_grad), None, None
        have = torch.tensor([float(all(g is not None for g in grads))], device=self.weight.device)
        if world_size() > 1:
            dist.all_reduce(have, op=dist.ReduceOp.MIN)
            if have.item() == 1.0:
                for grad in grads:
                    dist.all_reduce(grad, op=dist.ReduceOp.SUM)
                    grad /= dist.get_world_size()
        if have.item() != 1.0:
            self._gap_sums = None  # an incomplete step: its gaps are not read either
            return None
        return grads

    def conditional_gaps(self, input_grad: torch.Tensor) -> dict[str, float]:
        """``gap/<a-b>`` of each pair over the step's loss positions (all ranks); resets the sums.

        ``input_grad`` is the step's input-role gradient from `collect`: its nonzero rows are the tokens some rank
        looked up. A pair with a symbol that has not occurred as input in any measured step yet is NaN (the gap of a
        symbol the model never reads says nothing about tying); rare symbols need not occur in every step. Every
        rank must call it on the same steps (it all-reduces).
        """
        if self._gap_sums is None:  # nothing measured since the last read (or no pairs)
            return {f"gap/{pair_key(p)}": math.nan for p in self.pairs}
        index = torch.as_tensor(self.pairs, device=input_grad.device)
        # Set by the backward hook that also yields the output role: every rank that collect() vouched for has them.
        total, weight = self._gap_sums
        self._gap_sums = None
        if world_size() > 1:
            for tensor in (total, weight):
                dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        looked_up = torch.linalg.vector_norm(input_grad[index.reshape(-1)], dim=1).reshape(-1, 2).gt(0)
        self._seen |= looked_up.cpu()
        seen = self._seen.all(dim=1).to(weight.device)
        gaps = torch.where(seen & (weight > 0), total / weight.clamp_min(1e-300), torch.nan)
        return {f"gap/{pair_key(p)}": float(g) for p, g in zip(self.pairs, gaps, strict=True)}

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.armed = False
        self.input_grad = self.output_grad = None
        self._gap_sums = None


def _module_type(module: nn.Module) -> type:
    """The module's own class; FSDP2's `fully_shard` swaps in a subclass (``FSDPEmbedding``) that adds nothing."""
    return next(cls for cls in type(module).__mro__ if not issubclass(cls, FSDPModule))
