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
from typing import Any, Literal

from untie.signals.triggers import UntieWhen, pair_signal

#: Default deadline: untie after 30% of the run's optimizer steps unless the divergence trigger fires first. Tying
#: speeds up the start of training and the untie leaves 70% of the budget for the two spaces to separate.
DEFAULT_UNTIE_AT = 0.3
#: How the tied phase is implemented (see `UntieConfig.tying_mode`).
TYING_MODES = ("auto", "live", "emulated")
#: What the untied head's (and embedding's) optimizer state starts from (see `UntieConfig.optimizer_state`).
OPTIMIZER_STATES = ("copy", "reset", "fresh")
#: Which matrix a tie starts from (see `UntieConfig.tie_init`, `untie.tie_embeddings`).
TIE_INITS = ("input", "output", "mean")
TyingMode = Literal["auto", "live", "emulated"]
OptimizerStateInit = Literal["copy", "reset", "fresh"]
TieInit = Literal["input", "output", "mean"]
#: The untie policies (see `UntieConfig.policy`, `untie.core.policy`); kept here so that the config stays torch-free.
POLICIES = ("off", "auto", "fresh-untied")
PolicyName = Literal["off", "auto", "fresh-untied"]
#: The policy an unset `UntieConfig.policy` follows where the schedule is left at its defaults (`chosen_policy`):
#: validated on held-out cells of the decision map (docs/recipes/decision-map.md).
DEFAULT_POLICY = "fresh-untied"
#: The settings of a tied phase (its schedule, its trigger's measurements, its tying, the untie's optimizer state): set
#: any of them and an unset policy is "off", so the tied phase asked for runs.
TIED_PHASE_SETTINGS = ("untie_at", "untie_when", "metrics_every", "pairs", "optimizer_state", "tying_mode")
#: How a head untied before the first step starts (see `UntieConfig.head_init`).
HEAD_INITS = ("auto", "copy", "model")
HeadInit = Literal["auto", "copy", "model"]
#: The JSON key that records the library version a config was written by (`UntieConfig.to_json`).
VERSION_KEY = "untie_version"


