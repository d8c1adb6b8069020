"""Checkpoint awareness: make a model's tied/untied structure match the checkpoint it is about to load."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import torch
from torch import nn

from untie import _compat
from untie.checkpoints.loading import CheckpointError, folder_weight_map, stored_name
from untie.checkpoints.saved_state import ADAPTER_WEIGHT_PREFIXES, MODEL_WEIGHT_PREFIXES
from untie.decision.plan import ModelFacts, RunSettings, SavedFacts, plan_structure, saved_policy_phase
from untie.errors import UntieValueError
from untie.structure.surgery import UNTIED_MARKER, embedding_layout, is_tied, tie_embeddings, untie_embeddings

logger = logging.getLogger(__name__)

#: The attribute of UntieCallback's entry in `trainer_state.json` that holds the run state (`UntieRun.state_dict`).
#: Trainer files a callback's state under its class name, so a subclass's state is found by this key, not the name.
STATE_KEY = "untie_state"
_GUARD_ATTR = "_untie_resume_guard"


def saved_callback_state(stateful_callbacks: dict | None) -> dict:
    """UntieCallback's saved run state (`UntieRun.state_dict` layout) among a TrainerState's `stateful_callbacks`
    ({} if absent), found under any class name (a subclass of UntieCallback is filed under its own)."""
    for state in (stateful_callbacks or {}).values():
        if isinstance(state, list):  # Trainer stores a list when several instances of a callback exist
            state = state[-1] if state else None
        run_state = state.get("attributes", {}).get(STATE_KEY) if isinstance(state, dict) else None
        if isinstance(run_state, dict):
            return run_state
    return {}


def checkpoint_is_untied(checkpoint_dir: str | os.PathLike) -> bool | None:
    """Whether a checkpoint folder holds an untied model: True, False, or None when it does not say.

    Reads, in order: the UntieCallback state in `trainer_state.json`, the untie marker in `config.json`, and the
    `tie_word_embeddings` flag (only where the config has no marker; T5/BART keep that flag True even untied).
    """
    state_file = os.path.join(checkpoint_dir, "trainer_state.json")
    if os.path.isfile(state_file):
        with open(state_file) as f:
            attributes = saved_callback_state(json.load(f).get("stateful_callbacks")).get("attributes")
        if isinstance(attributes, dict) and "untied" in attributes:
            return bool(attributes["untied"])
    config_file = os.path.join(checkpoint_dir, "config.json")
    if os.path.isfile(config_file):
        with open(config_file) as f:
            config = json.load(f)
        if config.get(UNTIED_MARKER):
            return True
        text = config.get("text_config") or {}
        if config.get("tie_word_embeddings") is False or text.get("tie_word_embeddings") is False:
            return True
        if "tie_word_embeddings" in config:
            return False
    return None


def check_complete(folder: str | os.PathLike) -> dict[str, str] | None:
    """Raise a `ValueError` naming what is missing when `folder` is not a whole Trainer checkpoint; return its
    safetensors weight map (None in other formats).

    A run killed while saving leaves a `checkpoint-N` without `trainer_state.json` (Trainer writes it last) or
    without weights, and Trainer's `resume_from_checkpoint=True` picks the newest folder whatever its state.
    """
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise UntieValueError(f"resume_from_checkpoint={folder!r}: no such folder.")
    names = os.listdir(folder)
    missing, keys = [], None
    if "trainer_state.json" not in names:
        missing.append("trainer_state.json")
    deepspeed_tag = _deepspeed_tag(folder)
    if deepspeed_tag is not None and not os.path.isdir(os.path.join(folder, deepspeed_tag)):
        missing.append(f"DeepSpeed's {deepspeed_tag}/ folder, which its `latest` file names")
    if not any(name.startswith(MODEL_WEIGHT_PREFIXES + ADAPTER_WEIGHT_PREFIXES) for name in names):
        if deepspeed_tag is None:
            missing.append("the model weights (model.safetensors or its shards)")
        # else a ZeRO-3 checkpoint without stage3_gather_16bit_weights_on_model_save: DeepSpeed's folder only
    else:
        try:
            keys = folder_weight_map(folder)
        except CheckpointError as error:
            missing.append(f"its weights cannot be read ({error})")
    if missing:
        parent = os.path.dirname(os.path.abspath(folder))
        raise UntieValueError(
            f"The checkpoint {folder} is incomplete: {'; '.join(missing)} (a run stopped while saving it?). Move it "
            f"out of {parent} or delete it, then resume again (resume_from_checkpoint=True takes the newest "
            "checkpoint-* folder), or pass the previous complete checkpoint-* folder explicitly."
        )
    return keys


def _deepspeed_tag(folder: str) -> str | None:
    """The tag DeepSpeed's `latest` file in `folder` names (its `global_stepN` folder), None without one."""
    path = os.path.join(folder, "latest")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return f.read().strip() or None


def read_saved_run(folder: str | os.PathLike, model: nn.Module | None) -> SavedFacts:
    """Check that `folder` is complete (`check_complete`) and read the tying state of the run saved there; whether
    the LM head is stored is looked up with `model`'s head name (None without a model)."""
    folder = os.fspath(folder)
    keys = check_complete(folder)
    head_stored = None
    if keys is not None and model is not None:
        head_stored = stored_name(model, embedding_layout(model).output_weight, keys) is not None
    attributes = _saved_attributes(folder)
    return SavedFacts(
        folder, checkpoint_is_untied(folder), head_stored, _lr_groups(attributes), saved_policy_phase(attributes)
    )


