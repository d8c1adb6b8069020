"""The study's decoder: transformers' `LlamaForCausalLM` (RMSNorm, rotary positions, SwiGLU), head dimension 32,
SwiGLU at 8/3 of the width rounded down to a multiple of 8, no dropout; built tied from the seed, then given the
arm's head (drawn by the model's initialiser, or a copy of the embedding) before its optimizer is built."""

from __future__ import annotations

import torch
import transformers as tf

from untie import untie_embeddings
from untie.structure.surgery import draw_head

#: The attention heads' dimension.
HEAD_DIM = 32


def llama(width: int, layers: int, vocab: int, block: int, tied: bool = True, eos: int = 0) -> tf.LlamaForCausalLM:
    """A Llama of `width` x `layers` over `vocab` tokens and `block` positions, initialised from torch's current
    random state."""
    heads = max(1, width // HEAD_DIM)
    config = tf.LlamaConfig(
        vocab_size=vocab, hidden_size=width, intermediate_size=8 * width // 3 // 8 * 8, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=block,
        tie_word_embeddings=tied, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
    )  # fmt: skip
    return tf.LlamaForCausalLM(config)


def build_model(width: int, layers: int, seed: int, vocab: int, block: int, head: str | None, eos: int = 0):
    """The seed's tied Llama, then the arm's head: None keeps it tied, "drawn" unties it and draws the head with the
    model's own initialiser (what the default `fresh-untied` policy does to a fresh model), "copy" unties it with the
    head a copy of the embedding. Every arm of a seed shares the body and embedding of the tied draw."""
    torch.manual_seed(seed)
    model = llama(width, layers, vocab, block, tied=True, eos=eos)
    if head is not None:
        untie_embeddings(model)
        if head == "drawn":
            draw_head(model, "study")
        elif head != "copy":
            raise ValueError(f"head={head!r}: choose None (tied), 'drawn' or 'copy'.")
    return model


def parameter_counts(width: int, layers: int, vocab: int, block: int) -> tuple[int, int]:
    """(parameters of the tied model, parameters of its embedding), on the meta device (nothing allocated)."""
    with torch.device("meta"):
        model = llama(width, layers, vocab, block)
    return sum(p.numel() for p in model.parameters()), model.get_input_embeddings().weight.numel()