@dataclass
class UntieConfig:
    """Every setting of a tie-then-untie run (`untie.UntieCallback`, `untie.Untier`).

    The defaults are the product's behaviour: train tied, untie when the divergence trigger fires, and at 30% of the
    run at the latest. A fixed schedule is ``untie_when=None`` with ``untie_at=<step or fraction>``; a tied baseline
    that still logs is ``untie_at=None, untie_when=None``. Every field parses from a command line
    (``HfArgumentParser((UntieConfig, TrainingArguments))``: ``--untie_at 500 --untie_when none --pairs auto``) and
    from JSON (`from_json`, `from_json_file`).

    Attributes:
        untie_at: The untie step at the latest. A whole number is a global optimizer step (0: before the first
            step; ``500`` and ``500.0`` are the same step), a number in (0, 1) a fraction of max_steps, None or
            ``inf`` (what a command line can say) no deadline. With untie_when=None it is a fixed schedule.
        untie_when: The divergence trigger: 'divergence' (the default rule: the evidence rule when pairs are
            measured, the pair-free rule otherwise), a rule name from untie.RULES ('evidence', 'gap',
            'cancellation', ...), a rule as JSON ('{"signal": "gap", "threshold": 0.3}') or an untie.UntieWhen, or
            'none' / None (untie at untie_at only). The model unties when it fires or at untie_at, whichever is first.
        metrics_every: Measure every this many optimizer steps: role signals while tied (they feed the trigger),
            drift between the two spaces after the untie, logged as untie/... 0 measures nothing (needs
            untie_when=None).
        pairs: Symbol pairs (token ids) known to be semantically equivalent, measured too. 'auto': the tokenizer's
            most frequent case and word-start variants (the/The, Ġthe/the, ▁the/the, the/##the), refused without a
            tokenizer; None (default): 'auto' when there is a tokenizer, else none; 'none' or []: none; a JSON list
            ('[[12, 345], [67, 89]]') or the path of a JSON file holding one; in Python a list of (id, id) pairs.
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
        head_init: How a head untied before the first step starts (untie_at=0, or a policy training untied from
            the start): 'copy' of the input embedding (lossless: a pretrained tied model keeps its trained output
            role), 'model' (drawn by the model's own initialiser, as a model built untied has it: for training from
            scratch, where a copied head trained worse on the decision map), or 'auto' (default): 'model' where a
            policy chose untied from the start for a freshly built model (its config names no checkpoint and its
            embedding looks freshly drawn: untie.core.policy.is_freshly_built), else 'copy'.
        policy: None (default): 'fresh-untied', unless a tied phase was asked for (a setting of
            `TIED_PHASE_SETTINGS`: untie_at, untie_when, metrics_every, pairs, optimizer_state, tying_mode, differs
            from its default): then 'off', and the schedule runs as set (`chosen_policy`). 'off' runs untie_at /
            untie_when as set. The others decide before the first step, for a model that arrives tied, and log the
            choice and why at train begin (kept in the run state).
            'fresh-untied': a freshly built model trains untied from the start whatever its share, its head drawn
            by its initialiser; a loaded one (by from_pretrained, or by hand: weights whose embedding does not look
            freshly drawn) runs untie_at / untie_when as set. Validated on held-out cells (docs/recipes/
            decision-map.md, "`fresh-untied` held out: the verdict"): on the decision map's corpus a tied phase cost
            more than it saved at every share and budget measured.
            'auto': where the input embedding is at least untie.core.policy.UNTIED_FROM_START_SHARE (0.5) of the
            parameters, train untied from the start (untie_at=0, no trigger; see head_init); below, untie_at /
            untie_when as set. Its held-out validation failed at d 128 x 8 (40% embedding), where the default
            schedule it keeps trailed untied training (docs/recipes/decision-map.md).
    """

    untie_at: float | None = DEFAULT_UNTIE_AT
    untie_when: dict | str | UntieWhen | None = "divergence"
    metrics_every: int = 50
    pairs: list[tuple[int, int]] | str | None = None
    optimizer_state: OptimizerStateInit = "copy"
    tie_init: TieInit | None = None
    tying_mode: TyingMode = "auto"
    save_at_untie: bool = True
    head_init: HeadInit = "auto"
    policy: PolicyName | None = None

    def __post_init__(self) -> None:
        self.metrics_every = _whole_number(self.metrics_every, "metrics_every", "0 turns the metrics off")
        self.pairs = _parse_pairs(self.pairs)
        self.untie_when = _parse_rule(self.untie_when)
        self.untie_at = _parse_untie_at(self.untie_at)
        _check_choice(self.tying_mode, TYING_MODES, "tying_mode")
        _check_choice(self.optimizer_state, OPTIMIZER_STATES, "optimizer_state")
        if self.policy is not None:
            _check_choice(
                self.policy, POLICIES, "policy", "or None (the default: 'fresh-untied' unless you set the schedule)"
            )
        _check_choice(self.head_init, HEAD_INITS, "head_init")
        if self.tie_init is not None:
            _check_choice(self.tie_init, TIE_INITS, "tie_init", "or None (keep it untied)")
        if not isinstance(self.save_at_untie, bool):
            raise ValueError(f"save_at_untie={self.save_at_untie!r}: pass True or False.")
        if self.head_init == "model" and self.untie_at != 0 and self.chosen_policy()[0] == "off":
            raise ValueError(
                f"head_init='model' draws a head untied before the first step, and untie_at={self.untie_at!r} unties "
                "later (a head drawn mid-run would drop what the tied phase trained): pass untie_at=0, or "
                "a policy ('auto', 'fresh-untied'), or leave head_init at 'auto'."
            )
        rule = self.rule(with_pairs=self.pairs != [])  # refuses an unknown name or a bad rule now
        if rule is not None and self.metrics_every == 0:
            raise ValueError(
                f"untie_when={self.untie_when!r} reads measurements, and metrics_every=0 takes none: set "
                "metrics_every > 0 (e.g. 50), or untie_when=None for a fixed schedule at untie_at."
            )
        per_pair = pair_signal(rule.signal) if rule is not None else None
        if rule is not None and per_pair is not None and not self.is_default_rule:
            wanted = per_pair[1]
            listed = self.pairs if isinstance(self.pairs, list) else None  # "auto": known once the tokenizer is read
            if self.pairs == [] or (wanted and listed and wanted not in {f"{a}-{b}" for a, b in listed}):
                raise ValueError(f"untie_when.signal={rule.signal!r} needs that pair in pairs=..., got {self.pairs}.")

    def chosen_policy(self) -> tuple[str, str]:
        """The policy the run follows, and why in words: `policy` as set; unset (None), "fresh-untied", or "off" where
        a schedule setting (`TIED_PHASE_SETTINGS`) differs from its default: a schedule set by hand runs as set."""
        if self.policy is not None:
            return self.policy, ""
        defaults = UntieConfig.__dataclass_fields__
        changed = [name for name in TIED_PHASE_SETTINGS if getattr(self, name) != defaults[name].default]
        if changed:
            settings = ", ".join(f"{name}={getattr(self, name)!r}" for name in changed)
            return "off", f"policy unset and the tied phase set ({settings}): it runs as set"
        return DEFAULT_POLICY, f"policy unset: the default, {DEFAULT_POLICY!r}"

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
            raise TypeError(
                f"Unknown untie settings {unknown}; the settings are the fields of UntieConfig: {sorted(known)}."
            )
        return type(self)(**{**self.to_dict(), **overrides})

    # -- JSON ----------------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The settings as plain values (a rule as its dict), keyword arguments of `UntieConfig` and the adapters."""
        return asdict(self)

    def to_json_dict(self) -> dict[str, Any]:
        """`to_dict` as a JSON round trip gives it (tuples become lists): what a checkpoint holds."""
        return json.loads(json.dumps(self.to_dict()))

    def to_json(self) -> str:
        """The settings as JSON, with the library version that wrote them (`untie_version`)."""
        from untie import __version__

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
            raise ValueError(f"Unknown UntieConfig keys {unknown}; known keys: {sorted(known)}.")
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
            raise ValueError(
                f"UntieConfig.from_json_file({os.fspath(path)!r}): the file is not valid JSON ({error}); it should "
                "hold one object of settings, as UntieConfig.to_json_file writes."
            ) from None
        if not isinstance(data, dict):
            raise ValueError(
                f"UntieConfig.from_json_file({os.fspath(path)!r}): the file holds {type(data).__name__} "
                f"{text.strip()[:40]!r}, not an object of settings such as UntieConfig.to_json_file writes."
            )
        return cls.from_dict(data)


