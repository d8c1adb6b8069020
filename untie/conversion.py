"""Convert a checkpoint between tied and untied, and prove the result reloads in the new state.

The written folder is a normal Hugging Face checkpoint (safetensors, config, tokenizer files): plain
`from_pretrained` loads it in the new state, and it stays so through `tie_weights()` and `resize_token_embeddings()`.
"""

from __future__ import annotations

import os
import shutil
import warnings
from typing import Any

import torch

from untie.loading import CheckpointError, open_checkpoint
from untie.surgery import TieInit, is_tied, tie_embeddings, untie_embeddings

#: Files `save_pretrained` writes itself, or weights in formats the converted folder must not keep.
_NOT_COPIED = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".ckpt", ".gguf")
_WRITTEN = {"config.json", "generation_config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json"}


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
    """
    source, output_dir = os.fspath(source), os.fspath(output_dir)
    if os.path.isdir(source) and os.path.abspath(source) == os.path.abspath(output_dir):
        raise ValueError(f"convert writes a new folder: OUT must differ from the source ({source}).")
    if os.path.isdir(output_dir) and os.listdir(output_dir) and not overwrite:
        raise FileExistsError(f"{output_dir} exists and is not empty; choose a new folder or pass --overwrite.")
    checkpoint = open_checkpoint(source, head=head, revision=revision)
    model = checkpoint.load()
    was_tied = is_tied(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "already (un)tied" is reported in the summary instead
        if untie:
            untie_embeddings(model)
        else:
            tie_embeddings(model, init=init)
    model.save_pretrained(output_dir)
    copied = _copy_side_files(checkpoint, output_dir)
    summary: dict[str, Any] = {
        "source": source,
        "output_dir": output_dir,
        "model_class": checkpoint.model_class.__name__,
        "before": "tied" if was_tied else "untied",
        "after": "untied" if untie else "tied",
        "init": None if untie else init,
        "copied_files": copied,
        "checks": [],
        "notes": [],
    }
    if was_tied != untie:
        summary["notes"].append(f"the model was already {summary['after']}; its config was updated to say so.")
    if verify:
        summary["checks"], notes = verify_conversion(checkpoint.model_class, output_dir, model, untied=untie)
        summary["notes"] += notes
    return summary


def verify_conversion(model_class, output_dir: str, converted, *, untied: bool) -> tuple[list[str], list[str]]:
    """Reload `output_dir` with plain `from_pretrained` and check its state survives tie_weights() and a resize."""
    checks, notes = [], []
    reloaded = model_class.from_pretrained(output_dir, dtype="auto")
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
    _expect(is_tied(reloaded) != untied, f"{loader} loads it {state}", checks)
    _expect(_same_embeddings(reloaded, converted), "the reloaded embedding and head equal the converted ones", checks)
    head_before = reloaded.get_output_embeddings().weight.detach().clone()
    reloaded.tie_weights()
    _expect(is_tied(reloaded) != untied, f"still {state} after tie_weights()", checks)
    head_after = reloaded.get_output_embeddings().weight
    _expect(torch.equal(head_after, head_before), "head values unchanged by tie_weights()", checks)
    vocab = head_before.shape[0]
    reloaded.resize_token_embeddings(vocab + 8, mean_resizing=False)
    _expect(is_tied(reloaded) != untied, f"still {state} after resize_token_embeddings()", checks)
    _expect(
        torch.equal(reloaded.get_output_embeddings().weight[:vocab], head_before),
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
        (first.get_input_embeddings().weight, second.get_input_embeddings().weight),
        (first.get_output_embeddings().weight, second.get_output_embeddings().weight),
    ]
    return all(torch.equal(a.detach().cpu(), b.detach().cpu()) for a, b in pairs)


def _copy_side_files(checkpoint, output_dir: str) -> list[str]:
    """Copy the tokenizer and other side files save_pretrained does not write; for hub ids, save the tokenizer."""
    copied = []
    if checkpoint.is_local:
        for name in sorted(os.listdir(checkpoint.source)):
            path = os.path.join(checkpoint.source, name)
            if not os.path.isfile(path) or name.endswith(_NOT_COPIED) or name in _WRITTEN:
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
