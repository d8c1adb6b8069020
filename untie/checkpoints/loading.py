"""Open a checkpoint (a folder or a hub id) for inspection or conversion: config, LM-head class, single tensors.

Reading only the two embedding tensors from the safetensors files, on a model built on the meta device, is what
keeps `untie inspect` fast on a 256k-vocabulary checkpoint: nothing else is loaded or allocated.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Any, cast

import torch
import transformers as tf
from safetensors import SafetensorError, safe_open
from torch import nn

from untie import _compat
from untie.errors import UntieError, UntieValueError

#: `--head` choices: the Auto class used to load a checkpoint with a language-modeling head.
HEADS = {
    "causal-lm": tf.AutoModelForCausalLM,
    "masked-lm": tf.AutoModelForMaskedLM,
    "seq2seq-lm": tf.AutoModelForSeq2SeqLM,
}
_HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")
_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
#: Weight files from_pretrained reads besides safetensors (checked for presence only).
_OTHER_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")


class CheckpointError(UntieError):
    """A checkpoint the command line cannot use; `exit_code` is what `untie` exits with."""

    exit_code = 1


class CheckpointNotFound(CheckpointError):
    exit_code = 3


class NoEmbeddings(CheckpointError):
    """The model has no LM head (or no input embedding) to tie or untie."""

    exit_code = 4


class CheckpointUnreadable(CheckpointError):
    """The checkpoint is incomplete or damaged: no weights, a missing or truncated file, a stale index, bad JSON."""

    exit_code = 6


class HeadNotStored(CheckpointError):
    """An untied checkpoint that does not store its LM head: `from_pretrained` initialises it randomly."""

    exit_code = 6


class OutputNotWritable(CheckpointError):
    """OUT cannot be written: read-only, the disk is full, or a file stands where a folder must be."""

    exit_code = 7


class RemoteCodeRefused(CheckpointError):
    """The checkpoint ships its own modelling code (`auto_map`), which untie does not run."""

    exit_code = 8


@dataclass
class Checkpoint:
    """A resolved checkpoint: where it is, its config, and the class that loads it with its LM head."""

    source: str
    config: tf.PretrainedConfig
    model_class: type[tf.PreTrainedModel]
    revision: str | None = None

    @property
    def is_local(self) -> bool:
        return os.path.isdir(self.source)

    def file(self, name: str) -> str | None:
        """Local path of one file of the checkpoint (downloaded for hub ids), or None if it has no such file."""
        if self.is_local:
            path = os.path.join(self.source, name)
            return path if os.path.isfile(path) else None
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError

        try:
            return hf_hub_download(self.source, name, revision=self.revision)
        except EntryNotFoundError:
            return None

    @cached_property
    def stored_keys(self) -> dict[str, str] | None:
        """`weight_map` of this checkpoint (local folders fully checked), read once."""
        keys = weight_map(self.file, self.source, validate=self.is_local)
        if keys is None and self.is_local and not any(self.file(name) for name in _OTHER_WEIGHTS):
            raise CheckpointUnreadable(
                f"{self.source} has a config.json but no weights (no model.safetensors, no {_INDEX} with its "
                "shards, no pytorch_model.bin): was it copied or saved only in part?"
            )
        return keys

    @cached_property
    def empty_model(self) -> tf.PreTrainedModel:
        """The model on the meta device: names, shapes and declared ties, with no memory and no weights (built once)."""
        with torch.device("meta"):
            return cast(tf.PreTrainedModel, _compat.build_from_config(self.model_class, self.config))

    def load(self) -> tuple[tf.PreTrainedModel, frozenset[str]]:
        """The model with its weights, as plain `from_pretrained` gives it (stored dtype), and the names of the
        parameters the checkpoint does not hold (`from_pretrained` initialised them new).

        transformers' own load report and progress bars are silenced: the caller says what is new, in its terms."""
        try:
            with quiet_transformers():
                loaded: Any = self.model_class.from_pretrained(  # (model, info) with output_loading_info=True
                    self.source,
                    revision=self.revision or "main",
                    dtype="auto",
                    trust_remote_code=False,
                    output_loading_info=True,
                )
                model, info = loaded
            return model, frozenset(info.get("missing_keys", ()))
        except (OSError, RuntimeError, ValueError, SafetensorError) as error:
            if not self.is_local:
                raise
            raise CheckpointUnreadable(
                f"{self.source}: from_pretrained could not load the weights ({type(error).__name__}: {error})."
            ) from error


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Within the block, transformers logs errors only and shows no progress bars (public `transformers.utils.logging`
    API); both settings are restored after it."""
    logging = tf.utils.logging
    verbosity, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()


def open_checkpoint(source: str | os.PathLike, head: str = "auto", revision: str | None = None) -> Checkpoint:
    """Resolve `source` and pick its LM-head class: the config's architecture (`head="auto"`) or an Auto class."""
    source = os.fspath(source)
    if head != "auto" and head not in HEADS:
        raise UntieValueError(f"head={head!r} is not one of auto, {', '.join(HEADS)}.")
    config = _config(source, revision)
    model_class = _model_class(source, config, head)
    checkpoint = Checkpoint(source, config, model_class, revision)
    if checkpoint.is_local:
        stored_keys(checkpoint)  # every weight file present and readable, or a CheckpointUnreadable naming the file
    model = checkpoint.empty_model
    if model.get_output_embeddings() is None or model.get_input_embeddings() is None:
        raise NoEmbeddings(
            f"{source}: {model_class.__name__} has no LM head (get_output_embeddings() is None), so nothing is tied "
            f"or untied. Load it with a head, e.g. `--head masked-lm` (encoders) or `--head causal-lm` (decoders): "
            "the new head starts tied to the input embedding, as fine-tuning it would."
        )
    return checkpoint