def build_config(config: UntieConfig | None, overrides: dict[str, Any], owner: str) -> UntieConfig:
    """What the adapters run with: `config` (default `UntieConfig()`) with the keyword `overrides` applied."""
    if config is not None and not isinstance(config, UntieConfig):
        raise TypeError(
            f"{owner}(config={config!r}): config is an untie.UntieConfig; pass single settings by name instead, "
            f"e.g. {owner}(untie_at=500, untie_when=None)."
        )
    base = config if config is not None else UntieConfig()
    return base.replace(**overrides) if overrides else base


def settings_help() -> str:
    """Every setting and its meaning, as `UntieConfig`'s docstring lists them (for the adapters' `help()`)."""
    return "Settings (the fields of untie.UntieConfig, passed as config=... or by name):\n" + _attributes_section()


# -- parsing each field ------------------------------------------------------------------------------------------------
def _whole_number(value: Any, name: str, note: str) -> int:
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value) >= 0:
        return int(value)
    raise ValueError(f"{name}={value!r} must be an int >= 0 ({note}).")


def _check_choice(value: Any, choices: tuple[str, ...], name: str, extra: str = "") -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {choices}{' ' + extra if extra else ''}.")


def _parse_untie_at(at: Any) -> int | float | None:
    """None / inf: no deadline; a whole number: a step (int); a number in (0, 1): a fraction of the run (float)."""
    if at is None:
        return None
    if isinstance(at, bool) or not isinstance(at, numbers.Real):
        raise ValueError(f"untie_at={at!r}: pass a step (500), a fraction of the run in (0, 1) (0.3), or None / inf.")
    if isinstance(at, numbers.Integral):
        step = int(at)
    else:
        value = float(at)
        if math.isinf(value) and value > 0:
            return None
        if 0.0 < value < 1.0:
            return value
        if math.isnan(value) or not value.is_integer():
            raise ValueError(
                f"untie_at={at} is neither a whole step nor a fraction in (0, 1): numbers >= 1 are optimizer steps "
                "(e.g. 500), numbers in (0, 1) fractions of max_steps (e.g. 0.3)."
            )
        step = int(value)
    if step < 0:
        raise ValueError(f"untie_at={at} is negative: pass a global step >= 0 or a fraction in (0, 1).")
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
                raise ValueError(f"untie_when={rule!r} is not valid JSON ({error}).") from None
        else:
            return text
    if isinstance(rule, dict):
        return UntieWhen.coerce(rule)  # the JSON form of a rule: the rule itself
    if rule is None or isinstance(rule, UntieWhen):
        return rule
    raise ValueError(
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
            raise ValueError(
                f"pairs={pairs!r} is neither 'auto', 'none', a JSON list of id pairs ('[[12, 345], [67, 89]]') nor "
                "the path of a file holding one."
            ) from None
    if pairs is None:
        return None
    fix = "pass a list of (token_id, token_id) pairs of two different whole-number ids, e.g. [[12, 345], [67, 89]], or "
    fix += "'auto' (read from the tokenizer Trainer is given as processing_class)"
    if not isinstance(pairs, list | tuple):
        raise ValueError(f"pairs={pairs!r}: {fix}.")
    parsed = []
    for pair in pairs:
        if not isinstance(pair, list | tuple) or len(pair) != 2:
            raise ValueError(f"pairs: {pair!r} is not a pair of token ids; {fix}.")
        first, second = (_token_id(value, pair, fix) for value in pair)
        if first == second:
            raise ValueError(f"pairs: {pair!r} measures a symbol against itself; {fix}.")
        parsed.append((first, second))
    return parsed


def _token_id(value: Any, pair: Any, fix: str) -> int:
    """A token id: a whole number (int, numpy or torch integer), never a bool, a float or a string."""
    if isinstance(value, bool):
        raise ValueError(f"pairs: {pair!r} holds {value!r}, a bool, not a token id; {fix}.")
    try:
        index = operator.index(value)
    except TypeError:
        raise ValueError(f"pairs: {pair!r} holds {value!r}, not a whole-number token id; {fix}.") from None
    if index < 0:
        raise ValueError(f"pairs: {pair!r} holds a negative id; {fix}.")
    return index


def _warn_if_newer(written_by: str) -> None:
    from untie import __version__

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
            raise RuntimeError(f"UntieConfig's docstring does not describe {config_field.name}.")
        config_field.metadata = MappingProxyType({"help": texts[config_field.name].replace("%", "%%")})


_attach_field_help()
