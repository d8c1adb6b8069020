"""What the recipes share: the command line, the settings every run starts from, and the untie in a run's record.

Each Trainer recipe parses three dataclasses with one `HfArgumentParser`: its own arguments (the grid, the preset,
the data), `untie.UntieConfig` (the untie settings the arms start from) and `transformers.TrainingArguments` (every
Trainer flag: `--report_to wandb`, `--bf16`, `--logging_steps 10`, ...). One convention holds across them:

* a preset fills what the command line did not set, in any of the three (`explicit_flags` tells which were set);
* lists are space-separated values of one flag: ``--arms tied auto --seeds 42 43``;
* a yes/no flag alone means yes, Trainer's optional ones too (``--disable_tqdm``, ``--bf16``), as ours;
* an arm's untie settings are the parsed `UntieConfig` with the arm's schedule over it (`arm_config`).
"""

from __future__ import annotations

import dataclasses
import sys
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import transformers as tf

import untie
from untie.decision.settings import parse_command_line

_UNSET = object()


def parse(types: Sequence[type], argv: list[str] | None) -> tuple[list[Any], set[str]]:
    """The dataclasses of `types` parsed from `argv` (default: the process's arguments), and the names of the fields
    the command line set (whatever their value, the default included)."""
    argv = _bare_flags_mean_yes(types, sys.argv[1:] if argv is None else list(argv))
    parsed = parse_command_line(types, args=argv)  # a bad value: one line naming the setting, exit status 2
    return list(parsed), explicit_flags(types, argv)


def _bare_flags_mean_yes(types: Sequence[type], argv: list[str]) -> list[str]:
    """``--flag`` alone for a `bool | None` field (HfArgumentParser wants a value there) becomes ``--flag true``."""
    optional_bools = {
        f"--{name}"
        for t in types
        for name, hint in typing.get_type_hints(t).items()
        if set(typing.get_args(hint)) == {bool, type(None)}
    }
    optional_bools |= {flag.replace("_", "-") for flag in optional_bools}
    out: list[str] = []
    for index, token in enumerate(argv):
        out.append(token)
        following = argv[index + 1] if index + 1 < len(argv) else None
        if token in optional_bools and (following is None or following.startswith("--")):
            out.append("true")
    return out


def explicit_flags(types: Sequence[type], argv: list[str] | None) -> set[str]:
    """The fields of `types` the command line sets: parsed again with every default replaced by a marker."""
    probe = tf.HfArgumentParser(types)
    probe.set_defaults(**{f.name: _UNSET for t in types for f in dataclasses.fields(t) if f.init})
    namespace = probe.parse_args(args=argv)
    return {name for name, value in vars(namespace).items() if value is not _UNSET}


def fill(instance: Any, preset: dict[str, Any], explicit: set[str]) -> Any:
    """`instance` with the preset's values for its fields that the command line did not set."""
    names = {f.name for f in dataclasses.fields(instance) if f.init}
    values = {k: v for k, v in preset.items() if k in names and k not in explicit}
    if not values:
        return instance
    if isinstance(instance, untie.UntieConfig):  # a setting not given stays so (dataclasses.replace gives them all)
        return instance.replace(**values)
    return dataclasses.replace(instance, **values)


#: The arms every Trainer recipe knows, and the untie schedule each one trains with. Every arm with a callback runs
#: its schedule as set (policy "off"): the recipes compare schedules, and the default policy would train untied.
ARM_SCHEDULES = {
    "untied": None,  # no callback: the model is untied from the start
    "tied": {"untie_at": None, "untie_when": None, "policy": "off"},  # a tied baseline that still measures
    "scheduled": {"untie_when": None, "policy": "off"},  # untie at untie_at
    "scheduled-reset": {"untie_when": None, "optimizer_state": "reset", "policy": "off"},
    "auto": {"policy": "off"},  # the divergence trigger (untie_when), with the recipe's deadline
}


def arm_config(arm: str, config: untie.UntieConfig, **recipe: Any) -> untie.UntieConfig | None:
    """The untie settings of `arm`: the parsed `config` with the arm's schedule, then the recipe's `recipe` settings
    (its pairs, its auto arm's deadline), over it; None for the untied arm (no callback)."""
    if arm not in ARM_SCHEDULES:
        raise ValueError(f"Unknown arm {arm!r}; choose from {tuple(ARM_SCHEDULES)}.")
    schedule = ARM_SCHEDULES[arm]
    if schedule is None:
        return None
    return config.replace(**{**recipe, **schedule})


def training_arguments(base: tf.TrainingArguments, **run: Any) -> tf.TrainingArguments:
    """One run's TrainingArguments: the parsed ones (every Trainer flag) with the run's own values over them."""
    return dataclasses.replace(base, **run)


@dataclass(frozen=True)
class RecipeSetup:
    """Everything a Trainer recipe's runs start from: its own arguments, the untie settings, Trainer's arguments."""

    args: Any
    untie: untie.UntieConfig
    training: tf.TrainingArguments

    @property
    def output_dir(self) -> str:
        return str(self.training.output_dir)


def untie_outcome(trainer: tf.Trainer, callback: untie.UntieCallback | None) -> dict[str, Any]:
    """The untie in a run's record: the steps run, when and why the model untied, when the trigger fired."""
    trigger = callback.divergence if callback else None
    return {
        "steps": trainer.state.global_step,
        "untie_step": callback.untie_step if callback else None,
        "untie_reason": callback.untie_reason if callback else None,
        "trigger_step": trigger.fired_step if trigger else None,
    }


def token_mean_loss(logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
    """Cross-entropy over the labelled positions (label != -100) of `logits` (N, V) and `labels` (N,), as a recipe's
    model returns it to Trainer.

    A model whose `forward` takes ``**kwargs`` tells Trainer that it honours ``num_items_in_batch`` (the labelled
    positions of the whole step: every process, every accumulated batch); Trainer then multiplies the loss by the
    number of processes and does not divide it by the accumulation steps. So with ``num_items_in_batch`` the loss is
    this batch's sum over it, written as the batch mean times (this batch's count / ``num_items_in_batch``): the same
    value, and exactly the batch mean, to the bit, where the batch is the whole step (one process, no accumulation).
    Without it: the batch mean."""
    loss = F.cross_entropy(logits, labels, ignore_index=-100)
    if num_items_in_batch is None:
        return loss
    return loss * ((labels != -100).sum() / num_items_in_batch)
