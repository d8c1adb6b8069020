"""The run state both adapters save (`untie.core.run.UntieRun.state_dict`: `Untier.state_dict()` and `untie_state.json`
in a custom loop, UntieCallback's entry in `trainer_state.json` under Trainer): its check, and the weights it
belongs to.

One layout, versioned by ``"format"``::

    {"format": 3, "adapter": "Untier" | "UntieCallback", "global_step": int, "tying_mode": "live" | "emulated",
     "config": UntieConfig as JSON, "attributes": {"untied", "untie_step", "untie_reason", "trigger_state",
     "history"}, "weights": fingerprint | null}

A resumed run trusts this state to decide the model's structure (tied or untied) and its untie step, so a state
from another step or run, next to weights it was not saved with, would resume silently into a different run. The
state therefore records a fingerprint of the weights it was saved with (whether the LM head is its own tensor, the
embedding's and the head's shapes, dtypes and a digest of their bytes), and a resume compares it with the weights it
loads: in `accelerator.load_state`, against the weight file in the folder before anything loads; in a plain loop,
against the model's parameters before the first optimizer step after `Untier.load_state_dict`. Trainer checkpoints
carry no fingerprint (``"weights": null``): Trainer writes `trainer_state.json` last, next to the weights of the same
save, and `untie.checkpoints.checkpoint.check_complete` refuses a folder without it.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from untie.decision.settings import TRACKED_SETTINGS, UntieConfig
from untie.distributed import full_shape, is_sharded
from untie.errors import UntieError, UntieFileNotFoundError
from untie.structure.surgery import embedding_layout, input_weight, is_tied, output_weight

#: Version of the run state's layout (`UntieRun.state_dict()`); 3 is the first shared by both adapters.
STATE_FORMAT = 3
#: The adapters whose states may omit the weights' fingerprint (their framework saves a folder as a whole).
_FINGERPRINT_OPTIONAL = ("UntieCallback",)
#: The file `accelerator.save_state` folders get the untie state in, written once everything else is on disk.
STATE_FILE = "untie_state.json"
#: Weight files accelerate writes for its first model (safetensors or pickle); FSDP writes folders starting so.
_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
#: What the model weights of a checkpoint folder are named from (the one list: accelerate's and Trainer's folders).
#: A full model: one file or shards, safetensors or pickle, or FSDP's sharded `pytorch_model_fsdp_*` folder.
MODEL_WEIGHT_PREFIXES = ("model", "pytorch_model")
#: Trainer's checkpoint of a PEFT model holds the adapter instead (accelerate's `save_state` saves the whole model).
ADAPTER_WEIGHT_PREFIXES = ("adapter_model",)
#: Elements hashed per chunk: bounds the host copy of a GPU tensor.
_CHUNK = 1 << 24
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class UntieStateError(UntieError, ValueError):
    """An untie state that cannot be used: damaged, of an unknown format, or not saved with the weights beside it."""


def resumed_config(config: UntieConfig, saved_config: Mapping[str, Any]) -> UntieConfig:
    """The settings a resume runs with: `config`, where each tracked setting the user left unset (`TRACKED_SETTINGS`:
    the schedule's, and the input embedding's rate scale) takes the value the checkpoint's run set (`saved_config`, its
    JSON), and so does the policy where the user left it unset and the checkpoint's run set one. A setting the user set
    wins (the run says what changed); one the checkpoint left unset stays unset. A plan the policy chose itself is
    written into the checkpoint's settings (`untie.decision.decide.checkpoint_config`)."""
    unset = [name for name in TRACKED_SETTINGS if not config.was_set(name)]
    taken = {name: saved_config[name] for name in unset if name in saved_config}
    if config.policy is None and saved_config.get("policy") is not None:
        taken["policy"] = saved_config["policy"]  # a policy the checkpoint's run set ("off": its schedule) goes on
    return config.continuing(taken) if taken else config


# -- the weights' fingerprint ------------------------------------------------------------------------------------------
def run_state(
    adapter: str, step: int, tying_mode: str | None, config: dict, attributes: dict, weights: dict | None
) -> dict[str, Any]:
    """A run state in the layout both adapters save (`check_state` reads it back): the adapter's name, the global
    step, the tying mode, the settings (JSON), the run's attributes and the weights' fingerprint (`weights`; None where
    the framework saves a folder as a whole)."""
    return {
        "format": STATE_FORMAT,
        "adapter": adapter,
        "global_step": step,
        "tying_mode": tying_mode,
        "config": config,
        "attributes": attributes,
        "weights": weights,
    }


