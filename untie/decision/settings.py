"""`UntieConfig`: every setting of a tie-then-untie run, as one dataclass that parses from a command line
(`transformers.HfArgumentParser`), round-trips to JSON with the library's version, and is what the adapters take
(`UntieCallback(config)`, `Untier(model, config=config)`). Torch-free: importing it imports neither torch nor
transformers."""

from __future__ import annotations

import json
import math
import numbers
import operator
import os
import re
import warnings
from dataclasses import asdict, dataclass, fields
from types import MappingProxyType
from typing import Any, Literal, NoReturn

from untie._version import __version__
from untie.decision.share_bands import SHARE_DEFAULT
from untie.decision.triggers import UntieWhen, pair_signal
from untie.errors import UntieRuntimeError, UntieTypeError, UntieValueError


class NotGiven:
    """A tracked setting the user did not give (`UntieConfig.was_set`): only a field's default and the value
    `UntieConfig.to_dict` passes for it, never a value a config holds. It equals (and JSON-writes as) its plain
    value, so that ``UntieConfig(**config.to_dict())`` and ``json.dumps(config.to_dict())`` both work, while a value
    written out (``untie_at=0.3``, ``--untie_at 0.3``, ``"untie_at": 0.3``) counts as asked for.
    `UntieConfig.__post_init__` replaces it by its plain `value`: what `torch.compile` traces is plain data."""

    __slots__ = ()

    @property
    def value(self) -> Any:
        raise NotImplementedError


class _NotGivenNumber(float, NotGiven):
    __slots__ = ()

    @property
    def value(self) -> float:
        return float(self)


class _NotGivenText(str, NotGiven):
    __slots__ = ()

    @property
    def value(self) -> str:
        return str.__str__(self)

    def __str__(self) -> str:
        return self  # argparse converts a string default with type=str: it stays not given


def not_given(value: float | str) -> Any:
    """`value` marked as not given (`NotGiven`)."""
    return _NotGivenText(value) if isinstance(value, str) else _NotGivenNumber(value)


#: Default deadline: untie after 30% of the run's optimizer steps unless the divergence trigger fires first. Tying
#: speeds up the start of training and the untie leaves 70% of the budget for the two spaces to separate.
DEFAULT_UNTIE_AT: float = 0.3
#: Default trigger: the divergence rule (the evidence rule when pairs are measured, the pair-free rule otherwise).
DEFAULT_UNTIE_WHEN: str = "divergence"
#: How the tied phase is implemented (see `UntieConfig.tying_mode`).
TYING_MODES = ("auto", "live", "emulated")
#: What the untied head's (and embedding's) optimizer state starts from (see `UntieConfig.optimizer_state`).
OPTIMIZER_STATES = ("copy", "reset", "fresh")
#: Which matrix a tie starts from (see `UntieConfig.tie_init`, `untie.tie_embeddings`).
TIE_INITS = ("input", "output", "mean")
TyingMode = Literal["auto", "live", "emulated"]
OptimizerStateInit = Literal["copy", "reset", "fresh"]
TieInit = Literal["input", "output", "mean"]
#: The untie policies (see `UntieConfig.policy`, `untie.structure.policy`); here, so that the config stays torch-free.
POLICIES = ("off", "auto", "fresh-untied", "untie-at-start", "by-share")
PolicyName = Literal["off", "auto", "fresh-untied", "untie-at-start", "by-share"]
#: The policy an unset `UntieConfig.policy` follows where the schedule is not set (`chosen_policy`): the study's
#: verdict (docs/recipes/when-it-pays.md). Round one's: a model built fresh trains untied from step 0, its head drawn
#: (validated on held-out cells of the decision map and by the study's cell A); a loaded tied model unties at once, its
#: head a copy (the study's fine-tuning table: the lowest target loss of the arms measured). Round two's ("by-share",
#: issue 77): a model built fresh follows the band of its embedding's share (`untie.decision.share_bands`); it
#: becomes the default once round two's rule has read every cell (`SHARE_DEFAULT.complete`), and not before.
DEFAULT_POLICY = "by-share" if SHARE_DEFAULT.complete else "untie-at-start"
#: The schedule's settings: set either of them (whatever the value: by keyword, on a command line or in JSON) and an
#: unset policy is "off", so the schedule asked for runs. Measurement knobs (metrics_every, pairs) and how a tied
#: phase runs (tying_mode, optimizer_state) do not change the plan.
SCHEDULE_SETTINGS = ("untie_at", "untie_when")
#: The settings whose being given is recorded beside their values (`UntieConfig.was_set`): the schedule's, and the
#: roles' rate scales (policy "by-share" may choose the input embedding's where the user gave none). A resume with one
#: of them not given continues the checkpoint's (`untie.checkpoints.saved_state.resumed_config`).
TRACKED_SETTINGS = (*SCHEDULE_SETTINGS, "embedding_lr_scale", "head_lr_scale")
#: A role's rate scale where none is given (the user's rate).
DEFAULT_LR_SCALE = 1.0
#: How a head untied before the first step starts (see `UntieConfig.head_init`).
HEAD_INITS = ("auto", "copy", "model")
HeadInit = Literal["auto", "copy", "model"]
#: The JSON key that records the library version a config was written by (`UntieConfig.to_json`).
VERSION_KEY = "untie_version"


