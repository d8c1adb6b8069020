"""PEFT-wrapped models: which tie/untie requests are safe, and a clear refusal (with the fix) for the others.

Under PEFT the base weights are frozen and only adapter weights are saved, so a head untied inside a `PeftModel`
would be a base-model parameter that neither trains nor reaches the adapter file. What works is to untie (or tie)
the base model *before* wrapping it, and to train the untied head through `modules_to_save`.
"""

from __future__ import annotations

from torch import nn

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
    """True for `peft.PeftModel` and for transformers models with an adapter attached (`model.add_adapter`)."""
    return bool(getattr(model, "peft_config", None))


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


def check_peft_run(model: nn.Module, *, tied: bool, untie_recorded: bool, keep_untied: bool) -> None:
    """Accept a PEFT model for `UntieCallback` only if it is untied, the config records it, and it stays untied.

    `untie_recorded`: the config says untied (flag False or this library's marker); `keep_untied`: the run asks to
    train untied from the start (`untie_at=0`, or a checkpoint this library untied).
    """
    if tied:
        raise PeftUnsupported(
            "UntieCallback cannot untie a PEFT model during training: the new head would be a frozen base-model "
            f"parameter outside the adapter, so it would neither train nor be saved. {_UNTIE_FIRST}"
        )
    if not untie_recorded:
        raise PeftUnsupported(
            "PEFT has given the input embedding and the LM head separate parameters (modules_to_save or trainable "
            "tokens on one of the tied matrices) while the config still declares the tie: after merge_and_unload(), "
            "tie_weights() or a reload can overwrite the trained head. Either keep them tied "
            "(LoraConfig(ensure_weight_tying=True)) and train without UntieCallback, or untie on purpose. "
            f"{_UNTIE_FIRST}"
        )
    if not keep_untied:
        raise PeftUnsupported(
            "This PEFT model is untied, and tie_init asks UntieCallback to tie it first (then untie at untie_at); it "
            "cannot do that under PEFT. Leave tie_init unset to train it untied, as without PEFT, or tie the base "
            "model before wrapping it (`untie.tie_embeddings(base_model)`)."
        )
