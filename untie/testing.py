"""Tiny random models and data for tests, examples and smoke runs: no download needed."""

from __future__ import annotations

import torch
import transformers as tf

VOCAB = 48
HIDDEN = 16

# Shared sizes of the Llama-family decoders below.
_DECODER = dict(
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    hidden_size=HIDDEN,
    intermediate_size=32,
    vocab_size=VOCAB,
    bos_token_id=0,
    eos_token_id=0,
)

#: Architectures the library supports, as (config factory, model class). All tie their LM head by default.
TINY_MODELS = {
    "gpt2": (
        lambda: tf.GPT2Config(
            n_layer=1, n_head=2, n_embd=HIDDEN, vocab_size=VOCAB, n_positions=64, bos_token_id=0, eos_token_id=0
        ),
        tf.GPT2LMHeadModel,
    ),
    "llama": (
        lambda: tf.LlamaConfig(**_DECODER, tie_word_embeddings=True),
        tf.LlamaForCausalLM,
    ),
    "qwen2": (
        lambda: tf.Qwen2Config(**_DECODER, tie_word_embeddings=True),
        tf.Qwen2ForCausalLM,
    ),
    "gemma": (
        lambda: tf.GemmaConfig(**_DECODER, head_dim=8, pad_token_id=0),
        tf.GemmaForCausalLM,
    ),
    "opt": (
        lambda: tf.OPTConfig(
            num_hidden_layers=1,
            num_attention_heads=2,
            hidden_size=HIDDEN,
            ffn_dim=32,
            vocab_size=VOCAB,
            word_embed_proj_dim=HIDDEN,
            max_position_embeddings=64,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
        ),
        tf.OPTForCausalLM,
    ),
    "bert": (
        lambda: tf.BertConfig(
            num_hidden_layers=1,
            num_attention_heads=2,
            hidden_size=HIDDEN,
            intermediate_size=32,
            vocab_size=VOCAB,
            max_position_embeddings=64,
            pad_token_id=0,
        ),
        tf.BertForMaskedLM,
    ),
    "roberta": (
        lambda: tf.RobertaConfig(
            num_hidden_layers=1,
            num_attention_heads=2,
            hidden_size=HIDDEN,
            intermediate_size=32,
            vocab_size=VOCAB,
            max_position_embeddings=70,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
        ),
        tf.RobertaForMaskedLM,
    ),
    "t5": (
        lambda: tf.T5Config(
            num_layers=1,
            num_decoder_layers=1,
            num_heads=2,
            d_model=HIDDEN,
            d_kv=8,
            d_ff=32,
            vocab_size=VOCAB,
            decoder_start_token_id=0,
            pad_token_id=0,
            eos_token_id=1,
        ),
        tf.T5ForConditionalGeneration,
    ),
    "bart": (
        lambda: tf.BartConfig(
            encoder_layers=1,
            decoder_layers=1,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            d_model=HIDDEN,
            encoder_ffn_dim=32,
            decoder_ffn_dim=32,
            vocab_size=VOCAB,
            max_position_embeddings=64,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
            decoder_start_token_id=2,
        ),
        tf.BartForConditionalGeneration,
    ),
}


def tiny_model(arch: str, seed: int = 0) -> tf.PreTrainedModel:
    """A freshly initialised tiny model of `arch` (a key of TINY_MODELS) with tied embeddings."""
    make_config, model_class = TINY_MODELS[arch]
    torch.manual_seed(seed)
    return model_class(make_config())


class ToyLMDataset(torch.utils.data.Dataset):
    """Random token sequences with labels = input_ids (every architecture above accepts this batch)."""

    def __init__(self, n: int = 64, length: int = 12, vocab: int = VOCAB, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        # Low-entropy sequences (a repeating pattern with noise) so that the loss visibly decreases.
        base = torch.arange(length) % 7 + 3
        noise = torch.randint(0, vocab, (n, length), generator=generator)
        keep = torch.rand(n, length, generator=generator) < 0.8
        self.ids = torch.where(keep, base.expand(n, length), noise)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}