@dataclass
class UntieConfig:
    """Every setting of a tie-then-untie run (`untie.UntieCallback`, `untie.Untier`).

    The defaults decide from the model (`untie.structure.policy`), as the study's verdict says (docs/recipes/
    when-it-pays.md): every model that arrives tied trains untied from the first step. A model whose weights are an
    initialiser's draw (pretraining from scratch) gets a head drawn by the model's initialiser; a model holding trained
    weights (loaded, by `from_pretrained` or by hand) gets a head that starts as a copy of the embedding: nothing
    trained is drawn over. Setting the schedule (`untie_at` or `untie_when`, whatever the value) runs it as set: a
    tied phase is ``untie_at=<step or fraction>`` (with the divergence trigger unless ``untie_when=None``); a tied
    baseline that still logs is ``untie_at=None, untie_when=None``. Every field parses from a command line
    (``HfArgumentParser((UntieConfig, TrainingArguments))``: ``--untie_at 500 --untie_when none --pairs auto``) and
    from JSON (`from_json`, `from_json_file`). Copy it with `config.replace(...)`: `dataclasses.replace` passes every
    value on, so it would count every tracked setting (`TRACKED_SETTINGS`) as given.

    Attributes:
        untie_at: The untie step at the latest. A whole number is a global optimizer step (0: before the first
            step; ``500`` and ``500.0`` are the same step), a number in (0, 1) a fraction of max_steps, None or
            ``inf`` (what a command line can say) no deadline. With untie_when=None it is a fixed schedule.
            Unset: 0.3 (30% of the run), and the plan is decided from the model (see policy); set, whatever its
            value, it runs as set.
        untie_when: The divergence trigger: 'divergence' (the default rule: the evidence rule when pairs are
            measured, the pair-free rule otherwise), a rule name from untie.RULES ('evidence', 'gap',
            'cancellation', ...), a rule as JSON ('{"signal": "gap", "threshold": 0.3}') or an untie.UntieWhen, or
            'none' / None (untie at untie_at only). The model unties when it fires or at untie_at, whichever is first.
            Unset: 'divergence', and the plan is decided from the model; set, whatever its value, it runs as set.
        metrics_every: Measure every this many optimizer steps: role signals while tied (they feed the trigger),
            drift between the two spaces after the untie, logged as untie/... 0 measures nothing (needs
            untie_when=None). It does not change the plan.
        pairs: Symbol pairs (token ids) known to be semantically equivalent, measured too. 'auto': the tokenizer's
            most frequent case and word-start variants (the/The, Ġthe/the, ▁the/the, the/##the), refused without a
            tokenizer; None (default): 'auto' when there is a tokenizer, else none; 'none' or []: none; a JSON list
            ('[[12, 345], [67, 89]]') or the path of a JSON file holding one; in Python a list of (id, id) pairs of
            two different whole-number ids. It does not change the plan.
        optimizer_state: What the untied head's optimizer state starts from: 'copy' (the shared matrix's moments:
            the head continues smoothly), 'reset' (fresh state, as for a new parameter), or 'fresh' (fresh state for
            the head and for the embedding, whose kept moments would otherwise come mostly from the head's role).
        tie_init: For a model that arrives untied (its head a trained matrix of its own): None (default) keeps it
            untied and trains it so from the first step (nothing is dropped); 'input', 'output' or 'mean' ties it at
            construction from that matrix (or their mean), for a tie-then-untie run.
        tying_mode: The tied phase: 'live' (one shared parameter; the head is created at the untie: one device,
            DDP), 'emulated' (the head is its own parameter kept equal to the embedding, with the tied gradient:
            what FSDP2 and DeepSpeed need, at the cost of one more (V, d) parameter while tied), or 'auto'
            (emulated under FSDP2 and DeepSpeed, else live).
        save_at_untie: Ask Trainer for a checkpoint at the untie step (Trainer only; `untie.Untier` ignores it).
        head_init: How a head untied before the first step starts (untie_at=0, or the default plan): 'copy' of
            the input embedding (lossless: a trained tied model keeps its trained output role), 'model' (drawn by
            the model's own initialiser, as a model built untied has it: for training from scratch, where a copied
            head trained worse on the decision map and in the study), or 'auto' (default): 'model' for a model
            trained from scratch (see from_scratch), else 'copy'.
        from_scratch: Whether the model's weights are an initialiser's draw that no training has touched: True
            (pretraining from scratch: the default plan trains it untied from the first step, its head drawn),
            False (trained weights: a head untied from them starts as a copy), or None (default): decided from the
            weights themselves, by positive evidence only: the input embedding matches a fresh draw of the model's
            own initialiser (untie.structure.policy.weights_evidence; a ZeRO-3 partition is gathered to be read, and
            every rank takes rank 0's verdict); weights that do not match, or that cannot be read here (an FSDP2
            shard, the meta device, quantized values, a model without an initialiser), count as trained. The
            config's name (what from_pretrained records) decides nothing.
        policy: None (default): DEFAULT_POLICY ('by-share', the study's round two), unless the schedule is set
            (untie_at or untie_when, whatever the value): then 'off', and the schedule runs as set (`chosen_policy`).
            'off' runs untie_at / untie_when as set. 'by-share': a model built fresh follows the study's choice for
            its embedding's share (untie.decision.share_bands: untied from step 0 with a drawn head, the input
            embedding at the band's rate scale unless embedding_lr_scale is set, or a tied phase to a fraction of
            the run with no trigger), a loaded tied model unties at once with its head a copy (bands still pending
            would run it as 'untie-at-start'). 'untie-at-start' (the default before round two): every model that
            arrives tied trains untied from the first step, its head drawn by its initialiser where the model is
            built fresh (see from_scratch), a copy of the embedding otherwise (the study's verdict,
            docs/recipes/when-it-pays.md: in fine-tuning, untying at once reached the lowest target loss of the arms
            measured). 'fresh-untied' (the default before the study's fine-tuning
            table): a model built fresh trains untied from the first step, its head drawn; a model holding trained
            weights runs untie_at / untie_when (by default: tied, the trigger, the deadline). Both were validated for
            models built fresh on held-out cells (docs/recipes/decision-map.md, "`fresh-untied` held out: the
            verdict"). 'auto' is retired: its held-out validation failed (docs/recipes/decision-map.md); it is still
            read, with a warning, and runs as 'fresh-untied' above untie.decision.policy_rules.UNTIED_FROM_START_SHARE
            (0.5) of the parameters in the embedding.
        embedding_lr_scale: The input embedding's learning rate, as a multiple of the rate of the optimizer group it
            came from (the group's rate at every step, warm-up and decay included): unset, 1.0 (the user's rate),
            unless policy 'by-share' chooses a scale for the model's share (then the run's line says so); 1.0 keeps
            it; 0.1 trains it ten times slower (less forgetting when fine-tuning); 0 freezes it; above 1 trains it
            faster (the untied embedding of modded-nanogpt trains at many times the head's rate). A value other than
            1 gives the embedding a param group of its own (`untie.structure.role_rates`). From the untie on, unless
            lr_scales_while_tied.
        head_lr_scale: The LM head's learning rate, as a multiple of the rate of the optimizer group it came from
            (1.0, default, keeps it; 0 freezes it). A value other than 1 gives the head a param group of its own,
            which it joins at the untie.
        lr_scales_while_tied: False (default): the scales apply from the untie on, and a tied phase trains the shared
            matrix at the group's rate. True: also during a tied phase, where the shared matrix (both roles) takes
            embedding_lr_scale.
    """

    untie_at: float | None = not_given(DEFAULT_UNTIE_AT)  # plain once __post_init__ ran
    untie_when: dict | str | UntieWhen | None = not_given(DEFAULT_UNTIE_WHEN)
    metrics_every: int = 50
    pairs: list[tuple[int, int]] | str | None = None
    optimizer_state: OptimizerStateInit = "copy"
    tie_init: TieInit | None = None
    tying_mode: TyingMode = "auto"
    save_at_untie: bool = True
    head_init: HeadInit = "auto"
    from_scratch: bool | None = None
    policy: PolicyName | None = None
    embedding_lr_scale: float = not_given(DEFAULT_LR_SCALE)
    head_lr_scale: float = not_given(DEFAULT_LR_SCALE)
    lr_scales_while_tied: bool = False

    def __post_init__(self) -> None:
        given = {name: not isinstance(getattr(self, name), NotGiven) for name in TRACKED_SETTINGS}
        self._given = frozenset(name for name, was in given.items() if was)
        self.from_checkpoint: frozenset[str] = frozenset()
        """The settings a checkpoint gave at a resume, not the user (`continuing`); not a field: never saved."""
        self.metrics_every = _whole_number(self.metrics_every, "metrics_every", "0 turns the metrics off")
        self.pairs = _parse_pairs(self.pairs)
        self.untie_when = _parse_rule(self.untie_when) if given["untie_when"] else DEFAULT_UNTIE_WHEN
        self.untie_at = _parse_untie_at(self.untie_at) if given["untie_at"] else DEFAULT_UNTIE_AT
        _check_choice(self.tying_mode, TYING_MODES, "tying_mode")
        _check_choice(self.optimizer_state, OPTIMIZER_STATES, "optimizer_state")
        if self.policy is not None:
            _check_choice(
                self.policy,
                POLICIES,
                "policy",
                f"or None (the default: {DEFAULT_POLICY!r} unless you set the schedule)",
            )
        _check_choice(self.head_init, HEAD_INITS, "head_init")
        if self.tie_init is not None:
            _check_choice(self.tie_init, TIE_INITS, "tie_init", "or None (keep it untied)")
        for name in ("embedding_lr_scale", "head_lr_scale"):
            value = getattr(self, name)
            setattr(self, name, _scale(value, name) if given[name] else DEFAULT_LR_SCALE)
        if not isinstance(self.lr_scales_while_tied, bool):
            raise UntieValueError(
                f"lr_scales_while_tied={self.lr_scales_while_tied!r}: pass True (the scales apply during a tied phase "
                "too) or False (from the untie on)."
            )
        if not isinstance(self.save_at_untie, bool):
            raise UntieValueError(f"save_at_untie={self.save_at_untie!r}: pass True or False.")
        if self.from_scratch is not None and not isinstance(self.from_scratch, bool):
            raise UntieValueError(
                f"from_scratch={self.from_scratch!r}: pass True (the weights are an initialiser's draw), False "
                "(trained weights) or None (decided from the weights)."
            )
        if self.head_init == "model" and self.untie_at != 0 and self.chosen_policy()[0] == "off":
            raise UntieValueError(
                f"head_init='model' draws a head untied before the first step, and untie_at={self.untie_at!r} unties "
                "later (a head drawn mid-run would drop what the tied phase trained): pass untie_at=0, or "
                "a policy ('untie-at-start', 'fresh-untied'), or leave head_init at 'auto'."
            )
        rule = self.rule(with_pairs=self.pairs != [])  # refuses an unknown name or a bad rule now
        # A trigger asked for (untie_when set, or the default's with a schedule set) needs measurements; under a policy
        # the plan decides whether a trigger runs at all (the default's never does): `decide` refuses it there.
        asked = self.was_set("untie_when") or (self.chosen_policy()[0] == "off" and self.untie_at != 0)
        if rule is not None and self.metrics_every == 0 and asked:
            raise UntieValueError(
                f"untie_when={self.untie_when!r} reads measurements, and metrics_every=0 takes none: set "
                "metrics_every > 0 (e.g. 50), or untie_when=None for a fixed schedule at untie_at."
            )
        per_pair = pair_signal(rule.signal) if rule is not None else None
        if rule is not None and per_pair is not None and not self.is_default_rule:
            wanted = per_pair[1]
            listed = self.pairs if isinstance(self.pairs, list) else None  # "auto": known once the tokenizer is read
            if self.pairs == [] or (wanted and listed and wanted not in {f"{a}-{b}" for a, b in listed}):
                raise UntieValueError(
                    f"untie_when.signal={rule.signal!r} needs that pair in pairs=..., got {self.pairs}."
                )

    def __eq__(self, other: object) -> bool:
        """Equal values, and the same schedule settings set: ``UntieConfig(untie_at=0.3)`` asks for the schedule that
        ``UntieConfig()`` leaves to the default plan, so the two differ."""
        if not isinstance(other, UntieConfig):
            return NotImplemented
        same_set = all(self.was_set(name) == other.was_set(name) for name in TRACKED_SETTINGS)
        return same_set and self.values() == other.values()

    __hash__ = None  # type: ignore[assignment]  # mutable, as a dataclass with eq

    def was_set(self, name: str) -> bool:
        """Whether setting `name` was set by the user (by keyword, on a command line or in JSON), whatever its value:
        only `TRACKED_SETTINGS` keep the difference (`NotGiven`); the other fields count as set."""
        return name not in TRACKED_SETTINGS or name in self._given

    def chosen_policy(self) -> tuple[str, str]:
        """The policy the run follows, and why in words: `policy` as set; unset (None), `DEFAULT_POLICY`, or "off" where
        the schedule (`SCHEDULE_SETTINGS`) was set, whatever its value: a schedule asked for runs as set."""
        if self.policy is not None and "policy" in self.from_checkpoint:
            return self.policy, f"the checkpoint's policy={self.policy!r} continues"
        if self.policy is not None:
            return self.policy, ""
        asked = [name for name in SCHEDULE_SETTINGS if self.was_set(name)]
        if asked:
            settings = ", ".join(f"{name}={getattr(self, name)!r}" for name in asked)
            if self.continues_checkpoint:
                return "off", f"the checkpoint's schedule continues ({settings})"
            return "off", f"the schedule is set ({settings}): it runs as set"
        return DEFAULT_POLICY, f"the default policy, {DEFAULT_POLICY!r}"

    @property
    def is_default_rule(self) -> bool:
        """`untie_when` is "divergence": the rule follows whether pairs are measured."""
        return self.untie_when == "divergence"

    def rule(self, with_pairs: bool) -> UntieWhen | None:
        """The trigger's rule (`untie.UntieWhen`) for a run that measures pairs or not; None: no trigger."""
        return UntieWhen.coerce(self.untie_when, with_pairs=with_pairs)

    def replace(self, **overrides: Any) -> UntieConfig:
        """A copy with `overrides` (setting names as keywords) applied and checked; an unknown name is refused."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise UntieTypeError(
                f"Unknown untie settings {unknown}; the settings are the fields of UntieConfig: {sorted(known)}."
            )
        # Not `dataclasses.replace`, which would pass every value on as given: a setting not given stays so.
        kept = {f.name: getattr(self, f.name) for f in fields(self) if self.was_set(f.name)}
        replaced = type(self)(**{**kept, **overrides})
        replaced.from_checkpoint = self.from_checkpoint - set(overrides)
        return replaced

    def continuing(self, taken: dict[str, Any]) -> UntieConfig:
        """This config with `taken` (settings the user left unset) at a checkpoint's values, remembered as the
        checkpoint's: the run's messages then say that the checkpoint's plan continues (`continues_checkpoint`)."""
        resumed = self.replace(**taken)
        resumed.from_checkpoint = self.from_checkpoint | frozenset(taken)
        return resumed

    @property
    def continues_checkpoint(self) -> bool:
        """Every schedule setting given was given by a checkpoint (`continuing`), and at least one was."""
        asked = {name for name in SCHEDULE_SETTINGS if self.was_set(name)}
        return bool(asked) and asked <= self.from_checkpoint

    # -- JSON ----------------------------------------------------------------------------------------------------------
    def values(self) -> dict[str, Any]:
        """Every setting's value, plain (a rule as its dict), whether given or not (what JSON of all of them holds)."""
        return asdict(self)

    def to_dict(self) -> dict[str, Any]:
        """Keyword arguments that rebuild this config (`UntieConfig(**config.to_dict())`, the adapters'): the values
        of `values`, a tracked setting not given marked so (`NotGiven`: equal to its value, JSON-writable), so that the
        rebuilt config leaves it unset too (`to_json_dict` leaves it out instead)."""
        return {name: value if self.was_set(name) else not_given(value) for name, value in self.values().items()}

    def to_json_dict(self) -> dict[str, Any]:
        """`to_dict` as a JSON round trip gives it (tuples become lists): what a checkpoint holds. A schedule setting
        left unset is left out, so that the JSON read back leaves it unset too (`was_set`)."""
        kept = {name: value for name, value in self.values().items() if self.was_set(name)}
        return json.loads(json.dumps(kept))

    def to_json(self) -> str:
        """The settings as JSON, with the library version that wrote them (`untie_version`)."""
        return json.dumps({**self.to_json_dict(), VERSION_KEY: __version__}, indent=2, sort_keys=True)

    def to_json_file(self, path: str | os.PathLike) -> None:
        """Write `to_json` to `path` (read back by `from_json_file`, or by ``HfArgumentParser.parse_json_file``
        once the version key is dropped)."""
        with open(path, "w", encoding="utf-8") as file:
            file.write(self.to_json() + "\n")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> UntieConfig:
        """The config of `data` (`to_dict` / `to_json` output); an unknown key is refused by name. A version key
        newer than this library's is said once: its settings may mean more than this version reads."""
        data = dict(data)
        written_by = data.pop(VERSION_KEY, None)
        if written_by is not None:
            _warn_if_newer(str(written_by))
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise UntieValueError(f"Unknown UntieConfig keys {unknown}; known keys: {sorted(known)}.")
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> UntieConfig:
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> UntieConfig:
        """The config saved in `path` (`to_json_file`); a file that is not a JSON object is refused, naming it."""
        with open(path, encoding="utf-8") as file:
            text = file.read()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise UntieValueError(
                f"UntieConfig.from_json_file({os.fspath(path)!r}): the file is not valid JSON ({error}); it should "
                "hold one object of settings, as UntieConfig.to_json_file writes."
            ) from None
        if not isinstance(data, dict):
            raise UntieValueError(
                f"UntieConfig.from_json_file({os.fspath(path)!r}): the file holds {type(data).__name__} "
                f"{text.strip()[:40]!r}, not an object of settings such as UntieConfig.to_json_file writes."
            )
        return cls.from_dict(data)


