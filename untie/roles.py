"""The two roles of a language model's vocabulary matrix, the input embedding and the LM head: where a Hugging Face
model keeps each. Read by the surgery (`untie.structure.surgery`), the role probe (`untie.signals.probe`) and the
emulated tying (`untie.engines.emulation`); it imports nothing of the library but its errors, so every layer may."""

from __future__ import annotations

from typing import Any

from torch import nn

from untie.errors import UntieTypeError, UntieValueError


def input_weight(model: Any) -> nn.Parameter:
    """The input embedding's weight: the shared matrix while tied (`model` a Hugging Face model)."""
    return model.get_input_embeddings().weight


def output_weight(model: Any) -> nn.Parameter:
    """The LM head's weight: the input embedding's own parameter while tied."""
    return model.get_output_embeddings().weight


def embedding_modules(model: Any) -> tuple[Any, Any]:
    """The input embedding and the LM head modules (each a module with a `weight` parameter)."""
    if not hasattr(model, "get_input_embeddings") or not hasattr(model, "get_output_embeddings"):
        raise UntieTypeError(
            f"{type(model).__name__} is not a Hugging Face PreTrainedModel (no get_input_embeddings / "
            "get_output_embeddings). Pass the model itself, not a wrapper such as DDP, or unwrap it first "
            "(accelerator.unwrap_model(model))."
        )
    input_emb = model.get_input_embeddings()
    output_emb = model.get_output_embeddings()
    if output_emb is None:
        raise UntieValueError(
            f"{type(model).__name__} has no output embeddings (get_output_embeddings() returned None), so there is "
            "nothing to tie or untie. Load the model with a language-modeling head, e.g. AutoModelForCausalLM or "
            "AutoModelForMaskedLM instead of AutoModel."
        )
    if input_emb is None or not hasattr(input_emb, "weight") or not hasattr(output_emb, "weight"):
        raise UntieValueError(
            f"{type(model).__name__}: input or output embedding module has no `weight` "
            f"(input: {type(input_emb).__name__}, output: {type(output_emb).__name__}); untie supports models whose "
            "LM head is a linear projection onto the vocabulary."
        )
    return input_emb, output_emb
