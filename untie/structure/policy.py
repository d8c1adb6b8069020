"""The untie policies: what a run does, chosen before training from what it can vouch for about the model.

Each policy reads the model at attach, before the optimizer exists, and picks one of two plans:

* **untied from the start**: the head becomes its own matrix before the first step (``untie_at=0``, no trigger).
  Drawn by the model's own initialiser only for a model built fresh: one whose input embedding matches a fresh draw
  of its own initialiser (`weights_evidence`: positive evidence that no training touched it), or that the user says
  is (`UntieConfig.from_scratch=True`). Every model holding trained weights (loaded by `from_pretrained` or by hand,
  or whose weights cannot be read here) gets a head that starts as a copy of the embedding: a policy never draws
  over a trained output role;
* **as set**: the settings' `untie_at` / `untie_when` (by default: tied, the trigger, the deadline).

`policy="untie-at-start"` is the default (an unset `UntieConfig.policy` follows it unless the schedule is set:
`UntieConfig.chosen_policy`): every model that arrives tied trains untied from the start, drawn where built fresh,
a copy otherwise. It is the study's verdict (docs/recipes/when-it-pays.md): from scratch, no tied phase beat untied
training in cell A; in fine-tuning, untying at once reached the lowest target loss of the arms measured.
`policy="fresh-untied"` (the default before that fine-tuning table) trains a model built fresh untied from the start
and runs a model holding trained weights as set. `policy="off"` always runs the settings as set. A model that
arrives untied, or wrapped by PEFT, runs as set too (`tie_init` decides whether it is tied first): there is no tied
phase to skip. `policy="auto"` (retired: its held-out validation failed at 40% embedding share) trains a model built
fresh untied from the start only where the embedding is at least `UNTIED_FROM_START_SHARE` of the parameters.

The config's name (``_name_or_path``, which `from_pretrained` records, and `from_config(AutoConfig.from_pretrained(
dir))` too) decides nothing but a warning: where it and the weights disagree, a warning names both and
`from_scratch`.

The choice is said once at train begin, in the run's own numbers (`untie.decision.lines.plan_line`), and kept in
the run state (`PolicyChoice.to_dict`), so a checkpoint says what its run chose and why.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from untie import _compat
from untie.decision.policy_rules import (
    UNTIED_FROM_START_SHARE,
    Freshness,
    PolicyChoice,
    PolicyReading,
    choose,
    settle,
)
from untie.decision.settings import POLICIES, PolicyName
from untie.distributed import broadcast_decision, full_shape, gathered, is_sharded, is_split, world_size
from untie.structure.surgery import input_weight

#: The sample of the input embedding `weights_evidence` compares with a fresh draw: at most this many entries (rows
#: evenly spaced over the vocabulary), and at least `_MIN_ROWS` rows where the vocabulary has them.
_SAMPLE_ENTRIES = 1 << 22
_MIN_ROWS = 64
#: How far a fresh draw's statistics may sit from the model's and still match: the larger of these floors and six
#: sampling standard deviations of the statistic (two independent samples of the sample's size). Measured
#: (2026-11-27, `tests/test_policy.py`): the 9 tiny architectures of `untie.testing` over seeds 0-4 sit within 0.02
#: (entries' spread) and 0.10 (row norms' spread) of the floors' 1; trained rows leave them (e.g. 300 AdamW steps on
#: 300 equally frequent symbols: row norms' spread 0.28 times a draw's).
_ENTRY_SPREAD_FLOOR = 0.05
_ROW_SPREAD_FLOOR = 0.25
#: How much stronger than a fresh draw's the leading singular direction may be (fresh draws of the 9 tiny
#: architectures: 0.90-0.98 of independent entries' value, so within 0.09 of each other; 10 AdamW steps at lr 1e-3 on
#: a learnable 300-symbol task: 1.26).
_TOP_DIRECTION_FLOOR = 0.15

#: The pure rules live in `untie.decision.policy_rules` (torch-free); they are re-exported here with the readers.
#: `choose` reads `policy_rules.UNTIED_FROM_START_SHARE`: patch it there (patching this name here changes nothing).
__all__ = [
    "POLICIES",
    "UNTIED_FROM_START_SHARE",
    "PolicyChoice",
    "PolicyName",
    "WeightsEvidence",
    "built_fresh",
    "choose",
    "choose_plan",
    "settle",
    "embedding_share",
    "weights_evidence",
]


def parameter_count(model: nn.Module) -> int:
    """The model's parameters, each shared tensor once, at their whole shape under every engine (ZeRO-3 partitions,
    FSDP2 shards)."""
    return sum(math.prod(full_shape(p)) for p in model.parameters())


def embedding_share(model: nn.Module) -> tuple[float, int]:
    """The input embedding's share of the model's parameters (a tied head is the same tensor, counted once), and the
    parameter count."""
    total = parameter_count(model)
    rows, width = full_shape(input_weight(model))[:2]
    return (rows * width / total if total else 0.0), total


@dataclass(frozen=True)
class WeightsEvidence:
    """What the input embedding's values say about the model's training (`weights_evidence`)."""

    verdict: Literal["drawn", "trained", "unreadable"]
    """"drawn": they match a fresh draw of the model's own initialiser (positive evidence that no training touched
    them); "trained": they do not; "unreadable": they cannot be compared here."""
    detail: str
    """Why, in words."""


def weights_evidence(model: nn.Module, embedding: torch.Tensor | None = None) -> WeightsEvidence:
    """Whether `model`'s input embedding is an initialiser's draw that no training has touched: its entries' mean and
    spread and its row norms' spread match those of a fresh draw of the model's own initialiser (`_init_weights`, on
    an embedding and on a head of the same width; a tied matrix may hold either's draw), within six sampling standard
    deviations (`_ENTRY_SPREAD_FLOOR`, `_ROW_SPREAD_FLOOR`). Training moves the rows apart or together and scales
    them: weights loaded by hand (`load_state_dict`) after a few hundred steps do not match. Read on a sample of
    rows (`_SAMPLE_ENTRIES`), drawn on the CPU under a fixed seed with the global random state untouched, so ranks
    holding the same weights read the same verdict and a run's numbers do not depend on it (`built_fresh` takes rank
    0's verdict on every rank all the same: `rank_0s_verdict`).

    "unreadable": an FSDP2 shard, the meta device, quantized values, all-zero rows, or a model without a
    transformers initialiser. A ZeRO-3 partition is gathered (every rank must call it then, as attach does).
    `embedding`: the input embedding's values where the model holds none (a model built on the meta device to
    inspect a checkpoint)."""
    weight = input_weight(model) if embedding is None else embedding
    if is_sharded(weight) or weight.device.type == "meta":
        return WeightsEvidence("unreadable", "its embedding is sharded here (each rank holds a part)")
    if not weight.is_floating_point():
        return WeightsEvidence("unreadable", "its embedding is quantized")
    if not _compat.has_initialiser(model):
        return WeightsEvidence("unreadable", "it has no transformers initialiser to compare with")
    with gathered(weight):  # a ZeRO-3 partition: every rank gathers it (attach runs on every rank)
        rows, width = weight.shape[0], weight.shape[-1]
        count = min(rows, max(_MIN_ROWS, _SAMPLE_ENTRIES // width))
        index = torch.linspace(0, rows - 1, count, device=weight.device).round().long().unique()
        with torch.no_grad():
            actual = _nonzero_rows(weight.detach().index_select(0, index).to("cpu", torch.float32))
    if actual.shape[0] < 2:
        return WeightsEvidence("unreadable", "its embedding's rows are zero")
    mismatches = []
    for draw in _fresh_draws(model, actual.shape[0], width):
        mismatch = _mismatch(actual, draw)
        if not mismatch:
            moved = _moved_constant(model)
            if moved:
                return WeightsEvidence("trained", f"its embedding matches a fresh draw, but {moved}")
            return WeightsEvidence("drawn", "its embedding matches a fresh draw of its own initialiser")
        mismatches.append(mismatch)
    if not mismatches:
        return WeightsEvidence("unreadable", "its initialiser draws no bare embedding or head to compare with")
    return WeightsEvidence("trained", f"its embedding does not match a fresh draw of its initialiser: {mismatches[0]}")


def _moved_constant(model: nn.Module) -> str:
    """Where a parameter that the model's initialiser draws as a constant vector (a normalisation layer's weight or
    bias: ones, zeros, T5's factor) no longer is one, which is in words ("" where none moved): positive evidence that
    training touched the model, which an embedding of large spread hides. A few optimizer steps move every entry of
    such a vector apart (each by about the learning rate) where they move an embedding's entries by a fraction of a
    percent of their spread (issue 78: T5 after 3 AdamW steps at 1e-3, a Llama at `initializer_range=0.2` after one).
    Read on the normalisation modules only (small vectors), whole on this rank (a split parameter tells nothing here);
    each kind of module is drawn once, on a copy, to learn which of its vectors the initialiser makes constant."""
    constant_by_kind: dict[type, set[str]] = {}
    for path, module in normalisation_modules(model):
        vectors = [
            (name, p) for name, p in module.named_parameters(recurse=False)
            if p.dim() == 1 and p.numel() > 1 and p.is_floating_point() and p.device.type != "meta" and not is_split(p)
        ]  # fmt: skip
        moved = [(name, p) for name, p in vectors if bool(p.detach().amax() != p.detach().amin())]
        if not moved:
            continue
        kind = type(module)
        if kind not in constant_by_kind:
            constant_by_kind[kind] = _drawn_constant(model, module)
        for name, _ in moved:
            if name in constant_by_kind[kind]:
                where = f"{path}.{name}" if path else name
                return f"its {where} varies where its initialiser draws a constant: training touched the model"
    return ""


def normalisation_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """`model`'s normalisation layers (LayerNorm, RMSNorm, T5LayerNorm, ...: a class name holding "norm"), by path."""
    return [(path, module) for path, module in model.named_modules() if "norm" in type(module).__name__.lower()]