def build_config(config: UntieConfig | None, overrides: dict[str, Any], owner: str) -> UntieConfig:
    """What the adapters run with: `config` (default `UntieConfig()`) with the keyword `overrides` applied."""
    if config is not None and not isinstance(config, UntieConfig):
        raise UntieTypeError(
            f"{owner}(config={config!r}): config is an untie.UntieConfig; pass single settings by name instead, "
            f"e.g. {owner}(untie_at=500, untie_when=None)."
        )
    base = config if config is not None else UntieConfig()
    return base.replace(**overrides) if overrides else base


def parse_command_line(types: Any, args: list[str] | None = None, prog: str | None = None) -> tuple[Any, ...]:
    """``HfArgumentParser(types).parse_args_into_dataclasses(args)``, where a bad value is one line on stderr that
    names the setting and the fix (exit status 2), instead of a traceback or argparse's whole usage text."""
    import sys

    from transformers import HfArgumentParser

    parser = HfArgumentParser(types, prog=prog)

    def one_line(message: str) -> NoReturn:
        parser.exit(2, f"{parser.prog}: error: {message} (--help lists every setting)\n")

    parser.error = one_line  # type: ignore[method-assign]  # argparse: error() may be overridden
    try:
        return parser.parse_args_into_dataclasses(args=args)
    except (ValueError, TypeError) as error:  # a dataclass refused a value (UntieConfig's checks name the setting)
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


