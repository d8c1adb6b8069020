"""`RoleGradientProbe`: split a tied matrix's gradient into its input-role and output-role parts, in the same backward.

The shared matrix W is used twice: looked up by the input embedding and multiplied by the LM head. Autograd sums
the two contributions into ``W.grad``. The probe hooks the two modules' outputs and, while armed, recomputes each
contribution from the output gradient that backward hands over anyway:

* output role: for a linear head, G_out = dL/dlogits^T @ h, the head's own weight-gradient product;
* input role: the embedding lookup's weight gradient, a scatter-add of dL/dembeddings onto the looked-up rows.

Modules of other types (a scaled embedding, a custom head) are differentiated generically, by re-running their
forward on a detached copy of W under autograd. No extra backward pass over the model is needed; the cost is one
(V, d) float32 buffer per role on the steps where the probe is armed.

Given symbol ``pairs``, the probe also sums, over the positions that carry a loss (those whose logits receive a
gradient), their conditional gaps (`untie.metrics.conditional_gaps`), the evidence the targets give against their
conditional equivalence (`untie.metrics.pair_evidence_sums`), and the cross-entropy that tells a model that has
learned from an untrained one (`untie.metrics.learned_z`). The targets are read off the logits' gradient
(`untie.metrics.targets_from_gradient`), so neither the batch nor the loss code is needed.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.func import functional_call

from untie.distributed import is_sharded, world_size
from untie.metrics import (
    Pairs,
    cross_entropy_sums,
    learned_z,
    log_normalizers,
    pair_evidence_sums,
    pair_gap_sums,
    pair_key,
    targets_from_gradient,
)
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
        #: The measured step's sums, one float64 vector (a single all-reduce): gap numerators and denominators,
        #: evidence (P each), then the cross-entropy's sum, sum of squares and count.
        self._sums: torch.Tensor | None = None
        self._vocab = vocab
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
                    self._accumulate_pair_sums(logits, grad)

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

    def _accumulate_pair_sums(self, logits: torch.Tensor, grad: torch.Tensor) -> None:
        """Add this micro-batch's gap, evidence and cross-entropy sums, over the positions whose logits carry a loss."""
        flat_grad = grad.reshape(-1, grad.shape[-1])
        carries_loss = flat_grad.ne(0).any(dim=1)
        flat_logits = logits.reshape(-1, logits.shape[-1])[carries_loss]
        targets = targets_from_gradient(flat_grad[carries_loss])
        log_norm = log_normalizers(flat_logits)
        sums = torch.cat(
            [
                *pair_gap_sums(flat_logits, self.pairs, log_norm=log_norm),
                pair_evidence_sums(flat_logits, targets, self.pairs)[0],
                cross_entropy_sums(flat_logits, targets, log_norm=log_norm),
            ]
        )
        self._sums = sums if self._sums is None else self._sums.add_(sums)

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
            self._sums = None  # an incomplete step: its gaps are not read either
            return None
        return grads

    def conditional_gaps(self, input_grad: torch.Tensor) -> dict[str, float]:
        """The pair measurements of the step's loss positions (all ranks); resets the sums.

        * ``gap/<a-b>``: the pair's conditional gap (`untie.metrics.conditional_gaps`), in nats;
        * ``evidence/<a-b>``: the step's evidence against the pair's conditional equivalence
          (`untie.metrics.pair_evidence_sums`), in nats (0 when neither symbol was a target);
        * ``learned_z``: how far the step's cross-entropy lies below that of an uninformed prediction, in standard
          errors (`untie.metrics.learned_z`).

        ``input_grad`` is the step's input-role gradient from `collect`: its nonzero rows are the tokens some rank
        looked up. A pair with a symbol that has not occurred as input in any measured step yet is NaN (a symbol the
        model never reads says nothing about tying); rare symbols need not occur in every step. Every rank must call
        it on the same steps (it all-reduces).
        """
        if self._sums is None:  # nothing measured since the last read (or no pairs)
            nan = {f"{name}/{pair_key(p)}": math.nan for name in ("gap", "evidence") for p in self.pairs}
            return {**nan, "learned_z": math.nan} if self.pairs else nan
        index = torch.as_tensor(self.pairs, device=input_grad.device)
        # Set by the backward hook that also yields the output role: every rank that collect() vouched for has them.
        sums, self._sums = self._sums, None
        if world_size() > 1:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM)
        total, weight, evidence, loss_sums = sums.split([len(self.pairs)] * 3 + [3])
        looked_up = torch.linalg.vector_norm(input_grad[index.reshape(-1)], dim=1).reshape(-1, 2).gt(0)
        self._seen |= looked_up.cpu()
        seen = self._seen.all(dim=1).to(weight.device)
        gaps = torch.where(seen & (weight > 0), total / weight.clamp_min(1e-300), torch.nan)
        evidence = torch.where(seen, evidence, torch.nan)
        measured = {f"gap/{pair_key(p)}": float(g) for p, g in zip(self.pairs, gaps, strict=True)}
        measured.update({f"evidence/{pair_key(p)}": float(e) for p, e in zip(self.pairs, evidence, strict=True)})
        measured["learned_z"] = learned_z(loss_sums.cpu(), self._vocab)
        return measured

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.armed = False
        self.input_grad = self.output_grad = None
        self._sums = None


def _module_type(module: nn.Module) -> type:
    """The module's own class; FSDP2's `fully_shard` swaps in a subclass (``FSDPEmbedding``) that adds nothing."""
    return next(cls for cls in type(module).__mro__ if not issubclass(cls, FSDPModule))
