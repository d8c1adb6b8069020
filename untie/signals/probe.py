"""`RoleGradientProbe`: split a tied matrix's gradient into its input-role and output-role parts, in the same backward.

The shared matrix W is used twice: looked up by the input embedding and multiplied by the LM head. Autograd sums the
two contributions into ``W.grad``. The probe measures them in memory that scales with the batch, not the vocabulary:

* input role G_in: the embedding lookup's weight gradient, a scatter-add of dL/dembeddings onto the looked-up rows T,
  recomputed from the output gradient that backward hands over anyway and kept as |T| rows;
* output role G_out: dense over the vocabulary, but it is the rest of the tied gradient, G_out = W.grad - G_in. The
  probe reads |W.grad|^2 when backward ends (after DDP's all-reduce) and, at `collect`, the rows of W.grad that the
  role signals use (T and the pairs' rows), so it never materialises G_out: |G_out|^2 = |W.grad|^2
  - 2 W.grad[T] . G_in[T] + |G_in|^2, exactly.

Between backward and the optimizer step, Trainer (and most loops) clip the gradient, and a GradScaler unscales it:
both scale every gradient by one factor. The probe recovers that factor from |W.grad| at both moments and checks,
row by row, that nothing else changed the gradient; if something did (``clip_grad_value_``, a gradient hook), the
role signals are NaN for that step (a NaN never unties) and it says so once.

A lookup of another type than `nn.Embedding` (a scaled embedding) is differentiated by re-running its forward on a
detached W with sparse gradients, so it stays O(|T| d) too. The extra memory of a measuring step is O(|T| d) float32,
plus the logits' rows processed a few at a time when pairs are measured.

Given symbol ``pairs``, the probe also sums, over the positions that carry a loss (those whose logits receive a
gradient), their conditional gaps (`untie.signals.metrics.pair_gap_sums_from_log_probs`), the evidence the targets give
against their conditional equivalence (`untie.signals.metrics.pair_evidence_sums`), and the cross-entropy that tells a
model that has learned from an untrained one (`untie.signals.metrics.learned_z`). The targets are read off the logits'
gradient (`untie.signals.metrics.targets_from_gradient`), so neither the batch nor the loss code is needed.
"""

from __future__ import annotations

import logging
import math
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.func import functional_call

from untie import _compat
from untie.distributed import full_shape, gather_rows, is_sharded, union_rows, world_size
from untie.errors import UntieValueError
from untie.registry import Registry
from untie.roles import embedding_modules
from untie.signals.metrics import (
    Pairs,
    RoleGradients,
    cross_entropy_sums_from_target_logits,
    learned_z,
    metric_key,
    pair_evidence_sums_from_log_odds,
    pair_gap_sums_from_log_probs,
    targets_from_gradient,
)

logger = logging.getLogger("untie")

#: Logit entries processed at once for the pair sums: 2**22 float32 values (16 MiB), whatever the vocabulary.
_LOGIT_CHUNK = 1 << 22
#: Largest relative difference, per row, between the gradient's squared norms at the end of backward and at the
#: optimizer step, after the common factor is taken out, that still counts as "scaled by one factor" (at least; a
#: half-precision gradient rounds its scaled values, so its tolerance is two of its epsilons).
_SCALE_TOLERANCE = 1e-4