def settings_help() -> str:
    """Every setting and its meaning, as `UntieConfig`'s docstring lists them (for the adapters' `help()`)."""
    return "Settings (the fields of untie.UntieConfig, passed as config=... or by name):\n" + _attributes_section()


# -- parsing each field ------------------------------------------------------------------------------------------------
def _whole_number(value: Any, name: str, note: str) -> int:
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value) >= 0:
        return int(value)
    raise UntieValueError(f"{name}={value!r} must be an int >= 0 ({note}).")


def _scale(value: Any, name: str) -> float:
    """A learning-rate scale: a finite number >= 0 (1 keeps the group's rate, 0 freezes the role)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
        raise UntieValueError(
            f"{name}={value!r} must be a finite number >= 0: a multiple of the learning rate of the optimizer group "
            "the role came from (1.0 keeps it, 0.1 is ten times slower, 0 freezes the role)."
        )
    return float(value)


def _check_choice(value: Any, choices: tuple[str, ...], name: str, extra: str = "") -> None:
    if value not in choices:
        raise UntieValueError(f"{name}={value!r} is not one of {choices}{' ' + extra if extra else ''}.")


def _parse_untie_at(at: Any) -> int | float | None:
    """None / inf: no deadline; a whole number: a step (int); a number in (0, 1): a fraction of the run (float)."""
    if at is None:
        return None
    if isinstance(at, bool) or not isinstance(at, numbers.Real):
        raise UntieValueError(
            f"untie_at={at!r}: pass a step (500), a fraction of the run in (0, 1) (0.3), or None / inf."
        )
    if isinstance(at, numbers.Integral):
        step = int(at)
    else:
        value = float(at)
        if math.isinf(value) and value > 0:
            return None
        if 0.0 < value < 1.0:
            return value
        if math.isnan(value) or not value.is_integer():
            raise UntieValueError(
                f"untie_at={at} is neither a whole step nor a fraction in (0, 1): numbers >= 1 are optimizer steps "
                "(e.g. 500), numbers in (0, 1) fractions of max_steps (e.g. 0.3)."
            )
        step = int(value)
    if step < 0:
        raise UntieValueError(f"untie_at={step} is negative: pass a global step >= 0 or a fraction in (0, 1).")
    return step


def _parse_rule(rule: Any) -> str | UntieWhen | None:
    """A rule name stays a name ("divergence", "evidence", ...); JSON and dicts become an `UntieWhen`; "none": None."""
    if isinstance(rule, str):
        text = rule.strip()
        if text.lower() == "none":
            return None
        if text.startswith("{"):
            try:
                rule = json.loads(text)
            except json.JSONDecodeError as error:
                raise UntieValueError(f"untie_when={rule!r} is not valid JSON ({error}).") from None
        else:
            return text
    if isinstance(rule, dict):
        return UntieWhen.coerce(rule)  # the JSON form of a rule: the rule itself
    if rule is None or isinstance(rule, UntieWhen):
        return rule
    raise UntieValueError(
        f"untie_when={rule!r}: pass 'divergence', a rule name from untie.RULES, a rule (untie.UntieWhen, its dict or "
        "JSON), or None."
    )


def _parse_pairs(pairs: Any) -> list[tuple[int, int]] | str | None:
    """None and "auto" stay; "none" is []; JSON text or a JSON file's path is read; every pair becomes (int, int)."""
    if isinstance(pairs, str):
        text = pairs.strip()
        if text in ("auto", ""):
            return "auto" if text else None
        if text.lower() == "none":
            return []
        if os.path.isfile(text):
            with open(text, encoding="utf-8") as file:
                text = file.read()
        try:
            pairs = json.loads(text)
        except json.JSONDecodeError:
            raise UntieValueError(
                f"pairs={pairs!r} is neither 'auto', 'none', a JSON list of id pairs ('[[12, 345], [67, 89]]') nor "
                "the path of a file holding one."
            ) from None
    if pairs is None:
        return None
    fix = "pass a list of (token_id, token_id) pairs of two different whole-number ids, e.g. [[12, 345], [67, 89]], or "
    fix += "'auto' (read from the tokenizer Trainer is given as processing_class)"
    if not isinstance(pairs, list | tuple):
        raise UntieValueError(f"pairs={pairs!r}: {fix}.")
    parsed = []
    for pair in pairs:
        if not isinstance(pair, list | tuple) or len(pair) != 2:
            raise UntieValueError(f"pairs: {pair!r} is not a pair of token ids; {fix}.")
        first, second = (_token_id(value, pair, fix) for value in pair)
        if first == second:
            raise UntieValueError(f"pairs: {pair!r} measures a symbol against itself; {fix}.")
        parsed.append((first, second))
    return parsed