def _config(source: str, revision: str | None) -> tf.PretrainedConfig:
    if os.path.isdir(source):
        config_file = os.path.join(source, "config.json")
        if not os.path.isfile(config_file):
            raise CheckpointNotFound(
                f"{source} has no config.json: pass the folder that save_pretrained() or a Trainer checkpoint wrote."
            )
        try:
            with open(config_file) as f:
                raw = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            raise CheckpointUnreadable(f"{config_file} is not valid JSON ({error}); restore or rewrite it.") from error
        if not isinstance(raw, dict):
            raise CheckpointUnreadable(f"{config_file} holds a JSON {type(raw).__name__}, not an object.")
        _refuse_remote_code(source, raw.get("auto_map"))
    elif os.path.exists(source):
        raise CheckpointNotFound(f"{source} is a file; pass the checkpoint folder that contains it.")
    elif _looks_like_a_path(source) or not _HUB_ID.match(source):
        raise CheckpointNotFound(f"{source}: no such folder (and not a hub id such as `openai-community/gpt2`).")
    # A hub id on a machine that cannot reach the hub: the cache, or one clear error now, not minutes of retries.
    offline = not os.path.isdir(source) and not _hub_reachable()
    try:
        # trust_remote_code=False: never run a checkpoint's code, and never prompt on stdout (it would break --json)
        config = tf.AutoConfig.from_pretrained(
            source, revision=revision, trust_remote_code=False, local_files_only=offline
        )
    except (OSError, ValueError, TypeError, KeyError) as error:
        if "trust_remote_code" in str(error):
            _refuse_remote_code(source, True)
        if os.path.isdir(source):
            raise CheckpointUnreadable(
                f"{source}/config.json cannot be read by transformers ({type(error).__name__}: {error})."
            ) from error
        if offline:
            raise CheckpointNotFound(
                f"{source}: no such folder, and not in the local Hugging Face cache; the hub "
                f"({_hub_endpoint()}) cannot be reached from this machine. Pass the path of a checkpoint folder, or "
                "run where the hub is reachable once to cache it."
            ) from error
        raise CheckpointNotFound(
            f"{source}: no such folder, and the hub could not provide it ({type(error).__name__}: {error}). Check "
            "the path; for a hub id, check the spelling, your network and `hf auth login` for gated models."
        ) from error
    _refuse_remote_code(source, getattr(config, "auto_map", None))
    return config