class RoleGradientProbe:
    """Hooks on a tied (or emulated-tied) model's embedding and head that, while ``armed``, measure the two role
    gradients of the shared matrix on the rows that carry information (`untie.signals.metrics.RoleGradients`).

    The gradients accumulate over the micro-batches of an optimizer step, like ``W.grad`` does. Call `collect` after
    the step's last backward (before the optimizer step; after clipping is fine) to get them, averaged over ranks as
    DDP averages ``W.grad``, and `remove` to take the hooks off.

    Args:
        model: a tied model, or with ``emulation`` the model whose tying it emulates.
        pairs: token-id pairs whose conditional gaps and evidence are measured too.
        emulation: the model's `untie.engines.emulation.EmulatedTying`: the embedding then holds the tied gradient once
            the head's gradient is folded into it, which is when the probe reads it.
        registry: the run's `untie.core.registry.Registry`: the probe's hooks go in a child of it, so that closing
            the run takes them off too.
    """

    def __init__(self, model: nn.Module, pairs: Pairs = (), emulation=None, registry: Registry | None = None) -> None:
        embedding, self.head = embedding_modules(model)
        if emulation is not None:
            # The head has its own parameter, kept equal to the embedding, and the embedding receives the tied
            # gradient; the roles are the same two module uses.
            if embedding.weight is self.head.weight or full_shape(embedding.weight) != full_shape(self.head.weight):
                raise UntieValueError(
                    "RoleGradientProbe(emulation=...) needs a head with its own parameter of the embedding's shape "
                    "(untie.engines.emulation.EmulatedTying); this model is really tied or its matrices differ in "
                    "shape."
                )
        elif embedding.weight is not self.head.weight:
            raise UntieValueError(
                "RoleGradientProbe needs a tied model: the input embedding and the LM head share no weight (for "
                "emulated tying pass emulation=EmulatedTying(model))."
            )
        self.weight: nn.Parameter = embedding.weight
        # Every other module holding W is an input use: T5 and BART look it up through encoder and decoder modules.
        self.lookups = [m for m in model.modules() if m is not self.head and getattr(m, "weight", None) is self.weight]
        if is_sharded(self.weight) and not all(_module_type(m) is nn.Embedding for m in self.lookups):
            raise UntieValueError(
                "RoleGradientProbe on a sharded (FSDP2) matrix supports plain nn.Embedding lookups; this model has "
                f"{[_module_type(m).__name__ for m in self.lookups]}. Measure on one device or under DDP, or untie "
                "at a fixed step (untie_at)."
            )
        self.armed = False
        self.pairs = list(pairs)
        vocab = full_shape(self.weight)[0]
        if any(not 0 <= token < vocab for pair in self.pairs for token in pair):
            raise UntieValueError(
                f"pairs={self.pairs} holds token ids outside the model's vocabulary of {vocab}: pass ids in "
                f"[0, {vocab})."
            )
        self._vocab = vocab
        #: (P, 2) token ids of the pairs, moved to the logits' device where they are read.
        self._pair_ids = torch.as_tensor(self.pairs, dtype=torch.long).reshape(-1, 2)
        self._emulation = emulation
        #: The step's input role so far: (ids, rows) per micro-batch, merged by `collect`.
        self._input_parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        #: Per-row squared norms of W.grad (this rank's rows: O(V) floats) when the step's last backward ended.
        self._backward_row_sq: torch.Tensor | None = None
        self._read_queued = False
        self._scale_warned = False
        #: The measured step's sums, one float64 vector (a single all-reduce): gap numerators and denominators,
        #: evidence (P each), then the cross-entropy's sum, sum of squares and count.
        self._sums: torch.Tensor | None = None
        #: Which pair symbols have occurred as input in any measured step so far.
        self._seen = torch.zeros(len(self.pairs), 2, dtype=torch.bool)
        #: Every hook and listener the probe installs, with its removal (`remove` takes them all off).
        self.registry = registry.child("probe") if registry is not None else Registry("probe")
        for module in self.lookups:
            hook = module.register_forward_hook(self._on_embedding_forward, with_kwargs=True)
            self.registry.hook("probe: lookup forward hook", hook)
        if self.pairs:
            self.registry.hook("probe: head forward hook", self.head.register_forward_hook(self._on_head_forward))
        #: Under DeepSpeed (`untie.engines.zero_tying.ZeroTying`) the tied gradient never sits in W.grad, and the
        #: engine steps inside backward: the tying calls `_read_reduced_gradient` at its optimizer's step, before the
        #: step, where each rank reads the rows it needs from its part of ZeRO's reduced gradient.
        self._reads_at_step = emulation is not None and emulation.reads_at_step
        #: Under DeepSpeed: the rows of W this step reads (and the pairs'), kept at the lookup, before the step.
        self._weight_parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        #: Under DeepSpeed: the step's role gradients, read at its optimizer step, for `collect`.
        self._read_at_step: RoleGradients | None = None
        if self._reads_at_step:
            emulation.listen(lambda: self.armed, self._keep_weight_rows, self._read_reduced_gradient)
            self.registry.add("probe: ZeRO tying's listeners", emulation.stop_listening)
        elif emulation is not None:
            emulation.after_fold.append(self._read_gradient)
            self.registry.add("probe: after-fold listener", lambda: emulation.after_fold.remove(self._read_gradient))

    # -- hooks ---------------------------------------------------------------------------------------------------------
    def _on_embedding_forward(self, module, args, kwargs, output) -> None:
        if self.armed and isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda grad: self._on_lookup_grad(module, args, kwargs, grad))

    def _on_lookup_grad(self, module, args, kwargs, grad: torch.Tensor) -> None:
        self._input_parts.append(self._input_role(module, args, kwargs, grad))
        if self._emulation is None and not self._read_queued:
            # W's own gradient is complete only when backward ends, after DDP's all-reduce: DDP queues that
            # finalisation once W's gradient is ready, i.e. after this hook. A callback queued while the queue runs
            # goes to its end, so queue one that queues the read (as `EmulatedTying` queues its fold).
            self._read_queued = True
            _compat.queue_autograd_callback(lambda: _compat.queue_autograd_callback(self._read_gradient))

    def _keep_weight_rows(self, input_ids: torch.Tensor, weight: torch.Tensor) -> None:
        """Keep W's rows that this micro-batch looks up, and the pairs' (DeepSpeed steps inside backward, before
        `collect` could read them)."""
        ids = torch.unique(torch.cat([input_ids.reshape(-1), self._pair_ids.reshape(-1).to(input_ids.device)]))
        self._weight_parts.append((ids, weight.detach()[ids.to(weight.device)].float()))

    def _weight_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """W's rows `ids` as the step read them, from the rows each rank kept (W is the same on every rank; the
        pairs' rows are kept everywhere and each looked-up row by some rank). Every rank must call it."""
        parts, self._weight_parts = self._weight_parts, []
        kept_ids = torch.cat([p[0] for p in parts]).to(ids.device)
        kept_rows = torch.cat([p[1] for p in parts]).to(ids.device)
        rows = torch.zeros(len(ids), kept_rows.shape[1], dtype=torch.float32, device=ids.device)
        counts = torch.zeros(len(ids), 1, dtype=torch.float32, device=ids.device)
        wanted = torch.isin(kept_ids, ids)
        position = torch.searchsorted(ids, kept_ids[wanted])
        rows[position] = kept_rows[wanted]  # a row kept twice holds the same values
        counts[position] = 1.0
        if world_size() > 1:
            dist.all_reduce(rows, op=dist.ReduceOp.SUM)
            dist.all_reduce(counts, op=dist.ReduceOp.SUM)
        return rows / counts.clamp_min(1.0)

    def _on_head_forward(self, module, args, output) -> None:
        if not (self.armed and isinstance(output, torch.Tensor) and output.requires_grad):
            return
        logits = output.detach()
        if (
            _module_type(module) is nn.Linear
            and not isinstance(module, FSDPModule)
            and not _compat.is_deepspeed_partitioned(module.weight)
            and len(args) == 1
        ):
            # Keep (N, 2P + 1) numbers per position, not the (N, V) logits: the target's logit is recomputed in
            # backward from the head's input (which autograd keeps for the head's weight gradient anyway).
            index = self._pair_ids.to(logits.device)
            log_norm, pair_log_probs = _row_summaries(logits.reshape(-1, logits.shape[-1]), index)
            hidden = args[0].detach()
            output.register_hook(
                lambda grad: self._accumulate_pair_sums(grad, log_norm, pair_log_probs, target_logits=(module, hidden))
            )
        else:  # another head module (or FSDP2 / ZeRO-3 managing its weight): the logits stay until backward
            output.register_hook(lambda grad: self._accumulate_pair_sums(grad, logits=logits))

    def _input_role(self, module, args, kwargs, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This micro-batch's input-role gradient as (sorted ids, (len(ids), d) float32 rows)."""
        if (
            _module_type(module) is nn.Embedding
            and module.max_norm is None
            and not module.scale_grad_by_freq
            and not kwargs
        ):
            ids, inverse = args[0].reshape(-1).unique(return_inverse=True)
            rows = torch.zeros(len(ids), grad.shape[-1], dtype=torch.float32, device=grad.device)
            rows.index_add_(0, inverse.to(grad.device), grad.reshape(-1, grad.shape[-1]).float())
            if module.padding_idx is not None:
                rows[ids == module.padding_idx % self._vocab] = 0  # the lookup sends no gradient to the padding row
            return ids.to(grad.device), rows
        return self._generic_role(module, args, kwargs, grad)

    def _generic_role(self, module, args, kwargs, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """d<output, grad>/dW for any lookup module, by re-running its forward on a detached copy of W: with sparse
        gradients when it is an `nn.Embedding` (a scaled embedding), so that only the looked-up rows are built."""
        weight = self.weight.detach().requires_grad_(True)
        detached_args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
        armed, self.armed = self.armed, False  # the re-run must not hook itself again
        try:
            with _compat.sparse_embedding_gradient(module), torch.enable_grad():
                output = functional_call(module, {"weight": weight}, detached_args, kwargs)
                (role,) = torch.autograd.grad(output, weight, grad)
        finally:
            self.armed = armed
        if role.is_sparse:
            role = role.coalesce()
            return role.indices()[0], role.values().float()
        ids = (role != 0).any(dim=1).nonzero().squeeze(1)
        return ids, role[ids].float()

    def _read_gradient(self) -> None:
        """Backward ended: keep the per-row squared norms of W.grad (the step's tied gradient so far)."""
        self._read_queued = False
        if not self.armed:
            return
        self._backward_row_sq = _row_sq_norms(self.weight.grad)

    def _accumulate_pair_sums(
        self,
        grad: torch.Tensor,
        log_norm: torch.Tensor | None = None,
        pair_log_probs: torch.Tensor | None = None,
        target_logits: tuple[nn.Module, torch.Tensor] | None = None,
        logits: torch.Tensor | None = None,
    ) -> None:
        """Add this micro-batch's gap, evidence and cross-entropy sums over the positions whose logits carry a loss.

        The targets and the loss positions come from the logits' gradient, read a few rows at a time. The pairs'
        log-probabilities and each row's log-normaliser come from the forward (or from ``logits``, kept until now);
        the target's logit is h . W[target] (+ bias) from the head's input h, or read off ``logits``.
        """
        vocab = grad.shape[-1]
        index = self._pair_ids.to(grad.device)
        carry_parts, target_parts = [], []
        for chunk in grad.reshape(-1, vocab).split(max(1, _LOGIT_CHUNK // vocab)):
            carry_parts.append(chunk.ne(0).any(dim=1))
            target_parts.append(targets_from_gradient(chunk))
        carries, targets = torch.cat(carry_parts), torch.cat(target_parts)
        if logits is not None:
            flat_logits = logits.reshape(-1, vocab)
            log_norm, pair_log_probs = _row_summaries(flat_logits, index)
            target_logit = flat_logits.gather(1, targets.unsqueeze(1)).squeeze(1).float()
        else:
            assert target_logits is not None
            module, hidden = target_logits
            target_logit = _linear_rows(cast(nn.Linear, module), hidden.reshape(-1, hidden.shape[-1]), targets)
        assert log_norm is not None and pair_log_probs is not None
        sums = _pair_sums(log_norm, pair_log_probs, target_logit, targets, carries, index)
        self._sums = sums if self._sums is None else self._sums.add_(sums)

    # -- API -----------------------------------------------------------------------------------------------------------
    def collect(self) -> RoleGradients | None:
        """The step's role gradients on the rows the signals read, averaged over ranks; None if no backward ran while
        armed. Call it after the step's last backward and before the optimizer step (under DeepSpeed, after it: they
        were read at the step, `_read_reduced_gradient`).

        Every rank must call it on the same steps (it all-reduces under torch.distributed).
        """
        if self._reads_at_step:
            grads, self._read_at_step = self._read_at_step, None
            if grads is None:  # the engine did not step while armed: an incomplete step, its gaps are not read either
                self._input_parts, self._sums, self._weight_parts = [], None, []
            return grads
        backward_sq, self._backward_row_sq = self._backward_row_sq, None
        rows = self._input_role_rows(backward_sq is not None, self.weight.device)
        if rows is None:
            return None
        all_ids, input_grad = rows
        assert backward_sq is not None and self.weight.grad is not None  # `rows` needs a backward that ran

        # The optimizer sees W.grad scaled by one factor (clipping, unscaling): take it out again, after checking
        # row by row that nothing else changed it.
        grad = self.weight.grad
        now_sq = _row_sq_norms(grad)
        assert now_sq is not None
        totals = torch.stack([backward_sq.double().sum(), now_sq.double().sum()])
        if is_sharded(self.weight):
            dist.all_reduce(totals, op=dist.ReduceOp.SUM)
        backward_total, scale_sq = totals[0], totals[1] / totals[0]
        tolerance = max(_SCALE_TOLERANCE, 2 * torch.finfo(grad.dtype).eps)
        uniform = torch.tensor(
            [float(torch.isfinite(scale_sq) and scale_sq > 0 and _scaled(backward_sq, now_sq, scale_sq, tolerance))],
            device=self.weight.device,
        )
        if world_size() > 1:
            dist.all_reduce(uniform, op=dist.ReduceOp.MIN)
        if uniform.item() != 1.0:
            self._warn_not_scaled(scale_sq)
            nan = torch.full_like(input_grad, math.nan)
            return RoleGradients(all_ids, input_grad, nan, math.nan, gather_rows(self.weight, all_ids).float())
        tied = gather_rows(self.weight.grad, all_ids).float() / scale_sq.sqrt().float()
        return _role_gradients(all_ids, input_grad, tied, backward_total, gather_rows(self.weight, all_ids).float())

    def _input_role_rows(self, backward_ended: bool, device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The step's input role on the union of every rank's looked-up rows and the pairs' (sorted ids, rows),
        averaged as DDP averages W.grad; None (on every rank) if some rank ran no backward while armed."""
        parts, self._input_parts = self._input_parts, []
        have = torch.tensor([float(bool(parts) and backward_ended)], device=device)
        if world_size() > 1:
            dist.all_reduce(have, op=dist.ReduceOp.MIN)
        if have.item() != 1.0:
            self._sums, self._weight_parts = None, []  # an incomplete step: its gaps are not read either
            return None
        ids, rows = _merge_rows(parts)
        if world_size() > 1:  # the union of every rank's rows, averaged as DDP averages W.grad
            union = union_rows(ids)
            summed = torch.zeros(len(union), rows.shape[1], dtype=rows.dtype, device=rows.device)
            summed[torch.searchsorted(union, ids)] = rows
            dist.all_reduce(summed, op=dist.ReduceOp.SUM)
            ids, rows = union, summed / dist.get_world_size()
        pair_ids = self._pair_ids.to(ids.device).reshape(-1)
        all_ids = torch.unique(torch.cat([ids, pair_ids]))  # sorted
        input_grad = torch.zeros(len(all_ids), rows.shape[1], dtype=rows.dtype, device=rows.device)
        input_grad[torch.searchsorted(all_ids, ids)] = rows
        return all_ids, input_grad

    def _read_reduced_gradient(self) -> None:
        """DeepSpeed, at its optimizer step of a measuring step, before the step changes anything (every rank): the
        tied gradient on the rows the signals read and its whole squared norm, from ZeRO's reduced gradient, which
        is averaged over ranks as DDP averages W.grad and not yet clipped (`ZeroTying.read_tied_rows`). What this
        holds is O(rows read x d): no (V, d) buffer."""
        rows = self._input_role_rows(True, self.weight.device)
        if rows is None:
            return
        all_ids, input_grad = rows
        tied, tied_sq_total = self._emulation.read_tied_rows(all_ids)
        weight_rows = self._weight_rows(all_ids)
        self._read_at_step = _role_gradients(all_ids, input_grad, tied, tied_sq_total, weight_rows)

    def pair_measurements(self, grads: RoleGradients) -> dict[str, float]:
        """The pair measurements of the step's loss positions (all ranks); resets the sums.

        * ``gap/<a-b>``: the pair's conditional gap (`untie.signals.metrics.pair_gap_sums_from_log_probs`), in nats;
        * ``evidence/<a-b>``: the step's evidence against the pair's conditional equivalence
          (`untie.signals.metrics.pair_evidence_sums`), in nats (0 when neither symbol was a target);
        * ``learned_z``: how far the step's cross-entropy lies below that of an uninformed prediction, in standard
          errors (`untie.signals.metrics.learned_z`).

        ``grads`` is the step's `collect` result: its nonzero input rows are the tokens some rank looked up. A pair
        with a symbol that has not occurred as input in any measured step yet is NaN (a symbol the model never reads
        says nothing about tying); rare symbols need not occur in every step. Every rank must call it on the same
        steps (it all-reduces).
        """
        if self._sums is None:  # nothing measured since the last read (or no pairs)
            nan = {metric_key(name, p): math.nan for name in ("gap", "evidence") for p in self.pairs}
            return {**nan, "learned_z": math.nan} if self.pairs else nan
        # Set by the backward hook that also yields the output role: every rank that collect() vouched for has them.
        sums, self._sums = self._sums, None
        if world_size() > 1:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM)
        total, weight, evidence, loss_sums = sums.split([len(self.pairs)] * 3 + [3])
        looked_up = grads.looked_up(self._pair_ids.reshape(-1)).reshape(-1, 2)
        self._seen |= looked_up.cpu()
        seen = self._seen.all(dim=1).to(weight.device)
        gaps = torch.where(seen & (weight > 0), total / weight.clamp_min(1e-300), torch.nan)
        evidence = torch.where(seen, evidence, torch.nan)
        measured = {metric_key("gap", p): g for p, g in zip(self.pairs, gaps.tolist(), strict=True)}
        measured.update({metric_key("evidence", p): e for p, e in zip(self.pairs, evidence.tolist(), strict=True)})
        measured["learned_z"] = learned_z(loss_sums.cpu(), self._vocab)
        return measured

    def remove(self) -> None:
        """Take every hook and listener off (`registry`)."""
        self.registry.close()
        self.armed = False
        self._input_parts, self._backward_row_sq, self._sums = [], None, None

    def _warn_not_scaled(self, scale_sq: torch.Tensor) -> None:
        if self._scale_warned:
            return
        self._scale_warned = True
        why = (
            "it is not finite or zero (a skipped fp16 step, or zero_grad before the optimizer step)"
            if not (torch.isfinite(scale_sq) and scale_sq > 0)
            else "it changed by more than one common factor (clip_grad_value_, a gradient hook, a noise term)"
        )
        logger.warning(
            "untie: the tied matrix's gradient at the optimizer step is not the one backward produced: %s. The role "
            "signals of such a step are NaN (a NaN never unties); the gaps and the evidence are measured as usual. "
            "Clip by norm (clip_grad_norm_, Trainer's max_grad_norm) to keep them.",
            why,
        )


def _merge_rows(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum (ids, rows) parts into one sorted, duplicate-free (ids, rows)."""
    ids = torch.cat([part[0] for part in parts])
    rows = torch.cat([part[1] for part in parts])
    unique, inverse = ids.unique(return_inverse=True)
    merged = torch.zeros(len(unique), rows.shape[1], dtype=rows.dtype, device=rows.device)
    merged.index_add_(0, inverse, rows)
    return unique, merged


def _role_gradients(
    ids: torch.Tensor, input_grad: torch.Tensor, tied: torch.Tensor, tied_sq_total: torch.Tensor, weight: torch.Tensor
) -> RoleGradients:
    """The role gradients on rows `ids` from the input role and the tied gradient there, and the tied gradient's
    whole squared norm (the output role's is |G|^2 - 2 G[T] . G_in[T] + |G_in|^2, exactly)."""
    tied_dot_in = (tied.double() * input_grad.double()).sum()
    sq_in = input_grad.double().square().sum()
    output_sq = tied_sq_total - 2 * tied_dot_in + sq_in
    return RoleGradients(
        rows=ids,
        input_grad=input_grad,
        output_grad=tied - input_grad,
        output_sq_norm=float(output_sq.clamp_min(0)),
        weight=weight,
    )


def _row_sq_norms(grad: torch.Tensor | None) -> torch.Tensor | None:
    """(V_local,) float32 squared norms of the rows of this rank's part of a (V, d) gradient: one fast pass over
    contiguous rows (a float32 result, accumulated in float32; their sum is taken in float64)."""
    if grad is None:
        return None
    local = (cast(DTensor, grad).to_local() if is_sharded(grad) else grad).detach()
    return torch.linalg.vector_norm(local, dim=1, dtype=torch.float32).square()


def _scaled(before: torch.Tensor, after: torch.Tensor, scale: torch.Tensor, tolerance: float) -> bool:
    """Whether every row's squared norm went from `before` to `scale` times it (a row that was zero stays zero)."""
    expected = before.double() * scale
    return bool(((after.double() - expected).abs() <= tolerance * expected).all())


def _row_summaries(logits: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's log-normaliser (N,) and the pairs' log-probabilities (N, P, 2), in float32, a few rows at a time."""
    norms, log_probs = [], []
    for chunk in logits.split(max(1, _LOGIT_CHUNK // logits.shape[-1])):
        norm = chunk.float().logsumexp(dim=1, keepdim=True)
        norms.append(norm.squeeze(1))
        log_probs.append(chunk[:, index.reshape(-1)].float().sub_(norm).reshape(len(chunk), -1, 2))
    return torch.cat(norms), torch.cat(log_probs)


def _linear_rows(module: nn.Linear, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(N,) float32: the linear head's output at each row's target, h_r . W[t_r] (+ b[t_r]), in the input's dtype
    rounding and float32 accumulation, a few thousand rows at a time."""
    out = []
    for rows, ids in zip(hidden.split(4096), targets.split(4096), strict=True):
        weight = module.weight.detach()[ids].to(rows.dtype).float()
        value = (rows.float() * weight).sum(dim=1)
        if module.bias is not None:
            value += module.bias.detach()[ids].float()
        out.append(value)
    return torch.cat(out)


def _pair_sums(
    log_norm: torch.Tensor,
    pair_log_probs: torch.Tensor,
    target_logit: torch.Tensor,
    targets: torch.Tensor,
    carries: torch.Tensor,
    index: torch.Tensor,
) -> torch.Tensor:
    """The pair sums of a micro-batch (see `RoleGradientProbe._sums`) over the rows that carry a loss, from the
    rows' summaries: `untie.signals.metrics`' gap, evidence and cross-entropy sums, concatenated."""
    log_a, log_b = pair_log_probs[..., 0], pair_log_probs[..., 1]
    gap_total, gap_weight = pair_gap_sums_from_log_probs(log_a, log_b, carries)
    evidence_total, _ = pair_evidence_sums_from_log_odds(log_a - log_b, targets, index, carries)
    loss_sums = cross_entropy_sums_from_target_logits(log_norm, target_logit, carries)
    return torch.cat([gap_total, gap_weight, evidence_total, loss_sums])


def _module_type(module: nn.Module) -> type:
    """The module's own class; FSDP2's `fully_shard` swaps in a subclass (``FSDPEmbedding``) that adds nothing."""
    return next(cls for cls in type(module).__mro__ if not issubclass(cls, FSDPModule))
