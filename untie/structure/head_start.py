"""Which start a drawn head keeps, read off the model's *function* on the run's first batch.

The default policy draws the LM head of a model it reads as built fresh (`untie.structure.policy`: the input
embedding matches a fresh draw of its initialiser). That reading is of the embedding alone, taken when the run is
attached: it misses weights trained lightly (a warm-up checkpoint), weights loaded after the decision
(`trainer.model.load_state_dict(...)` after `Trainer(...)`), and a body trained against a frozen tied embedding. A
head drawn over any of them throws away what the model predicts.

So a drawn head is only provisional. At the run's first forward, before the output module runs, `FirstBatchCheck`
scores the batch's targets with the drawn head and with a copy of the input embedding (the head the tied model
predicts with), on the same hidden states, and keeps the draw only where the copy does not predict clearly better
(`judge`). Otherwise the head becomes the copy, in place, before any optimizer step: the run untied from step 0 by a
copy, and its line says so.

The bound on a misread: a head that predicts the first batch better than a drawn one by more than `FLOOR` nat, or by
more than `SIGMAS` standard errors of the per-token difference, is never drawn over. On a fresh model both heads are
draws of the same scale, so the copy's advantage is sampling noise around 0 and the draw is kept (a copy of a smaller
scale than the head's initialiser may read as better: the safe side, a copy).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from untie import _compat
from untie.distributed import broadcast_decision
from untie.registry import Registry
from untie.structure.surgery import input_weight, output_weight

logger = logging.getLogger(__name__)

#: The copy must predict the first batch at least this much better (nat per token) than the drawn head to be kept,
#: or `SIGMAS` standard errors of the per-token difference where that is larger. Set before the measurements of
#: `tests/test_head_start.py`: a lightly trained model (the smallest case of issue 67, 0.26 nat learned) clears it
#: tenfold, and a fresh model's difference is noise around 0.
FLOOR = 0.02
SIGMAS = 3.0
#: At most this many labelled positions are scored (evenly spaced), in chunks of `CHUNK`: the logits of two heads over
#: a 262k vocabulary stay within a few hundred MB.
MAX_POSITIONS = 4096
CHUNK = 128


@dataclass(frozen=True)
class HeadVerdict:
    """What the first batch said about the drawn head (`judge`)."""

    start: Literal["model", "copy"]
    """"model": the draw is kept; "copy": the head becomes a copy of the embedding."""
    detail: str
    """Why, in words, with the figures."""
    advantage: float | None = None
    """The copy's mean per-token loss below the drawn head's (nat; positive: the copy predicts better)."""
    bound: float | None = None
    """The advantage above which the copy is kept: max(`FLOOR`, `SIGMAS` standard errors)."""
    positions: int = 0
    """The labelled positions scored."""


def judge(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    drawn: torch.Tensor,
    copy: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> HeadVerdict:
    """Score `targets` (N,) from `hidden` (N, d) with the `drawn` head and with the `copy` (V, d each, plus `bias`),
    and keep the draw unless the copy predicts clearly better (see the module docstring). Pure; float32."""
    if hidden.shape[0] == 0:
        return HeadVerdict("copy", "the first batch had no labelled position to score: the head starts as a copy")
    differences = []
    with torch.no_grad():
        drawn32, copy32 = drawn.float(), copy.float()
        bias32 = None if bias is None else bias.float()
        for rows, wanted in zip(hidden.float().split(CHUNK), targets.split(CHUNK), strict=True):
            with_copy = F.cross_entropy(F.linear(rows, copy32, bias32), wanted, reduction="none")
            with_draw = F.cross_entropy(F.linear(rows, drawn32, bias32), wanted, reduction="none")
            differences.append(with_draw - with_copy)
    difference = torch.cat(differences).double()
    count = difference.numel()
    advantage = float(difference.mean())
    error = float(difference.std()) / math.sqrt(count) if count > 1 else math.inf
    bound = max(FLOOR, SIGMAS * error)
    figures = f"{advantage:+.3f} nat per token on {count:,} positions of the first batch, bound {bound:.3f}"
    if not math.isfinite(advantage):
        return HeadVerdict("copy", f"the first batch's losses are not finite ({figures})", advantage, bound, count)
    if advantage > bound:
        why = f"the model predicts with its tied head better than with a drawn one ({figures}): its weights are trained"
        return HeadVerdict("copy", why, advantage, bound, count)
    why = f"the model predicts no better with its tied head than with a drawn one ({figures})"
    return HeadVerdict("model", why, advantage, bound, count)


def aligned_targets(
    model: nn.Module, hidden: torch.Tensor, args: tuple, kwargs: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The hidden states fed to the head and the label each predicts, flattened to (N, d) and (N,) over the labelled
    positions (at most `MAX_POSITIONS`, evenly spaced), from the model's forward arguments: `labels`, or for a causal
    LM without them the `input_ids` (next-token targets). None where the alignment cannot be read (another loss
    type, labels of another shape)."""
    alignment = _compat.loss_alignment(model)
    labels = kwargs.get("labels")
    if labels is None and alignment == "shifted":
        labels = kwargs.get("input_ids", args[0] if args and isinstance(args[0], torch.Tensor) else None)
    if not isinstance(labels, torch.Tensor) or labels.dtype not in (torch.int32, torch.int64):
        return None
    if alignment == "shifted":
        if hidden.dim() != 3 or labels.shape != hidden.shape[:2] or hidden.shape[1] < 2:
            return None
        hidden, labels = hidden[:, :-1], labels[:, 1:]
    elif alignment != "aligned" or labels.shape != hidden.shape[:-1]:
        return None
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1).to(hidden.device)
    keep = (labels >= 0).nonzero().flatten()
    if keep.numel() > MAX_POSITIONS:
        keep = keep[torch.linspace(0, keep.numel() - 1, MAX_POSITIONS, device=keep.device).round().long()]
    return hidden.index_select(0, keep), labels.index_select(0, keep)