def _saved_attributes(checkpoint_dir: str | os.PathLike) -> Any:
    """The run state's attributes in a Trainer checkpoint (`UntieRun.state_attributes`); None where there are none."""
    state_file = os.path.join(checkpoint_dir, "trainer_state.json")
    if not os.path.isfile(state_file):
        return None
    with open(state_file) as f:
        return saved_callback_state(json.load(f).get("stateful_callbacks")).get("attributes")


def saved_lr_groups(checkpoint_dir: str | os.PathLike) -> tuple[str, ...] | None:
    """The roles with a learning-rate group of their own in a Trainer checkpoint's optimizer state (the run state's
    `lr_groups`), or None where the folder holds no run state that says."""
    return _lr_groups(_saved_attributes(checkpoint_dir))


def _lr_groups(attributes: Any) -> tuple[str, ...] | None:
    groups = attributes.get("lr_groups") if isinstance(attributes, dict) else None
    return tuple(groups) if isinstance(groups, list) else None


def prepare_for_resume(model: nn.Module, checkpoint_dir: str | os.PathLike) -> nn.Module:
    """Give `model` the tied/untied structure of `checkpoint_dir` before its weights and optimizer are loaded.

    Call it before `trainer.train(resume_from_checkpoint=checkpoint_dir)` when the Trainer has no `UntieCallback`
    (which does this by itself), or before loading a checkpoint's state dict in your own loop.
    """
    untied = checkpoint_is_untied(checkpoint_dir)
    if untied is None:
        raise UntieValueError(
            f"{checkpoint_dir} does not say whether its model is tied (no trainer_state.json with UntieCallback state "
            "and no config.json). Pass the checkpoint folder written by Trainer or save_pretrained."
        )
    tied = is_tied(model)
    saved = SavedFacts(os.fspath(checkpoint_dir), untied, head_stored=False)
    plan = plan_structure(ModelFacts("tied" if tied else "untied"), RunSettings("prepare_for_resume"), saved)
    if plan.target == "untied" and tied:
        untie_embeddings(model)
    elif plan.target == "tied" and not tied:
        tie_embeddings(model, init=plan.tie_init)
    return model


def install_resume_guard(model: nn.Module) -> None:
    """Make `model.load_state_dict` adapt the model to the checkpoint's structure first (idempotent).

    Trainer loads a resumed checkpoint with `model.load_state_dict(sd, strict=False)` before any callback event;
    into a still-tied model an untied checkpoint would silently overwrite the embedding with the head (both keys
    land in one shared parameter) and then fail on the optimizer state. With the guard:
    - an untied checkpoint (a separate LM-head tensor) into a tied model unties the model first; a state dict that
      lists the shared matrix under both names (`model.state_dict()` of a tied model) loads tied;
    - a complete tied checkpoint (no LM-head key) into an untied model gives the head a copy of the shared matrix,
      instead of keeping the head's current values next to an old embedding (`load_best_model_at_end`).
    """
    if not has_resume_guard(model):
        setattr(model, _GUARD_ATTR, resume_guard_hook(model))


def has_resume_guard(model: nn.Module) -> bool:
    """Whether `install_resume_guard` guards `model` (for good: a run's own guard comes off when the run closes)."""
    return getattr(model, _GUARD_ATTR, None) is not None


def resume_guard_hook(model: nn.Module):
    """Install the guard `install_resume_guard` describes and return its handle (`remove()` takes it off): a run
    installs it this way, through its registry, for the run's length only."""
    return model.register_load_state_dict_pre_hook(_match_structure_to_state_dict)


def _same_matrix(state_dict: dict, layout) -> bool:
    """Whether a state dict's head is its embedding's tensor: `model.state_dict()` of a tied model (and `torch.save`
    / `copy.deepcopy` of it) lists the one shared tensor under both names, where safetensors keeps one name. Equal
    values do not count: a checkpoint saved at the untie step holds an untied head equal to the embedding."""
    head, embedding = state_dict[layout.output_weight], state_dict.get(layout.input_weight)
    if embedding is None or not torch.is_tensor(head) or not torch.is_tensor(embedding):
        return False
    return head is embedding or (head.device.type != "meta" and head.data_ptr() == embedding.data_ptr())


def _match_structure_to_state_dict(module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    if prefix:  # only when the guarded model itself is the one being loaded
        return
    layout = embedding_layout(module)
    if is_tied(module):
        if layout.output_weight in state_dict and not _same_matrix(state_dict, layout):
            logger.warning("untie: the checkpoint being loaded has an untied LM head; untying the model first.")
            untie_embeddings(module)
        return
    if layout.output_weight in state_dict or layout.input_weight not in state_dict:
        return
    tie_targets = _compat.expanded_tied_keys(module)
    head_keys = {layout.output_weight, layout.output_bias, *layout.bias_aliases}
    expected = set(module.state_dict()) - head_keys - tie_targets
    if not expected <= set(state_dict):
        return  # one shard of a sharded checkpoint: the head may be in another shard
    _compat.warn_in_user_code(
        "untie: loading a tied checkpoint into an untied model; the LM head gets a copy of the checkpoint's shared "
        "matrix (the model stays untied)."
    )
    state_dict[layout.output_weight] = state_dict[layout.input_weight].clone()
    if layout.output_bias is not None and layout.output_bias not in state_dict:
        source = next((a for a in layout.bias_aliases if a in state_dict), None)
        if source is not None:
            state_dict[layout.output_bias] = torch.as_tensor(state_dict[source]).clone()
