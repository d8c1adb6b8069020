"""Convert a checkpoint between tied and untied, and prove the result reloads in the new state.

The written folder is a normal Hugging Face checkpoint (safetensors, config, tokenizer files): plain
`from_pretrained` loads it in the new state, and it stays so through `tie_weights()` and `resize_token_embeddings()`.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import tempfile
import warnings
from typing import Any

import torch
from safetensors import SafetensorError

from untie.checkpoints.inspection import config_levels, levels_disagree
from untie.checkpoints.loading import (
    CheckpointError,
    HeadNotStored,
    OutputNotWritable,
    check_stored_shapes,
    open_checkpoint,
    quiet_transformers,
)
from untie.decision.settings import TieInit
from untie.errors import UntieFileExistsError, UntieValueError
from untie.structure.surgery import (
    embedding_layout,
    input_weight,
    is_tied,
    other_ties,
    output_weight,
    tie_embeddings,
    untie_embeddings,
)

#: Files `save_pretrained` writes itself, or weights in formats the converted folder must not keep.
_NOT_COPIED = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".ckpt", ".gguf")
_WRITTEN = {"config.json", "generation_config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json"}
#: Training state of the source run, not of the converted model: its UntieCallback state would contradict the new
#: tying (a `--tie` output that says "untied" is untied again by `prepare_for_resume`). Optimizer, scheduler and RNG
#: files are not copied either (their extensions are in `_NOT_COPIED`).
_RUN_STATE = {"trainer_state.json"}


class ConversionFailed(CheckpointError):
    """The converted checkpoint did not reload in the requested state."""

    exit_code = 5


def convert_checkpoint(
    source: str | os.PathLike,
    output_dir: str | os.PathLike,
    *,
    untie: bool,
    init: TieInit = "input",
    head: str = "auto",
    revision: str | None = None,
    overwrite: bool = False,
    verify: bool = True,
) -> dict[str, Any]:
    """Write `source` to `output_dir` untied (`untie=True`) or tied from `init`, then reload it to check the state.

    Returns what was done and checked; raises `ConversionFailed` if the reloaded model is not in the new state.
    Refuses, before anything is written, what `untie inspect` flags: a stored embedding or head of another shape than
    the config builds or of an integer dtype, and an untied checkpoint that does not store its head, unless the
    conversion keeps only the embedding (`--tie --init input`): OUT holds the source's trained matrices or, for a
    tie, their documented combination, never a matrix `from_pretrained` made up.
    """
    source, output_dir = os.fspath(source), os.fspath(output_dir)
    _check_output_dir(source, output_dir, overwrite=overwrite)
    checkpoint = open_checkpoint(source, head=head, revision=revision)
    layout = embedding_layout(checkpoint.empty_model)
    check_stored_shapes(checkpoint, {layout.input_weight, layout.output_weight})
    model, missing = checkpoint.load()
    was_tied = is_tied(model)
    levels = config_levels(model.config)
    if not was_tied and layout.output_weight in missing and (untie or init != "input"):
        _refuse_unstored_head(source, layout.output_weight, untie=untie, init=init)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "already (un)tied" is reported in the summary instead
        if untie:
            untie_embeddings(model)
        else:
            tie_embeddings(model, init=init)
    summary: dict[str, Any] = {
        "source": source,
        "output_dir": output_dir,
        "model_class": checkpoint.model_class.__name__,
        "before": "tied" if was_tied else "untied",
        "after": "untied" if untie else "tied",
        "init": None if untie else init,
        "copied_files": [],
        "checks": [],
        "notes": [],
    }
    if levels_disagree(levels):
        said = ", ".join(f"{k}={v}" for k, v in levels.items() if v is not None)
        summary["notes"].append(
            f"the source's config levels disagreed ({said}); OUT's config says {summary['after']} at every level."
        )
    elif was_tied != untie:
        summary["notes"].append(f"the model was already {summary['after']}; its config was updated to say so.")
    summary["notes"] += _new_parameter_notes(model, missing, layout, head_is_embedding=was_tied or not untie)
    # Everything is written into a hidden sibling of OUT and renamed to OUT only once the reload checks pass: a kill,
    # a full disk or a failed check never leaves an OUT that looks finished; the next convert removes what it left.
    summary["notes"] += _remove_leftovers(output_dir)
    staging = _staging_dir(output_dir)
    try:
        try:
            with quiet_transformers():
                model.save_pretrained(staging)
            summary["copied_files"] = _copy_side_files(checkpoint, staging)
        except (OSError, SafetensorError) as error:  # safetensors reports ENOSPC / EFBIG as its own error
            raise OutputNotWritable(f"could not write {output_dir}: {error}.") from error
        if verify:
            with quiet_transformers():
                summary["checks"], notes = verify_conversion(checkpoint.model_class, staging, model, untied=untie)
            summary["notes"] += notes
        _share_like_new_files(staging)
        _replace(staging, output_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return summary


def _refuse_unstored_head(source: str, head: str, *, untie: bool, init: str) -> None:
    """An untied checkpoint without its head: `from_pretrained` made one up, so OUT would store noise as the head."""
    wanted = "--untie" if untie else f"--tie --init {init}"
    raise HeadNotStored(
        f"{source}: its config does not tie the LM head, and {head} is not stored, so from_pretrained initialises it "
        f"randomly (`untie inspect` calls this head-missing); convert {wanted} would write that random matrix "
        f"{'as the head' if untie else 'into the shared matrix'}. If the model was trained tied (its config lost the "
        f"tie), convert with `--tie --init input`: the embedding serves both roles again, and training with "
        "UntieCallback can untie it later."
    )


def _new_parameter_notes(model, missing: frozenset[str], layout, *, head_is_embedding: bool) -> list[str]:
    """What `from_pretrained` initialised because the source does not store it (a head class added to a headless
    checkpoint, `--head masked-lm` on a BertModel): said here, in this library's words, not transformers' load
    report. `head_is_embedding`: OUT's head is the trained input embedding (tied), whatever the source stored."""
    notes = []
    if head_is_embedding and layout.output_weight in missing:
        notes.append(
            f"{layout.output_weight} is not stored in the source; in OUT it is the trained input embedding (tied)."
        )
    new = sorted(name for name in missing if not (head_is_embedding and name == layout.output_weight))
    if new:
        shown = ", ".join(new[:8]) + (f" and {len(new) - 8} more" if len(new) > 8 else "")
        notes.append(
            f"{len(new)} parameter(s) of {type(model).__name__} are not in the source and start newly initialised, "
            f"as when fine-tuning adds that head: {shown}. OUT stores them as initialised."
        )
    return notes