class FirstBatchCheck:
    """Keeps or replaces a drawn head at the model's first forward (`judge`), then removes itself.

    Installed through the run's `registry` (so `close()` takes it off). Two hooks: one on the model, which reads the
    forward's labels (or input ids), and one on the output module, which runs before it and sees the hidden states;
    where the output module never runs, the model's forward end settles for a copy. Every rank of a distributed run
    takes rank 0's verdict (one broadcast, in the first forward, which every rank runs), and the copy it makes is of
    its own embedding, which DDP keeps equal across ranks. `on_verdict` receives the verdict once."""

    def __init__(self, model: nn.Module, on_verdict: Callable[[HeadVerdict], None], registry: Registry) -> None:
        self.model = model
        self.on_verdict = on_verdict
        self.registry = registry
        self.verdict: HeadVerdict | None = None
        self._call: tuple[tuple, dict] | None = None
        module = model.get_output_embeddings()  # type: ignore[operator]  # a transformers model (draw_head found it)
        assert isinstance(module, nn.Module)  # the draw found it (`untie.structure.surgery.draw_head`)
        self._handles = [
            model.register_forward_pre_hook(self._read_call, with_kwargs=True),
            module.register_forward_pre_hook(self._before_head),
            model.register_forward_hook(self._after_forward),
        ]
        for handle in self._handles:
            registry.hook("first-batch check of the drawn head", handle)

    def _read_call(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._call is None:
            self._call = (args, kwargs)

    def _before_head(self, module: nn.Module, args: tuple) -> None:
        if self.verdict is not None or self._call is None or not args:
            return
        hidden = args[0]
        found = aligned_targets(self.model, hidden.detach(), *self._call) if isinstance(hidden, torch.Tensor) else None
        if found is None:
            verdict = HeadVerdict(
                "copy",
                "the first batch's labels could not be aligned with the head's inputs, so the model's function was "
                "not read: the head starts as a copy",
            )
        else:
            bias = getattr(module, "bias", None)
            verdict = judge(*found, output_weight(self.model), input_weight(self.model), bias)
        self._decide(verdict)

    def _after_forward(self, module: nn.Module, args: tuple, output) -> None:
        if self.verdict is None:
            why = "the output module did not run in the first forward: the head starts as a copy"
            self._decide(HeadVerdict("copy", why))

    def _decide(self, verdict: HeadVerdict) -> None:
        keep_draw = broadcast_decision(verdict.start == "model")
        if keep_draw != (verdict.start == "model"):
            start: Literal["model", "copy"] = "model" if keep_draw else "copy"
            verdict = HeadVerdict(start, f"rank 0's verdict ({start}); this rank's: {verdict.detail}")
        if not keep_draw:
            with torch.no_grad():
                output_weight(self.model).copy_(input_weight(self.model))
        self.verdict, self._call = verdict, None
        self.remove()
        self.on_verdict(verdict)

    def remove(self) -> None:
        """Take the hooks off (after the verdict, or when a resumed run's head comes from its checkpoint)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