def _drawn_constant(model: nn.Module, module: nn.Module) -> set[str]:
    """The names of `module`'s 1-D parameters that the model's initialiser draws as a constant vector, read on a
    copy whose values are first set to NaN (a parameter the initialiser leaves alone stays NaN: no evidence); the
    global random state is left as it was."""
    draw = copy.deepcopy(module)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        for param in draw.parameters(recurse=False):
            param.fill_(float("nan"))
        try:
            _compat.init_module_weights(model, draw)
        except Exception:  # noqa: BLE001 - an initialiser that cannot take this module tells nothing
            return set()
    return {
        name for name, p in draw.named_parameters(recurse=False)
        if p.dim() == 1 and not p.isnan().any() and bool(p.amax() == p.amin())
    }  # fmt: skip


def _nonzero_rows(rows: torch.Tensor) -> torch.Tensor:
    return rows[torch.linalg.vector_norm(rows, dim=-1) > 0]


def _fresh_draws(model: nn.Module, rows: int, width: int) -> list[torch.Tensor]:
    """The model's initialiser's draws of an embedding and of a head of shape (rows, width), float32, on the CPU,
    under a fixed seed; the global random state is left as it was."""
    draws = []
    with torch.random.fork_rng(devices=[]):
        for module in (nn.Embedding(rows, width), nn.Linear(width, rows, bias=False)):
            torch.manual_seed(0)
            try:
                _compat.init_module_weights(model, module)
            except Exception:  # noqa: BLE001 - an initialiser that cannot take a bare module compares with nothing
                continue
            draws.append(_nonzero_rows(module.weight.detach().float()))
    return [draw for draw in draws if draw.shape[0] >= 2]