def _check_output_dir(source: str, output_dir: str, *, overwrite: bool) -> None:
    """Refuse, before anything is written: an OUT that is the source, inside it or holds it (also through symlinks,
    `..` and relative paths: replacing OUT would delete the source), a non-empty OUT without `--overwrite`, a file."""
    if os.path.exists(source):
        real_source, real_output = os.path.realpath(source), os.path.realpath(output_dir)
        if _within(real_output, real_source) or _within(real_source, real_output):
            if real_output == real_source:
                where = "is the source"
            elif _within(real_output, real_source):
                where = "lies inside the source"
            else:
                where = "contains the source"
            raise UntieValueError(
                f"convert writes a new folder: OUT ({output_dir}) {where} ({source}) once links are resolved "
                f"({real_output}, {real_source}), and writing it would replace the source. Choose an OUT outside "
                "the source folder that does not contain it."
            )
    if os.path.isdir(output_dir) and os.listdir(output_dir) and not overwrite:
        raise UntieFileExistsError(f"{output_dir} exists and is not empty; choose a new folder or pass --overwrite.")
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise OutputNotWritable(f"OUT {output_dir} is a file; choose a folder path.")
    parent = os.path.dirname(os.path.abspath(output_dir))
    blocker = parent
    while not os.path.exists(blocker):
        blocker = os.path.dirname(blocker)
    if not os.path.isdir(blocker):
        raise OutputNotWritable(f"cannot create {output_dir}: {blocker} is a file, not a folder.")


