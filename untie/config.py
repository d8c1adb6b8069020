"""`UntieConfig`: every setting of `UntieCallback`, as a dataclass that round-trips to JSON."""

from __future__ import annotations

import json
import numbers
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

from untie.surgery import _STATE_INITS, _TIE_INITS
from untie.triggers import UntieWhen, pair_signal


class DefaultDeadline(float):
    """The default `untie_at`, a float that `UntieConfig` can tell from a step the user chose: left at its default,
    `untie_at` is the divergence trigger's deadline; chosen by the user (with no `untie_when`), a fixed schedule."""


#: Default deadline: untie after 30% of the run's optimizer steps unless the divergence trigger fires first. Tying
#: speeds up the start of training and the untie leaves 70% of the budget for the two spaces to separate.
DEFAULT_UNTIE_AT = DefaultDeadline(0.3)
#: `untie_when`'s default: the trigger is on (`default_rule`) when `untie_at` is left at its default, off when the
#: user chose `untie_at` (an explicit step is a schedule). A private object, so no user value can mean it.
_TRIGGER_UNLESS_SCHEDULED: Any = object()
#: How the tied phase is implemented (see `UntieConfig.tying_mode`).
TYING_MODES = ("auto", "live", "emulated")


@dataclass
class UntieConfig:
    """Settings of `UntieCallback`.

    untie_at: optimizer step to untie at: an int is a global step (0 = before the first step), a float in (0, 1) a
        fraction of `max_steps`; None never unties (a tied baseline that still logs `untie/tied`).
    optimizer_state: what the untied head's optimizer state starts from: "copy" (the shared matrix's moments: the
        head continues smoothly) or "reset" (fresh state, as for a new parameter).
    tie_init: when the model arrives untied, the Trainer's model is tied at construction from this matrix:
        "input", "output" or "mean".
    save_at_untie: ask Trainer for a checkpoint at the untie step.
    untie_when: the divergence trigger's rule (`untie.UntieWhen`, its dict, a name from `untie.RULES`, or
        "divergence" for `default_rule`: the evidence rule with `pairs`, the pair-free rule without); the model
        unties when it fires or at `untie_at`,
        whichever comes first. None: untie at `untie_at` only. Left out, it is "divergence" when `untie_at` is
        left out too (trigger + 30% deadline), and None when `untie_at` is given (a fixed schedule) or
        `metrics_every` is 0 (nothing to read).
    metrics_every: measure every this many optimizer steps (0: never): role signals while tied (they feed the
        trigger), drift between the two spaces after the untie. Logged as `untie/...` with Trainer's next log.
    tying_mode: how the tied phase runs. "live": one shared parameter; the head parameter is created at the
        untie (single device, DDP). "emulated": the head has its own parameter from the start and is kept equal to
        the embedding, with the tied gradient (`untie.emulation`); the untie only stops that. It costs one more
        (V, d) parameter while tied and is what FSDP2 needs. "auto" (default): "emulated" under FSDP2, else "live".
    pairs: symbol pairs (token ids) whose distances, pushes, tension, conditional gap and evidence are measured
        too, e.g. [[0, 1], [2, 3]]: pairs you know to be semantically equivalent (synonyms, spelling variants,
        twins). "auto": the most frequent case and word-start variants of the tokenizer Trainer is given as
        `processing_class` (``the``/``The``, ``Ġthe``/``the``, ``▁the``/``the``, ``the``/``##the``; `untie.pairs`),
        refused without one. None (default): "auto" when Trainer has a tokenizer, no pairs otherwise. [] : none.
    """

    untie_at: int | float | None = DEFAULT_UNTIE_AT
    optimizer_state: str = "copy"
    tie_init: str = "input"
    save_at_untie: bool = True
    untie_when: UntieWhen | None = _TRIGGER_UNLESS_SCHEDULED
    metrics_every: int = 50
    pairs: list[tuple[int, int]] | Literal["auto"] | None = None
    tying_mode: str = "auto"

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
        self._resolve_defaults()
        per_pair = pair_signal(self.untie_when.signal) if self.untie_when is not None else None
        if per_pair is not None:
            wanted = per_pair[1]
            listed = isinstance(self.pairs, list)  # "auto" pairs are known only once the tokenizer is read
            if self.pairs == [] or (wanted and listed and wanted not in {f"{a}-{b}" for a, b in self.pairs}):
                raise ValueError(
                    f"untie_when.signal={self.untie_when.signal!r} needs that pair in pairs=..., got {self.pairs}."
                )
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
        if self.tie_init not in _TIE_INITS:
            raise ValueError(f"tie_init={self.tie_init!r} is not one of {_TIE_INITS}.")

    def _resolve_defaults(self) -> None:
        """Turn `untie_when` (left out, "divergence", a dict, ...) into an `UntieWhen` or None, and `untie_at` into a
        plain number: the JSON form is explicit, so a round trip gives the same settings."""
        # A step the user chose is a schedule, and metrics_every=0 leaves the trigger nothing to read.
        scheduled = not isinstance(self.untie_at, DefaultDeadline) or self.metrics_every == 0
        left_out = self.untie_when is _TRIGGER_UNLESS_SCHEDULED
        #: The trigger is on by default, not by the user's choice (not a field: the JSON form is explicit).
        self.trigger_by_default = left_out and not scheduled
        if left_out:
            self.untie_when = None if scheduled else "divergence"
        #: "divergence" depends on whether pairs are measured, known for pairs=None only once Trainer is built.
        self.rule_follows_pairs = self.untie_when == "divergence" and self.pairs is None
        # pairs=None may find no tokenizer: the callback then falls back to the pair-free rule (`UntieCallback`).
        self.untie_when = UntieWhen.coerce(self.untie_when, with_pairs=self.pairs != [])
        if self.untie_when is not None and self.metrics_every == 0:
            raise ValueError("untie_when needs measurements: set metrics_every > 0 (e.g. 50) or untie_when=None.")
        if isinstance(self.untie_at, DefaultDeadline):
            self.untie_at = float(self.untie_at)

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