def _mismatch(actual: torch.Tensor, draw: torch.Tensor) -> str:
    """How `actual` rows differ from a fresh `draw` of the same shape, in words ("" where they match)."""
    entries = min(actual.numel(), draw.numel())
    entry_std, drawn_std = float(actual.std()), float(draw.std())
    if drawn_std == 0:
        return "its initialiser draws a constant"
    ratio = entry_std / drawn_std
    if abs(ratio - 1) > max(_ENTRY_SPREAD_FLOOR, 6 / math.sqrt(entries)):
        return f"its entries' spread is {ratio:.2f} times a fresh draw's"
    if abs(float(actual.mean()) - float(draw.mean())) > 6 * drawn_std * math.sqrt(2 / entries):
        return f"its entries' mean is {float(actual.mean()):.3g} (a fresh draw's: {float(draw.mean()):.3g})"
    spread = _row_norm_spread(actual) / _row_norm_spread(draw)
    rows = min(actual.shape[0], draw.shape[0])
    if abs(math.log(spread)) > math.log1p(max(_ROW_SPREAD_FLOOR, 6 / math.sqrt(rows))):
        return f"its row norms vary {spread:.2f} times as much as a fresh draw's"
    # Training gives the rows shared directions (a common shift, a few leading components) within a few steps.
    top = _top_direction(actual) / _top_direction(draw)
    if top > 1 + _TOP_DIRECTION_FLOOR:
        return f"its leading direction is {top:.2f} times as strong as a fresh draw's"
    limit = 1 + 6 * math.sqrt(2 / actual.shape[1])  # a mean row of independent zero-mean entries: chi-square / width
    shift = _mean_row_energy(actual)
    if shift > limit and _mean_row_energy(draw) <= limit:
        return f"its rows share a common shift {shift:.1f} times a fresh draw's expected one"
    return ""