def tensor_digest(tensor: torch.Tensor) -> str:
    """A digest of a tensor's bytes (SHA-256, hardware-accelerated on current CPUs), equal for equal bytes on any
    device; read in bounded chunks."""
    flat = tensor.detach().reshape(-1)
    flat = flat.view(_SAME_SIZE_INT[flat.element_size()])  # numpy has no bfloat16: hash the raw bits
    digest = hashlib.sha256()
    for start in range(0, flat.numel(), _CHUNK):
        digest.update(flat[start : start + _CHUNK].cpu().numpy().data)
    return digest.hexdigest()


def _describe(tensor: torch.Tensor) -> dict[str, Any]:
    sharded = is_sharded(tensor)
    return {
        "shape": list(full_shape(tensor)),
        "dtype": str(tensor.dtype).removeprefix("torch."),
        "digest": None if sharded else tensor_digest(tensor),  # a shard's bytes depend on the world size
    }


def weights_fingerprint(model: nn.Module) -> dict[str, Any]:
    """What identifies the model's embedding weights: whether the LM head is its own tensor, and the embedding's and
    the head's shapes, dtypes and digests (no digest for sharded parameters)."""
    embedding = input_weight(model)
    separate = not is_tied(model)
    return {
        "separate_head": separate,
        "embedding": _describe(embedding),
        "head": _describe(output_weight(model)) if separate else None,
    }


def stored_fingerprint(folder: str, model: nn.Module, index: int = 0) -> dict[str, Any] | None:
    """`weights_fingerprint` of the weights accelerate saved in `folder` for its `index`-th model, read from the file
    (only the two tensors); None where the weights are not in one file (FSDP's sharded folder)."""
    path = _weight_file(folder, index)
    if path is None:
        return None
    layout = embedding_layout(model)
    if path.endswith(".safetensors"):
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            keys = list(f.keys())
            names = [_find_key(keys, layout.input_weight), _find_key(keys, layout.output_weight)]
            tensors = [None if name is None else f.get_tensor(name) for name in names]
    else:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        names = [_find_key(list(state), layout.input_weight), _find_key(list(state), layout.output_weight)]
        tensors = [None if name is None else state[name] for name in names]
        first, second = tensors
        if first is not None and second is not None and first.data_ptr() == second.data_ptr():
            tensors[1] = None  # torch.save keeps a tied model's shared matrix once, under both names
    embedding, head = tensors
    if embedding is None:
        embedding, head = head, None  # a tied model's shared matrix saved under the head's name only
    if embedding is None:
        raise UntieStateError(
            f"{path} holds no tensor named {layout.input_weight} or {layout.output_weight}: these weights are not "
            "this model's. Resume from a folder that accelerator.save_state wrote for this model."
        )
    return {
        "separate_head": head is not None,
        "embedding": _describe(embedding),
        "head": None if head is None else _describe(head),
    }


def _weight_file(folder: str, index: int) -> str | None:
    for name in _WEIGHT_FILES:
        if index:
            name = name.replace(".", f"_{index}.")
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            return path
    return None


def _find_key(keys: list[str], name: str) -> str | None:
    """The saved key of parameter `name`: itself, or under a wrapper's prefix (DDP's `module.`, `_orig_mod.`)."""
    return next((key for key in keys if key == name or key.endswith("." + name)), None)


def fingerprint_difference(saved: Mapping[str, Any], actual: Mapping[str, Any]) -> str | None:
    """How the weights (`actual`) differ from those the state was saved with (`saved`), in words; None if they match.

    A digest is compared only where both sides have one (sharded parameters have none)."""
    if saved["separate_head"] != actual["separate_head"]:
        said = "its own tensor (untied or emulated tying)" if saved["separate_head"] else "the embedding (tied)"
        found = "its own tensor" if actual["separate_head"] else "shared with the embedding"
        return f"the untie state was saved with an LM head that is {said}, but the weights' head is {found}"
    for role in ("embedding", "head"):
        was, now = saved[role], actual[role]
        if was is None:
            continue
        if (was["shape"], was["dtype"]) != (now["shape"], now["dtype"]):
            return (
                f"the untie state was saved with a {role} of shape {tuple(was['shape'])} ({was['dtype']}), but the "
                f"weights' {role} is {tuple(now['shape'])} ({now['dtype']})"
            )
        if was["digest"] and now["digest"] and was["digest"] != now["digest"]:
            return f"the weights' {role} is not the one the untie state was saved with (its values differ)"
    return None


