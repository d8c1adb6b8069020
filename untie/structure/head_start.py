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
more than `SIGMAS` standard errors of the per-token difference, is never drawn over. Each head is scored at the
temperature that suits it best (`TEMPERATURES`: a model may scale or cap the head's output before its loss), on the
positions that can tell: labelled, not padding, and not predicting the token the position reads (a fresh tied model
predicts its input token again). On a fresh model both heads are draws, so the copy's advantage is noise around 0
and the draw is kept. Only forwards that train (gradients on) are judged: evaluation and generation pass untouched,
except an evaluation the run knows every rank runs before the first step (Trainer's `eval_on_start`,
`FirstBatchCheck.judge_evaluation`): that one is judged, so that its report is of the head the run trains.
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
#: or `SIGMAS` standard errors of the per-token difference where that is larger. Two independent draws of a fresh
#: model's head differ by up to 0.023 nat on a batch and by about 0.012 between seeds whatever the batch's size
#: (measured by an independent tester on development seeds, issue 67), which no per-token error sees: the floor sits
#: above that. A model that has learned at least this much on the batch keeps its head.
FLOOR = 0.05
SIGMAS = 3.0
#: The one-sided tail of `SIGMAS` under a normal law: on few positions the standard error is itself a noisy estimate,
#: so the bound takes Student's t quantile at this tail, with one degree of freedom fewer than the positions.
TAIL = 0.5 * math.erfc(SIGMAS / math.sqrt(2.0))
#: At most this many labelled positions are scored (evenly spaced), and at most half the positions the head runs on in
#: that forward: a training step runs the head forward and backward over every position (three products of positions x
#: V x d), the check two heads' forward over at most half of them (one such product), so at any vocabulary the check
#: costs less than one training step (`benchmarks/first_step_cost.py`). The products run `CHUNK` positions at a time.
MAX_POSITIONS = 4096
CHUNK = 128
#: Each head's best temperature is chosen on at most this many logits (positions x V, float32: 128 MiB), on positions
#: evenly spaced among those scored; every position is then scored at that temperature, a chunk at a time. The mean
#: loss is convex in the temperature, so the best of `TEMPERATURES` is found by bisection on the sign of its slope:
#: about four passes over those logits, not one per temperature.
LOGIT_BUDGET = 1 << 25
#: The temperatures each head's logits are scored at, its best kept: a model may scale, cap or divide the head's output
#: before its loss (Cohere's `logit_scale`, Granite's `logits_scaling`, Gemma's soft cap), which the head's raw logits
#: do not show. Each head is judged at the temperature that suits it best, so neither is misjudged by a scale.
TEMPERATURES = tuple(2.0**k for k in range(-6, 7))


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


def _spaced(count: int, limit: int, device: torch.device) -> torch.Tensor:
    """`limit` indices evenly spaced over ``range(count)`` (all of them where `count` <= `limit`), by integer arithmetic
    (distinct whatever the default dtype)."""
    if count <= limit:
        return torch.arange(count, device=device)
    return torch.arange(limit, device=device) * (count - 1) // max(1, limit - 1)


def _loss_and_slope(logits: torch.Tensor, picked: torch.Tensor, scale: float) -> tuple[float, float]:
    """The mean cross-entropy of the picked logits at `scale` x the logits, and its derivative in `scale` (the softmax's
    mean logit minus the picked one). `CHUNK` rows at a time: one exponential pass and one buffer of a chunk's size; the
    product of the probabilities and the logits as a batched dot (a logit of -inf, whose probability is 0, adds 0)."""
    loss_sum, slope_sum = 0.0, 0.0
    for rows, wanted in zip(logits.split(CHUNK), picked.split(CHUNK), strict=True):
        scaled = scale * rows
        top = scaled.amax(dim=-1, keepdim=True)
        weights = scaled.sub_(top).exp_()
        total = weights.sum(dim=-1)
        finite = torch.where(weights > 0, rows, 0.0)
        expected = torch.bmm(weights.unsqueeze(1), finite.unsqueeze(2)).view(-1) / total
        loss_sum += float((total.log() + top.view(-1) - scale * wanted).double().sum())
        slope_sum += float((expected - wanted).double().sum())
    return loss_sum / logits.shape[0], slope_sum / logits.shape[0]


def _best_scale(logits: torch.Tensor, picked: torch.Tensor) -> float:
    """The temperature of `TEMPERATURES` with the lowest mean loss on these positions. The mean loss is convex in the
    temperature (its second derivative is the variance of the logits under the softmax), so the first temperature whose
    slope is not negative, or the one before it, is the best: found by bisection. Where a reading is not finite, the
    full sweep."""
    readings: dict[int, tuple[float, float]] = {}

    def read(index: int) -> tuple[float, float]:
        if index not in readings:
            readings[index] = _loss_and_slope(logits, picked, TEMPERATURES[index])
        return readings[index]

    low, high = 0, len(TEMPERATURES) - 1
    while low < high:
        middle = (low + high) // 2
        if not math.isfinite(read(middle)[1]):
            break
        low, high = (middle + 1, high) if read(middle)[1] < 0 else (low, middle)
    else:
        candidates = [i for i in (low - 1, low) if i >= 0]
        if all(math.isfinite(read(i)[0]) for i in candidates):
            return TEMPERATURES[min(candidates, key=lambda i: read(i)[0])]
    means = [read(i)[0] for i in range(len(TEMPERATURES))]
    return TEMPERATURES[min(range(len(means)), key=lambda i: (not math.isfinite(means[i]), means[i]))]


def _losses(hidden: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """Per-position cross-entropy of `targets` under `weight` (and `bias`) at the head's best temperature (chosen on
    the positions `LOGIT_BUDGET` holds, evenly spaced; all of them where they fit): (N,) float64. The product in the
    head's dtype, `CHUNK` positions at a time, the logits and the loss in float32; autocast off (its cache would keep
    this call's cast of the head for the rest of the forward)."""
    weight = weight.detach()
    bias = None if bias is None else bias.detach().to(weight.dtype)
    count, device = hidden.shape[0], hidden.device

    def logits_of(rows: torch.Tensor) -> torch.Tensor:
        held = torch.empty(rows.shape[0], weight.shape[0], dtype=torch.float32, device=device)
        for start in range(0, rows.shape[0], CHUNK):
            held[start : start + CHUNK] = F.linear(rows[start : start + CHUNK].to(weight.dtype), weight, bias)
        return held

    with torch.no_grad(), torch.autocast(device.type, enabled=False):
        sweep = _spaced(count, max(1, LOGIT_BUDGET // max(1, weight.shape[0])), device)
        held = logits_of(hidden.index_select(0, sweep))
        scale = _best_scale(held, held.gather(1, targets.index_select(0, sweep).view(-1, 1)).view(-1))
        reuse = sweep.numel() == count  # every position held: score them from there, else a chunk at a time
        held = held if reuse else held.new_empty(0)  # the sweep's logits freed before the chunks are computed
        losses = torch.empty(count, dtype=torch.float64, device=device)
        for start in range(0, count, CHUNK):
            chunk = held[start : start + CHUNK] if reuse else logits_of(hidden[start : start + CHUNK])
            wanted = targets[start : start + CHUNK]
            losses[start : start + CHUNK] = F.cross_entropy(chunk.mul_(scale), wanted, reduction="none").double()
        return losses


def _sigmas(freedom: int) -> float:
    """Student's t quantile at the upper tail `TAIL` with `freedom` degrees of freedom: exact for 1 and 2, else the
    Cornish-Fisher expansion around `SIGMAS` (Abramowitz & Stegun 26.7.5: 2.3% below the exact quantile at 3, under
    1% from 4 on), which tends to `SIGMAS` as the positions grow."""
    if freedom <= 1:
        return math.tan(math.pi * (0.5 - TAIL))
    if freedom == 2:
        p = 1.0 - TAIL
        return (2 * p - 1) / math.sqrt(2 * p * (1 - p))
    z = SIGMAS
    terms = (
        (z**3 + z) / 4,
        (5 * z**5 + 16 * z**3 + 3 * z) / 96,
        (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384,
        (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160,
    )
    return z + sum(term / freedom ** (k + 1) for k, term in enumerate(terms))


def judge(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    drawn: torch.Tensor,
    copy: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> HeadVerdict:
    """Score `targets` (N,) from `hidden` (N, d) with the `drawn` head and with the `copy` (V, d each, plus `bias`),
    each at its best temperature (`TEMPERATURES`), and keep the draw unless the copy predicts clearly better (see the
    module docstring). Pure."""
    if hidden.shape[0] == 0:
        return HeadVerdict("copy", "the first batch had no labelled position to score: the head starts as a copy")
    difference = _losses(hidden, targets, drawn, bias) - _losses(hidden, targets, copy, bias)
    count = difference.numel()
    advantage = float(difference.mean())
    error = float(difference.std()) / math.sqrt(count) if count > 1 else math.inf
    bound = max(FLOOR, _sigmas(count - 1) * error)
    figures = f"{advantage:+.3f} nat per token on {count:,} positions of the first batch, bound {bound:.3f}"
    if not math.isfinite(advantage):
        return HeadVerdict("copy", f"the first batch's losses are not finite ({figures})", advantage, bound, count)
    if advantage > bound:
        why = f"the model predicts with its tied head better than with a drawn one ({figures}): its weights are trained"
        return HeadVerdict("copy", why, advantage, bound, count)
    why = f"the model predicts no better with its tied head than with a drawn one ({figures})"
    return HeadVerdict("model", why, advantage, bound, count)


def _tensor(value: Any) -> torch.Tensor | None:
    return value if isinstance(value, torch.Tensor) else None


def aligned_targets(
    model: nn.Module, hidden: torch.Tensor, args: tuple, kwargs: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The hidden states fed to the head and the label each predicts, flattened to (N, d) and (N,), from the model's
    forward arguments: `labels`, or for a causal LM without them the `input_ids` (next-token targets). Scored are the
    labelled positions (at most `MAX_POSITIONS` and half the positions the head runs on, evenly spaced) that are not
    padding (`attention_mask`, a decoder's `decoder_attention_mask`, the pad token) and whose target is not the token
    the position reads (a fresh tied model predicts its input token again: no evidence of training; a decoder's
    position reads the label before it). None where the alignment cannot be read (another loss type, labels of another
    shape)."""
    alignment = _compat.loss_alignment(model)
    runs_on = hidden.numel() // max(1, hidden.shape[-1])  # the positions the head runs on in this forward
    input_ids = _tensor(kwargs.get("input_ids", args[0] if args else None))
    labels = _tensor(kwargs.get("labels"))
    if labels is None and alignment == "shifted":
        labels = input_ids
    if labels is None or labels.dtype not in (torch.int32, torch.int64):
        return None
    decoder = bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))
    mask = _tensor(kwargs.get("decoder_attention_mask" if decoder else "attention_mask"))  # the head's side's mask
    mask = mask if mask is not None and mask.shape == labels.shape else None
    reads = input_ids if input_ids is not None and input_ids.shape == labels.shape else None
    if alignment == "shifted":
        if hidden.dim() != 3 or labels.shape != hidden.shape[:2] or hidden.shape[1] < 2:
            return None
        hidden, labels = hidden[:, :-1], labels[:, 1:]
        mask = None if mask is None else mask[:, 1:]
        reads = None if reads is None else reads[:, :-1]
    elif alignment != "aligned" or labels.shape != hidden.shape[:-1]:
        return None
    elif decoder:
        reads = _decoder_reads(model, labels, _tensor(kwargs.get("decoder_input_ids")))
    keep = labels >= 0
    if mask is not None:
        keep &= mask.to(keep.device) > 0
    pad = getattr(getattr(model, "config", None), "pad_token_id", None)
    if isinstance(pad, int):
        keep &= labels != pad
    if reads is not None:
        keep &= labels != reads.to(labels.device)
    hidden = hidden.reshape(-1, hidden.shape[-1])
    keep = keep.reshape(-1).to(hidden.device).nonzero().flatten()
    keep = keep[_spaced(keep.numel(), min(MAX_POSITIONS, max(1, runs_on // 2)), keep.device)]
    return hidden.index_select(0, keep), labels.reshape(-1).to(hidden.device).index_select(0, keep)


def _decoder_reads(model: nn.Module, labels: torch.Tensor, decoder_input_ids: torch.Tensor | None) -> torch.Tensor:
    """The token each decoder position of an encoder-decoder model reads: its `decoder_input_ids` where given, else
    the labels shifted right behind the decoder's start token (-100 read as padding), as the model builds them."""
    if decoder_input_ids is not None and decoder_input_ids.shape == labels.shape:
        return decoder_input_ids
    config = getattr(model, "config", None)
    start = getattr(config, "decoder_start_token_id", None)
    pad = getattr(config, "pad_token_id", None)
    reads = labels.roll(1, dims=-1)
    reads[..., 0] = start if isinstance(start, int) else -1
    return reads.masked_fill(reads == -100, pad if isinstance(pad, int) else -1)


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
        self.verdict: HeadVerdict | None = None
        self.judge_evaluation = False
        """Judge the first forward even without gradients: set where every rank runs an evaluation before the first
        step (Trainer's `eval_on_start`), so that the evaluation sees the head the run trains, not a provisional
        draw. Off by default: one rank's generation or sample must not hold a collective."""
        self._call: tuple[tuple, dict] | None = None
        module = model.get_output_embeddings()  # type: ignore[operator]  # a transformers model (draw_head found it)
        assert isinstance(module, nn.Module)  # the draw found it (`untie.structure.surgery.draw_head`)
        # Outside torch.compile's tracing: the verdict reads tensors into Python numbers and decides the run again,
        # which dynamo cannot trace; under compile each hook is a graph break that runs eagerly.
        self._handles = [
            model.register_forward_pre_hook(torch.compiler.disable(self._read_call), with_kwargs=True),
            module.register_forward_pre_hook(torch.compiler.disable(self._before_head)),
            model.register_forward_hook(torch.compiler.disable(self._after_forward)),
        ]
        for handle in self._handles:
            registry.hook("first-batch check of the drawn head", handle)

    def _read_call(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        # Only a forward that trains (gradients on) is judged, and every rank runs it in the first step: evaluation,
        # generation or one rank's sample (no_grad, inference_mode) pass untouched and hold no collective.
        self._call = (args, kwargs) if torch.is_grad_enabled() or self.judge_evaluation else None

    def _before_head(self, module: nn.Module, args: tuple) -> None:
        if self.verdict is not None or self._call is None or not args:
            return
        hidden = args[0]
        found = aligned_targets(self.model, hidden.detach(), *self._call) if isinstance(hidden, torch.Tensor) else None
        if not torch.is_grad_enabled():  # the evaluation on start: judged only where it can tell (rank 0's batch)
            self.judge_evaluation = False  # one evaluation forward, judged or not: later ones pass untouched
            if not broadcast_decision(found is not None and found[1].numel() > 0):
                self._call = None  # no labels to read there: the first forward that trains is judged instead
                return
        if found is None:
            verdict = HeadVerdict(
                "copy",
                "the first batch's labels could not be aligned with the head's inputs, so the model's function was "
                "not read: the head starts as a copy",
            )
        elif torch.equal(output_weight(self.model), input_weight(self.model)):
            verdict = HeadVerdict(
                "copy",
                "the head equals the embedding at the first batch (weights loaded after the run was attached replaced "
                "the draw), so it keeps them",
            )
        else:
            bias = getattr(module, "bias", None)
            verdict = judge(*found, output_weight(self.model), input_weight(self.model), bias)
        self._decide(verdict)

    def _after_forward(self, module: nn.Module, args: tuple, output) -> None:
        judged, self._call = self._call is not None, None
        if not torch.is_grad_enabled():  # an evaluation on start whose output module did not run: it decides nothing
            self.judge_evaluation = False
            return
        if self.verdict is None and judged:
            why = "the output module did not run in the first forward: the head starts as a copy"
            self._decide(HeadVerdict("copy", why))

    def _decide(self, verdict: HeadVerdict) -> None:
        keep_draw = broadcast_decision(verdict.start == "model")
        if keep_draw != (verdict.start == "model"):
            start: Literal["model", "copy"] = "model" if keep_draw else "copy"
            verdict = HeadVerdict(start, f"rank 0's verdict ({start}); this rank's: {verdict.detail}")
        if not keep_draw:
            with torch.inference_mode(False), torch.no_grad():  # an evaluation judged may run under inference_mode
                output_weight(self.model).copy_(input_weight(self.model))
        self.verdict, self._call = verdict, None
        self.remove()
        self.on_verdict(verdict)

    def remove(self) -> None:
        """Take the hooks off (after the verdict, or when a resumed run's head comes from its checkpoint)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