def _top_direction(rows: torch.Tensor) -> float:
    """The largest singular value over that of independent entries of the same spread (about sigma (sqrt(n) +
    sqrt(d))). A randomized estimate (`top_singular_value`): a full SVD of the sample cost seconds per attach at a
    262k vocabulary (`benchmarks/freshness_cost.py`)."""
    count, width = rows.shape
    return top_singular_value(rows) / float(rows.std() * (math.sqrt(count) + math.sqrt(width)))


def top_singular_value(rows: torch.Tensor, rank: int = 8, iterations: int = 6) -> float:
    """The largest singular value of `rows` (n, d), by subspace iteration: `rank` directions drawn under a fixed seed
    (a generator of its own: the global random state is untouched), `iterations` products with rows^T rows, then the
    exact singular values of the (n, rank) projection. The same value on every rank and every call, at O(n d rank)
    instead of a full SVD's O(n d min(n, d)), written as row-major products (a transposed operand costs several times
    as much on the CPU). Measured (2026-11-27): exact to 1e-4 where one direction leads (trained rows), and 2-4% low
    on a fresh draw of 1,820 x 2,304 (no leading direction); the model's rows and the fresh draw they are compared
    with are estimated alike."""
    rank = min(rank, *rows.shape)
    basis = torch.randn(rows.shape[1], rank, generator=torch.Generator().manual_seed(0), dtype=rows.dtype)
    for _ in range(iterations):
        basis = torch.linalg.qr(((rows @ basis).T @ rows).T).Q  # rows^T rows basis, orthonormalised
    return float(torch.linalg.svdvals(rows @ basis)[0])


def _mean_row_energy(rows: torch.Tensor) -> float:
    """The mean row's squared norm over what independent zero-mean entries give (sigma^2 d / n): about 1 for a draw."""
    count, width = rows.shape
    return float(rows.mean(0).square().sum() / (rows.var() * width / count))


def _row_norm_spread(rows: torch.Tensor) -> float:
    norms = torch.linalg.vector_norm(rows, dim=-1)
    return float(norms.std() / norms.mean())


def rank_0s_verdict(evidence: WeightsEvidence) -> WeightsEvidence:
    """Rank 0's "drawn or not", on every rank of a distributed run (one broadcast; every rank attaches): ranks that
    hold different weights before the wrapper broadcasts rank 0's (a model built under another seed per rank) or that
    read a borderline draw differently would otherwise take opposite plans, one untied from step 0 and one tied. A
    rank whose own reading differs says so in its detail."""
    if world_size() == 1:
        return evidence
    drawn = broadcast_decision(evidence.verdict == "drawn")
    if drawn == (evidence.verdict == "drawn"):
        return evidence
    verdict: Literal["drawn", "trained"] = "drawn" if drawn else "trained"
    return WeightsEvidence(verdict, f"rank 0 reads its weights as {verdict}; this rank's: {evidence.detail}")