# -- the state's check -------------------------------------------------------------------------------------------------
def check_state(state: Any, where: str) -> dict[str, Any]:
    """Return `state` if it has the layout `UntieRun.state_dict()` writes, else raise `UntieStateError` naming `where`
    (the file, or "the state given to Untier.load_state_dict") and what is wrong with it."""

    def damaged(what: str) -> UntieStateError:
        return _damaged(where, what)

    if not isinstance(state, dict):
        raise damaged(f"it holds a JSON {type(state).__name__}, not an object")
    if state.get("format") != STATE_FORMAT:
        raise UntieStateError(
            f"{where} has untie state format {state.get('format')!r}; this version of untie reads format "
            f"{STATE_FORMAT}. Resume with the untie version that wrote it, or start the run again."
        )
    expected = {"global_step": int, "attributes": dict, "config": dict, "weights": dict}
    for key, kind in expected.items():
        if key not in state:
            raise damaged(f"the key {key!r} is missing")
        value = state[key]
        if key == "weights" and value is None and state.get("adapter") in _FINGERPRINT_OPTIONAL:
            continue
        if not isinstance(value, kind) or isinstance(value, bool):
            raise damaged(f"{key!r} is {value!r}, not {'an int' if kind is int else 'an object'}")
    if state["global_step"] < 0:
        raise damaged(f"'global_step' is {state['global_step']}, below 0")
    attributes = state["attributes"]
    if not isinstance(attributes.get("untied"), bool):
        raise damaged(f"'attributes.untied' is {attributes.get('untied')!r}, not true or false")
    step = attributes.get("untie_step")
    if attributes["untied"] and not (isinstance(step, int) and 0 <= step <= state["global_step"]):
        raise damaged(f"'attributes.untie_step' is {step!r}, not a step between 0 and {state['global_step']}")
    if not isinstance(attributes.get("history", []), list):
        raise damaged("'attributes.history' is not a list")
    if state.get("tying_mode") not in (None, "live", "emulated"):
        raise damaged(f"'tying_mode' is {state.get('tying_mode')!r}, not 'live' or 'emulated'")
    if state["weights"] is not None:
        _check_fingerprint(state["weights"], damaged)
    return state


def _check_fingerprint(weights: dict, damaged) -> None:
    if not isinstance(weights.get("separate_head"), bool):
        raise damaged("'weights.separate_head' is not true or false")
    for role in ("embedding", "head"):
        entry = weights.get(role)
        if entry is None and role == "head" and not weights["separate_head"]:
            continue
        ok = isinstance(entry, dict) and isinstance(entry.get("shape"), list) and isinstance(entry.get("dtype"), str)
        if not ok or not isinstance(entry and entry.get("digest"), (str, type(None))):
            raise damaged(f"'weights.{role}' is {entry!r}, not its shape, dtype and digest")


# -- the file ----------------------------------------------------------------------------------------------------------
def read_state_file(folder: str) -> dict[str, Any]:
    """The checked untie state of an `accelerator.save_state` folder; errors name the folder and the fix."""
    path = os.path.join(folder, STATE_FILE)
    if not os.path.isfile(path):
        if has_weights(folder):
            raise UntieFileNotFoundError(
                f"Untier: {folder} has model weights but no {STATE_FILE}. The Untier writes that file last, once "
                "accelerator.save_state has written everything else, so either the save into this folder did not "
                "finish (a run stopped while saving: resume from the previous complete folder) or the folder was "
                "not saved with an Untier (create it with accelerator=accelerator before saving, or load this "
                "folder without the Untier)."
            )
        raise UntieFileNotFoundError(
            f"Untier: {folder} has neither model weights nor {STATE_FILE}, so it is not a complete "
            "accelerator.save_state folder of an Untier run (a save that stopped early, or the wrong folder). Resume "
            "from a folder that accelerator.save_state wrote with this Untier created with accelerator=accelerator."
        )
    try:
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise _damaged(path, f"it is not valid JSON ({error})") from error
    return check_state(state, path)


def _damaged(where: str, what: str) -> UntieStateError:
    return UntieStateError(
        f"{where} is damaged: {what}. It must be what Untier.state_dict() (or UntieCallback, in trainer_state.json) "
        f"wrote (format {STATE_FORMAT}), saved with the weights beside it: resume from an earlier complete "
        "checkpoint, or from the run's last good save."
    )


def has_weights(folder: str) -> bool:
    """Whether an accelerate checkpoint folder holds model weights (a file, or FSDP's sharded folder)."""
    return any(name.startswith(MODEL_WEIGHT_PREFIXES) for name in os.listdir(folder))


def write_state_file(folder: str, state: dict[str, Any]) -> None:
    """Write the untie state atomically: a kill leaves the old file or the new one, never half of it."""
    path = os.path.join(folder, STATE_FILE)
    partial = f"{path}.partial"
    with open(partial, "w", encoding="utf-8") as f:
        json.dump(state, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)


def remove_state_file(folder: str) -> None:
    """Delete a folder's untie state before a save overwrites the folder: until the new one is written last, the
    folder reads as incomplete instead of pairing the old state with new weights."""
    for name in (STATE_FILE, f"{STATE_FILE}.partial"):
        path = os.path.join(folder, name)
        if os.path.lexists(path):
            os.remove(path)
