"""PEFT-wrapped models: which tie/untie requests are safe, and a clear refusal (with the fix) for the others.

Under PEFT the base weights are frozen and only adapter weights are saved, so a head untied inside a `PeftModel`
would be a base-model parameter that neither trains nor reaches the adapter file. What works is to untie (or tie)
the base model *before* wrapping it, and to train the untied head through `modules_to_save`, or to let PEFT's
`modules_to_save` split a tied model itself (`peft >= 0.19`, see `MERGE_RECORDS_THE_SPLIT`).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from untie import _compat
from untie.decision.plan import MERGE_RECORDS_THE_SPLIT
from untie.errors import UntieError

_UNTIE_FIRST = (
    "Untie the base model before wrapping it: `untie.untie_embeddings(base_model)`, then `get_peft_model(base_model, "
    'LoraConfig(..., modules_to_save=["lm_head"]))` so the untied head trains and is saved with the adapter (add '
    "the input embedding's module to train it too). Load the adapter onto a base model untied the same way. "
    "The whole route, with new tokens, merge and TRL: docs/guides/tied-checkpoints.md."
)


class PeftUnsupported(UntieError, ValueError):
    """A tie/untie request on a PEFT-wrapped model that would lose or freeze what the user trains."""


def is_peft_model(model: nn.Module) -> bool:
    """True for `peft.PeftModel` and for transformers models with an adapter attached (`model.add_adapter`).

    Not for the model `merge_and_unload()` returns: peft 0.18 leaves its `peft_config` attribute behind (0.19 deletes
    it), so the attribute alone would refuse `untie.untie_embeddings(merged)`; a PEFT layer must remain too."""
    if not getattr(model, "peft_config", None):
        return False
    try:
        from peft import PeftModel
    except ImportError:  # a peft_config without peft: say PEFT, the safe side
        return True
    return isinstance(model, PeftModel) or _compat.has_peft_layers(model)


def merge_records_the_split() -> bool:
    """Whether the installed PEFT's `merge_and_unload()` writes `tie_word_embeddings=False` for the split
    `modules_to_save` makes on a tied model (`MERGE_RECORDS_THE_SPLIT`)."""
    from importlib.metadata import version

    from packaging.version import Version

    return Version(version("peft")) >= Version(MERGE_RECORDS_THE_SPLIT)


def split_by_modules_to_save(model: Any) -> list[str]:
    """The roles ("input embedding", "LM head") to which PEFT's `modules_to_save` gave a trainable copy of their own
    in `model` (a PEFT model whose two roles were one matrix), in that order; [] where it gave none."""
    modules = (("input embedding", model.get_input_embeddings()), ("LM head", model.get_output_embeddings()))
    return [role for role, module in modules if _compat.is_modules_to_save_copy(module)]


def asks_to_keep_the_tie(model: nn.Module) -> bool:
    """Whether an adapter of `model` was configured with `ensure_weight_tying=True`."""
    configs = getattr(model, "peft_config", None) or {}
    return any(getattr(config, "ensure_weight_tying", False) for config in configs.values())


def multimodal_levels(model: nn.Module) -> bool:
    """Whether `model`'s config keeps the text model's settings in a sub-config of its own (`text_config`), which
    PEFT's merge leaves saying tied."""
    config = getattr(model, "config", None)
    return config is not None and hasattr(config, "get_text_config") and config.get_text_config() is not config


def refuse_peft_surgery(model: nn.Module, action: str) -> None:
    """`untie_embeddings` / `tie_embeddings` never operate inside a PEFT wrapper: say what to do instead."""
    if not is_peft_model(model):
        return
    if action == "untie":
        raise PeftUnsupported(f"untie_embeddings() cannot untie inside a PEFT model. {_UNTIE_FIRST}")
    raise PeftUnsupported(
        "tie_embeddings() cannot tie inside a PEFT model: PEFT has frozen both matrices and saves neither. Tie the "
        "base model before wrapping it (`untie.tie_embeddings(base_model, init=...)`), or after "
        "`merge_and_unload()`."
    )


def check_peft_run(
    model: nn.Module, *, tied: bool, untie_recorded: bool, keep_untied: bool, owner: str = "UntieCallback"
) -> None:
    """Accept a PEFT model for a run (`owner`: the adapter, named in the refusals) only if it trains untied and its
    merge keeps both matrices: a base model untied before wrapping, or a tied one that `modules_to_save` split on a
    PEFT whose merge records it (`MERGE_RECORDS_THE_SPLIT`). Refuse what would lose or freeze a trained matrix, or
    what the run cannot do.

    `untie_recorded`: the config says untied (flag False or this library's marker); `keep_untied`: the run asks to
    train untied from the start (`untie_at=0`, or a checkpoint this library untied), or leaves `tie_init` unset.
    """
    split = [] if tied or untie_recorded else split_by_modules_to_save(model)
    if tied or not (untie_recorded or split):
        # Nothing split the tied matrix (LoRA only, ensure_weight_tying, or trainable_token_indices, whose rows PEFT
        # ties in both roles): the model trains tied and its merge stays tied.
        raise PeftUnsupported(
            f"{owner} cannot untie a PEFT model during training: the new head would be a frozen base-model "
            f"parameter outside the adapter, so it would neither train nor be saved. {_UNTIE_FIRST} Or train "
            f"without {owner}: PEFT keeps this model tied, and its merge stays tied."
        )
    if not keep_untied:
        raise PeftUnsupported(
            f"This PEFT model is untied, and tie_init asks {owner} to tie it first (then untie at untie_at); it "
            "cannot do that under PEFT. Leave tie_init unset to train it untied, as without PEFT, or tie the base "
            "model before wrapping it (`untie.tie_embeddings(base_model)`)."
        )
    if untie_recorded:
        return
    roles = " and the ".join(split)
    if asks_to_keep_the_tie(model):
        raise PeftUnsupported(
            f"LoraConfig(ensure_weight_tying=True) asks PEFT to keep the tie, but PEFT gave the {roles} a trainable "
            "copy of its own, so this model would train untied against that setting. To keep the tie, name the "
            "modules PEFT ties for this model (or leave both matrices out of modules_to_save) and train without "
            f"{owner}; to untie, drop ensure_weight_tying. {_UNTIE_FIRST}"
        )
    if not merge_records_the_split():
        from importlib.metadata import version

        raise PeftUnsupported(
            f"PEFT's modules_to_save gave the {roles} a trainable copy of the tied matrix while the config still "
            f"declares the tie, and peft {version('peft')} keeps that declaration through merge_and_unload(): "
            "tie_weights() after the merge, or a save and reload, then replaces the head with the embedding and "
            f"loses what it learned. peft >= {MERGE_RECORDS_THE_SPLIT} records the untie at the merge: upgrade "
            f"PEFT (pip install 'peft>={MERGE_RECORDS_THE_SPLIT}'), or untie on purpose. {_UNTIE_FIRST}"
        )
    if multimodal_levels(model):
        _compat.warn_in_user_code(
            f"PEFT's modules_to_save gave the {roles} a trainable copy of the tied matrix: this model trains untied. "
            "PEFT's merge_and_unload() records the untie in the top-level config only, and this model's text_config "
            "keeps tie_word_embeddings=True, which an engine that reads that level ties again. After the merge, "
            "call untie.untie_embeddings(merged) (it records the untie at every level and copies nothing), or run "
            "`untie convert SRC OUT --untie` on the saved folder."
        )