def built_fresh(model: nn.Module, from_scratch: bool | None = None, embedding: torch.Tensor | None = None) -> Freshness:
    """Whether `model` counts as built fresh (its weights an initialiser's draw no training touched): as
    `from_scratch` says (`UntieConfig.from_scratch`), else only on positive evidence (`weights_evidence`). The
    config's name (`from_pretrained` records it; `from_config(AutoConfig.from_pretrained(dir))` too) decides
    nothing: where a model `from_pretrained` loaded (in eval mode, as it leaves models) reads as drawn, the warning
    names both and the setting that settles it; a model built by `from_config` (in train mode) is silent."""
    if getattr(model, "config", None) is None and from_scratch is None:
        return Freshness(False, "the model counts as trained (it has no transformers config; from_scratch=None)")
    evidence = weights_evidence(model, embedding)
    if from_scratch is None:
        evidence = rank_0s_verdict(evidence)
    named = _compat.loaded_from(model)
    if from_scratch is True:
        warning = None
        if evidence.verdict == "trained":
            warning = (
                f"from_scratch=True, but {evidence.detail}: the head untied before the first step is drawn over it, "
                "as asked. Pass from_scratch=None (decided from the weights) or False to keep it as a copy."
            )
        return Freshness(True, "the model is built fresh (from_scratch=True)", warning)
    if from_scratch is False:
        return Freshness(False, "the model holds trained weights (from_scratch=False)")
    if evidence.verdict == "drawn":
        warning = None
        # from_pretrained leaves the model in eval mode; from_config (run_clm.py --config_name, the standard
        # from-scratch route) in train mode, though both record the config's name: only the former is a surprise.
        if named and not model.training:
            warning = (
                f"the model's config names {named!r} (as from_pretrained records it), but {evidence.detail}: it "
                "counts as built fresh and trains as from scratch. Pass from_scratch=False if it holds trained "
                "weights, or from_scratch=True to say it is built fresh."
            )
        return Freshness(True, f"the model is built fresh ({evidence.detail})", warning)
    if evidence.verdict == "trained":
        why = f"the model counts as trained ({evidence.detail}; pass from_scratch=True if you built it fresh)"
        return Freshness(False, why)
    return Freshness(
        False,
        f"the model counts as trained ({evidence.detail}; pass from_scratch=True if it is trained from scratch)",
    )


def read_for_policy(
    policy: str,
    model: nn.Module,
    *,
    tied: bool,
    peft: bool,
    from_scratch: bool | None = None,
    embedding: torch.Tensor | None = None,
) -> PolicyReading | None:
    """What `choose` needs to know about `model` under `policy` (None where it reads nothing: policy "off", PEFT). The
    freshness read is a collective in a distributed run (`rank_0s_verdict`): every rank calls it, as attach does.
    `embedding`: the input embedding's values, where `model` holds none (`weights_evidence`)."""
    if policy == "off" or peft:
        return None
    share, total = embedding_share(model)
    return PolicyReading(share, total, built_fresh(model, from_scratch, embedding) if tied else None)


def choose_plan(
    policy: str,
    model: nn.Module,
    *,
    tied: bool,
    peft: bool,
    from_scratch: bool | None = None,
    threshold: float | None = None,
    embedding: torch.Tensor | None = None,
) -> PolicyChoice:
    """`choose` on what `read_for_policy` reads off `model` now (`untie inspect`, and tests): the run reads once, at
    attach, and decides with `untie.decision.decide.decide`."""
    reading = read_for_policy(policy, model, tied=tied, peft=peft, from_scratch=from_scratch, embedding=embedding)
    return choose(policy, tied=tied, peft=peft, reading=reading, threshold=threshold)