def _token_id(value: Any, pair: Any, fix: str) -> int:
    """A token id: a whole number (int, numpy or torch integer), never a bool, a float or a string."""
    if isinstance(value, bool):
        raise UntieValueError(f"pairs: {pair!r} holds {value!r}, a bool, not a token id; {fix}.")
    try:
        index = operator.index(value)
    except TypeError:
        raise UntieValueError(f"pairs: {pair!r} holds {value!r}, not a whole-number token id; {fix}.") from None
    if index < 0:
        raise UntieValueError(f"pairs: {pair!r} holds a negative id; {fix}.")
    return index


def _warn_if_newer(written_by: str) -> None:
    def key(version: str) -> tuple[int, ...]:
        return tuple(int(part) for part in re.findall(r"\d+", version)[:3])

    if key(written_by) > key(__version__):
        warnings.warn(
            f"This UntieConfig was written by untie {written_by}, newer than this one ({__version__}): settings it "
            "adds are refused by name; upgrade untie to read them all.",
            stacklevel=3,
        )


# -- one description of every setting, for the docstring, help() and the command line ----------------------------------
def _attributes_section() -> str:
    doc = UntieConfig.__doc__ or ""
    return doc[doc.index("Attributes:") + len("Attributes:") :].rstrip() + "\n"


def _field_help() -> dict[str, str]:
    """Each field's text in `UntieConfig`'s Attributes section, joined into one line."""
    entries: dict[str, str] = {}
    name = None
    for line in _attributes_section().splitlines():
        match = re.match(r"^ {8}(\w+): (.*)$", line)
        if match:
            name = match.group(1)
            entries[name] = match.group(2)
        elif name and line.strip():
            entries[name] += " " + line.strip()
    return entries


def _attach_field_help() -> None:
    """Give each field the help text `HfArgumentParser` shows (`--help`), from the docstring: declared once. argparse
    %-formats help texts, so a literal ``%`` (``40%``) is doubled."""
    texts = _field_help()
    for config_field in fields(UntieConfig):
        if config_field.name not in texts:
            raise UntieRuntimeError(f"UntieConfig's docstring does not describe {config_field.name}.")
        config_field.metadata = MappingProxyType({"help": texts[config_field.name].replace("%", "%%")})


_attach_field_help()