def _within(path: str, folder: str) -> bool:
    """Whether real path `path` is `folder` or inside it."""
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


#: Staging and replaced-folder names carry the host and the process that made them, so that a later convert can tell
#: a leftover of a killed convert from the working folder of one still running.
_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?P<kind>partial|old)-(?P<host>[^/]+)-(?P<pid>\d+)-[^-]+$")


def _host() -> str:
    return socket.gethostname().replace("-", "_")  # no "-" inside the name's fields


def _owner_tag() -> str:
    return f"{_host()}-{os.getpid()}-"


def _remove_leftovers(output_dir: str) -> list[str]:
    """Remove the staging (`.OUT.partial-*`) and replaced (`.OUT.old-*`) folders that a killed convert into OUT left
    beside it; a convert still running on this host keeps its own. Returns a note per folder found."""
    parent, name = os.path.split(os.path.abspath(output_dir))
    notes: list[str] = []
    try:
        entries = os.listdir(parent)
    except OSError:
        return notes
    for entry in sorted(entries):
        match = _LEFTOVER.match(entry)
        if match is None or match["name"] != name:
            continue
        path = os.path.join(parent, entry)
        if match["host"] != _host():
            notes.append(f"{path} was left by a convert on host {match['host']}; delete it if none is running there.")
        elif not _process_alive(int(match["pid"])):
            shutil.rmtree(path, ignore_errors=True)
            what = "staging folder" if match["kind"] == "partial" else "replaced OUT"
            notes.append(f"removed {path}, the {what} of a convert into {output_dir} that did not finish.")
    return notes


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _staging_dir(output_dir: str) -> str:
    parent = os.path.dirname(os.path.abspath(output_dir))
    name = os.path.basename(os.path.abspath(output_dir))
    try:
        os.makedirs(parent, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=f".{name}.partial-{_owner_tag()}", dir=parent)
        os.chmod(staging, 0o777 & ~_umask())  # mkdtemp makes it private; OUT gets a normal folder's permissions
        return staging
    except OSError as error:
        raise OutputNotWritable(f"could not create {output_dir}: {error}.") from error


def _share_like_new_files(folder: str) -> None:
    """Give OUT's files the permissions a new file gets under the user's umask: save_pretrained (transformers 5.23)
    writes model.safetensors through a private temporary file (0600), which colleagues could not read."""
    mode = 0o666 & ~_umask()
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if os.path.isfile(path) and not os.path.islink(path):
            os.chmod(path, mode)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _replace(staging: str, output_dir: str) -> None:
    """Move the finished `staging` folder to `output_dir`, replacing what `--overwrite` allowed to replace."""
    try:
        if not os.path.lexists(output_dir):
            os.rename(staging, output_dir)
            return
        parent, name = os.path.split(os.path.abspath(output_dir))
        old = tempfile.mkdtemp(prefix=f".{name}.old-{_owner_tag()}", dir=parent)
        os.rmdir(old)  # a unique free name for the folder being replaced
        os.rename(output_dir, old)
        os.rename(staging, output_dir)
    except OSError as error:
        raise OutputNotWritable(f"could not move the converted checkpoint into {output_dir}: {error}.") from error
    if os.path.islink(old):
        os.unlink(old)
    else:
        shutil.rmtree(old, ignore_errors=True)