def _looks_like_a_path(source: str) -> bool:
    """A path, never a hub id: hub ids do not start with '.', '/' or '~' and hold at most one '/'."""
    return source.startswith((".", "/", "~", os.sep)) or source.count("/") > 1 or (os.sep != "/" and os.sep in source)


def _hub_endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Whether a TCP connection to the hub's host opens within `timeout` seconds (one try: huggingface_hub retries a
    failed request for about half a minute). True under HF_HUB_OFFLINE (the hub library then reads its cache itself)
    and behind a proxy (the proxy, not this machine, reaches the hub)."""
    from urllib.parse import urlsplit

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or any(os.environ.get(name) for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY")):
        return True
    address = urlsplit(constants.ENDPOINT)
    try:
        with socket.create_connection((address.hostname, address.port or 443), timeout=timeout):
            return True
    except OSError:
        return False


def _refuse_remote_code(source: str, auto_map) -> None:
    if auto_map:
        raise RemoteCodeRefused(
            f"{source} ships its own modelling code (auto_map in config.json), and untie never runs a checkpoint's "
            "code. If you trust it, load it in Python with trust_remote_code=True and call untie.untie_embeddings / "
            "untie.tie_embeddings, then save_pretrained."
        )


def _model_class(source: str, config: tf.PretrainedConfig, head: str) -> type[tf.PreTrainedModel]:
    if head != "auto":
        return _auto_class(source, config, head)
    for name in config.architectures or []:
        model_class = getattr(tf, name, None)
        if model_class is not None:
            return model_class
    for name in HEADS:  # no usable architecture recorded: the first LM head the config type supports
        try:
            return _auto_class(source, config, name)
        except NoEmbeddings:
            continue
    raise NoEmbeddings(f"{source}: no language-modeling head class supports model type {config.model_type!r}.")


def _auto_class(source: str, config: tf.PretrainedConfig, head: str) -> type[tf.PreTrainedModel]:
    mapping = _compat.auto_class_mapping(HEADS[head])
    if type(config) not in mapping:
        raise NoEmbeddings(f"{source}: model type {config.model_type!r} has no {head} head in transformers.")
    return mapping[type(config)]


# ---------------------------------------------------------------------------------------------------------------
# Single tensors from safetensors
# ---------------------------------------------------------------------------------------------------------------


def stored_keys(checkpoint: Checkpoint) -> dict[str, str] | None:
    """Every tensor name in the checkpoint's safetensors files, mapped to its file; None without safetensors.

    Read once per checkpoint (`Checkpoint.stored_keys`). A local folder with no weight file at all raises
    `CheckpointUnreadable`; see `weight_map` for how the files are chosen and checked.
    """
    return checkpoint.stored_keys


def weight_map(file: Callable[[str], str | None], where: str, *, validate: bool) -> dict[str, str] | None:
    """Tensor name -> safetensors file of the weights `file(name)` finds (a local path, or None if absent).

    Files are chosen as from_pretrained chooses them: `model.safetensors` first, else the index and its shards.
    With `validate` every shard is opened, so a missing shard, a truncated file or a stale index raises
    `CheckpointUnreadable` (naming the file) instead of a report on half a checkpoint. None without safetensors.
    """
    single = file(_SINGLE)
    if single is not None:
        return dict.fromkeys(_safetensors_keys(single), _SINGLE)
    index = file(_INDEX)
    if index is None:
        return None
    try:
        with open(index) as f:
            mapping = dict(json.load(f)["weight_map"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CheckpointUnreadable(
            f"{index} is not a valid safetensors index ({type(error).__name__}: {error})."
        ) from error
    if validate:
        for shard in sorted(set(mapping.values())):
            path = file(shard)
            if path is None:
                raise CheckpointUnreadable(
                    f"{where}: {_INDEX} lists the shard {shard}, which is missing (a copy or a save that stopped part "
                    "way). Copy the missing shard, or save the model again."
                )
            missing = {key for key, name in mapping.items() if name == shard} - set(_safetensors_keys(path))
            if missing:
                raise CheckpointUnreadable(
                    f"{where}: {_INDEX} is stale: it places {sorted(missing)[:3]} in {shard}, which does not hold "
                    "them. Save the model again (or delete the stale index if model.safetensors is whole)."
                )
    return mapping


def folder_weight_map(folder: str) -> dict[str, str] | None:
    """`weight_map` of a local folder, every shard checked."""

    def file(name: str) -> str | None:
        path = os.path.join(folder, name)
        return path if os.path.isfile(path) else None

    return weight_map(file, folder, validate=True)


def _safetensors_keys(path: str) -> list[str]:
    try:
        with safe_open(path, framework="pt") as f:
            return list(f.keys())
    except (SafetensorError, OSError) as error:
        raise CheckpointUnreadable(
            f"{path} cannot be read ({error}): a truncated or damaged file. Copy or save it again."
        ) from error


def stored_name(model: nn.Module, name: str, keys: Collection[str]) -> str | None:
    """The checkpoint key of parameter `name`: itself, or without/with the base-model prefix (`transformer.`)."""
    prefix = f"{getattr(model, 'base_model_prefix', '')}."
    candidates = [name, name[len(prefix) :] if name.startswith(prefix) else prefix + name]
    return next((key for key in candidates if key in keys), None)


#: safetensors dtype codes of floating-point tensors (an embedding or a head stored otherwise is not a trained one).
_FLOAT_CODES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4")


def check_stored_shapes(checkpoint: Checkpoint, embedding_names: Collection[str]) -> None:
    """Refuse, as `from_pretrained` does, a checkpoint whose stored tensors disagree in shape with the model its config
    builds; refuse an embedding or LM head stored as integers (`from_pretrained` would cast them to float silently).

    Reads only the safetensors headers. Raises `CheckpointUnreadable` naming the tensor, both shapes and the fix."""
    keys = checkpoint.stored_keys
    if keys is None:
        return
    model = checkpoint.empty_model
    expected = model.state_dict()
    by_file: dict[str, list[tuple[str, str]]] = {}
    for name in expected:
        key = stored_name(model, name, keys)
        if key is not None:
            by_file.setdefault(keys[key], []).append((name, key))
    for file, entries in by_file.items():
        with safe_open(checkpoint.file(file), framework="pt") as f:
            for name, key in entries:
                stored = f.get_slice(key)
                shape, dtype = tuple(stored.get_shape()), stored.get_dtype()
                if shape != tuple(expected[name].shape):
                    raise CheckpointUnreadable(
                        f"{checkpoint.source}: {file} stores {key} with shape {shape}, but config.json builds "
                        f"{tuple(expected[name].shape)} (vocab_size, hidden_size, ...): from_pretrained refuses this "
                        "checkpoint. Restore the config.json saved with these weights, or save the model again."
                    )
                if name in embedding_names and dtype not in _FLOAT_CODES:
                    raise CheckpointUnreadable(
                        f"{checkpoint.source}: {file} stores {key} as {dtype} integers; an embedding or LM head is "
                        "floating point (from_pretrained would cast these integers to float, which is not a trained "
                        "matrix). Save the model again from its floating-point weights."
                    )


def read_tensor(checkpoint: Checkpoint, key: str, keys: dict[str, str]) -> torch.Tensor:
    """One tensor of the checkpoint, read without loading anything else."""
    with safe_open(checkpoint.file(keys[key]), framework="pt") as f:
        return f.get_tensor(key)
