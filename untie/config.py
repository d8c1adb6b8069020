"""`UntieConfig`: every setting of `UntieCallback`, as a dataclass that round-trips to JSON."""

from __future__ import annotations

import json
import numbers
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

from untie.surgery import _STATE_INITS, _TIE_INITS
from untie.triggers import UntieWhen, pair_signal

#: Default deadline: untie after 30% of the run's optimizer steps unless the divergence trigger fires first. Tying
#: speeds up the start of training and the untie leaves 70% of the budget for the two spaces to separate.
DEFAULT_UNTIE_AT = 0.3
#: How the tied phase is implemented (see `UntieConfig.tying_mode`).
TYING_MODES = ("auto", "live", "emulated")
TyingMode = Literal["auto", "live", "emulated"]
OptimizerStateInit = Literal["copy", "reset", "fresh"]
TieInit = Literal["input", "output", "mean"]
#: What `untie_when` accepts: a rule, its dict form, a rule name (`untie.RULES`), "divergence", or None (no trigger).
RuleSpec = UntieWhen | dict | str | None


@dataclass
class UntieConfig:
    """Every setting of a tie-then-untie run (`UntieCallback`, `untie.Untier`), as plain fields that round-trip to JSON.

    The defaults are the product's behaviour: train tied, untie when the divergence trigger fires, and at 30% of the
    run at the latest. A fixed schedule is ``untie_when=None`` with ``untie_at=<step or fraction>``; a tied
    baseline that still logs is ``untie_at=None, untie_when=None``.
    """

    untie_at: int | float | None = field(
        default=DEFAULT_UNTIE_AT,
        metadata={
            "help": "The untie step at the latest: an int is a global optimizer step (0 = before the first step), a "
            "float in (0, 1) a fraction of max_steps, None no deadline. With untie_when=None it is a fixed schedule."
        },
    )
    optimizer_state: OptimizerStateInit = field(
        default="copy",
        metadata={
            "help": "What the untied head's optimizer state starts from: 'copy' (the shared matrix's moments: the "
            "head continues smoothly), 'reset' (fresh state, as for a new parameter), or 'fresh' (fresh state for "
            "the head and for the embedding, whose kept moments would otherwise come mostly from the head's role)."
        },
    )
    tie_init: TieInit | None = field(
        default=None,
        metadata={
            "help": "A model that arrives untied (its head a trained matrix of its own): None keeps it untied and "
            "trains it so from the first step (nothing is dropped); 'input', 'output' or 'mean' ties it at "
            "construction from that matrix (or their mean), for a tie-then-untie run."
        },
    )
    save_at_untie: bool = field(
        default=True, metadata={"help": "Ask Trainer for a checkpoint at the untie step (Trainer only)."}
    )
    untie_when: RuleSpec = field(
        default="divergence",
        metadata={
            "help": "The divergence trigger: 'divergence' (the default rule: the evidence rule when pairs are "
            "measured, the pair-free rule otherwise), a rule name from "
            "untie.RULES ('evidence', 'gap', 'cancellation', ...), an untie.UntieWhen or its dict, or None (untie at "
            "untie_at only). The model unties when it fires or at untie_at, whichever comes first."
        },
    )
    metrics_every: int = field(
        default=50,
        metadata={
            "help": "Measure every this many optimizer steps: role signals while tied (they feed the trigger), drift "
            "between the two spaces after the untie, logged as untie/... 0 measures nothing (needs untie_when=None)."
        },
    )
    pairs: list[tuple[int, int]] | Literal["auto"] | None = field(
        default=None,
        metadata={
            "help": "Symbol pairs (token ids) known to be semantically equivalent, measured too: [[id_a, id_b], ...]. "
            "'auto': the tokenizer's most frequent case and word-start variants (the/The, Ġthe/the, ▁the/the, "
            "the/##the), refused without a tokenizer. None: 'auto' when there is a tokenizer, else none. []: none."
        },
    )
    tying_mode: TyingMode = field(
        default="auto",
        metadata={
            "help": "The tied phase: 'live' (one shared parameter; the head is created at the untie: one device, DDP), "
            "'emulated' (the head is its own parameter kept equal to the embedding, with the tied gradient: what "
            "FSDP2 and DeepSpeed need, at the cost of one more (V, d) parameter while tied), or 'auto' (emulated "
            "under FSDP2 and DeepSpeed)."
        },
    )

    def __post_init__(self) -> None:
        if isinstance(self.metrics_every, numbers.Integral) and not isinstance(self.metrics_every, bool):
            self.metrics_every = int(self.metrics_every)
        if isinstance(self.metrics_every, bool) or not isinstance(self.metrics_every, int) or self.metrics_every < 0:
            raise ValueError(f"metrics_every={self.metrics_every!r} must be an int >= 0 (0 turns the metrics off).")
        if self.pairs is not None and self.pairs != "auto":
            try:
                self.pairs = [(int(a), int(b)) for a, b in self.pairs]
            except (TypeError, ValueError):
                raise ValueError(
                    f"pairs={self.pairs!r}: pass a list of (token_id, token_id) pairs, or 'auto' (read from the "
                    "tokenizer Trainer is given as processing_class)."
                ) from None
        if isinstance(self.untie_when, dict):
            self.untie_when = UntieWhen.coerce(self.untie_when)  # the JSON form of a rule: the rule itself
        rule = self.rule(with_pairs=self.pairs != [])  # refuses an unknown name or a bad rule now
        if rule is not None and self.metrics_every == 0:
            raise ValueError(
                f"untie_when={self.untie_when!r} reads measurements, and metrics_every=0 takes none: set "
                "metrics_every > 0 (e.g. 50), or untie_when=None for a fixed schedule at untie_at."
            )
        per_pair = pair_signal(rule.signal) if rule is not None else None
        if per_pair is not None and not self.is_default_rule:
            wanted = per_pair[1]
            listed = isinstance(self.pairs, list)  # "auto" pairs are known only once the tokenizer is read
            if self.pairs == [] or (wanted and listed and wanted not in {f"{a}-{b}" for a, b in self.pairs}):
                raise ValueError(f"untie_when.signal={rule.signal!r} needs that pair in pairs=..., got {self.pairs}.")
        at = self.untie_at
        if isinstance(at, numbers.Integral) and not isinstance(at, bool):
            at = self.untie_at = int(at)  # numpy / torch integers are steps too
        elif isinstance(at, numbers.Real) and not isinstance(at, (bool, numbers.Integral)):
            at = self.untie_at = float(at)
        if isinstance(at, bool) or not (at is None or isinstance(at, (int, float))):
            raise ValueError(f"untie_at={at!r}: pass an int step, a float fraction in (0, 1), or None (never).")
        if isinstance(at, int) and at < 0:
            raise ValueError(f"untie_at={at} is negative: pass a global step >= 0 or a fraction in (0, 1).")
        if isinstance(at, float) and not 0.0 < at < 1.0:
            raise ValueError(
                f"untie_at={at} is a float outside (0, 1): floats are fractions of max_steps; pass an int for a step."
            )
        if self.tying_mode not in TYING_MODES:
            raise ValueError(f"tying_mode={self.tying_mode!r} is not one of {TYING_MODES}.")
        if self.optimizer_state not in _STATE_INITS:
            raise ValueError(f"optimizer_state={self.optimizer_state!r} is not one of {_STATE_INITS}.")
        if self.tie_init is not None and self.tie_init not in _TIE_INITS:
            raise ValueError(f"tie_init={self.tie_init!r} is not one of {_TIE_INITS}, or None (keep it untied).")

    @property
    def is_default_rule(self) -> bool:
        """`untie_when` is "divergence": the rule follows whether pairs are measured."""
        return self.untie_when == "divergence"

    def rule(self, with_pairs: bool) -> UntieWhen | None:
        """The trigger's rule (`untie.UntieWhen`) for a run that measures pairs or not; None: no trigger."""
        return UntieWhen.coerce(self.untie_when, with_pairs=with_pairs)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json_dict(self) -> dict[str, Any]:
        """`to_dict` as a JSON round trip gives it (tuples become lists): what a checkpoint holds."""
        return json.loads(json.dumps(self.to_dict()))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> UntieConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"Unknown UntieConfig keys {unknown}; known keys: {sorted(known)}.")
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> UntieConfig:
        return cls.from_dict(json.loads(text))