def verify_conversion(model_class, output_dir: str, converted, *, untied: bool) -> tuple[list[str], list[str]]:
    """Reload `output_dir` with plain `from_pretrained` and check its state survives tie_weights() and a resize."""
    checks: list[str] = []
    notes: list[str] = []
    reloaded = model_class.from_pretrained(output_dir, dtype="auto", trust_remote_code=False)
    state = "untied" if untied else "tied"
    loader = "plain from_pretrained"
    if untied and getattr(reloaded.config, "tie_word_embeddings", False):
        # T5/BART: the flag also ties encoder and decoder embeddings, so it stays True; plain from_pretrained re-ties
        # a head equal to the embedding, and tie_weights() re-ties any head (upstream, transformers 5.23). The
        # config's untie marker lets untie_embeddings() restore the untie; that is the documented way to load it.
        plainly = "tied (the head still equals the embedding)" if is_tied(reloaded) else "untied"
        untie_embeddings(reloaded)
        loader = "from_pretrained + untie.untie_embeddings"
        notes.append(
            f"{reloaded.config.model_type}: its tie_word_embeddings flag also ties the encoder and decoder embeddings, "
            f"so it stays True. Plain from_pretrained loads this checkpoint {plainly}, and tie_weights() or "
            "resize_token_embeddings() re-tie the head (upstream, transformers 5.23). Call "
            "untie.untie_embeddings(model) right after from_pretrained (UntieCallback does it by itself)."
        )
    apart = {
        t: src
        for t, src in other_ties(reloaded).items()
        if reloaded.get_parameter(t) is not reloaded.get_parameter(src)
    }
    if apart:
        _expect(
            all(torch.equal(reloaded.get_parameter(t), reloaded.get_parameter(src)) for t, src in apart.items()),
            f"{', '.join(sorted(apart))} reload equal to {', '.join(sorted(set(apart.values())))}",
            checks,
        )
        notes.append(
            f"{reloaded.config.model_type}: the config no longer declares the tie (so no tie_weights() or "
            "resize_token_embeddings() can re-tie the head), and plain from_pretrained loads "
            f"{', '.join(sorted(apart))} as equal copies instead of one shared matrix. untie.untie_embeddings(model) "
            "after from_pretrained shares them again (UntieCallback does it by itself)."
        )
    levels = config_levels(reloaded.config)
    if len(levels) > 1 and loader == "plain from_pretrained":  # a multimodal config: engines read either level
        _expect(
            all(value in (None, not untied) for value in levels.values()),
            f"every config level says {state} ({', '.join(levels)})",
            checks,
        )
    _expect(is_tied(reloaded) != untied, f"{loader} loads it {state}", checks)
    _expect(_same_embeddings(reloaded, converted), "the reloaded embedding and head equal the converted ones", checks)
    head_before = output_weight(reloaded).detach().clone()
    reloaded.tie_weights()
    _expect(is_tied(reloaded) != untied, f"still {state} after tie_weights()", checks)
    head_after = output_weight(reloaded)
    _expect(torch.equal(head_after, head_before), "head values unchanged by tie_weights()", checks)
    vocab = head_before.shape[0]
    reloaded.resize_token_embeddings(vocab + 8, mean_resizing=False)
    _expect(is_tied(reloaded) != untied, f"still {state} after resize_token_embeddings()", checks)
    _expect(
        torch.equal(output_weight(reloaded)[:vocab], head_before),
        "head rows unchanged by resize_token_embeddings()",
        checks,
    )
    return checks, notes


def _expect(condition: bool, what: str, checks: list[str]) -> None:
    if not condition:
        raise ConversionFailed(f"the converted checkpoint failed a check: {what}. Passed so far: {checks or 'none'}.")
    checks.append(what)


def _same_embeddings(first, second) -> bool:
    pairs = [
        (input_weight(first), input_weight(second)),
        (output_weight(first), output_weight(second)),
    ]
    return all(torch.equal(a.detach().cpu(), b.detach().cpu()) for a, b in pairs)


def _copy_side_files(checkpoint, output_dir: str) -> list[str]:
    """Copy the tokenizer and other side files save_pretrained does not write; for hub ids, save the tokenizer."""
    copied = []
    if checkpoint.is_local:
        for name in sorted(os.listdir(checkpoint.source)):
            path = os.path.join(checkpoint.source, name)
            if not os.path.isfile(path) or name.endswith(_NOT_COPIED) or name in _WRITTEN | _RUN_STATE:
                continue
            shutil.copy2(path, os.path.join(output_dir, name))
            copied.append(name)
        return copied
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(checkpoint.source, revision=checkpoint.revision)
    except (OSError, ValueError):
        return copied
    return sorted(os.path.basename(p) for p in tokenizer.save_pretrained(output_dir))
