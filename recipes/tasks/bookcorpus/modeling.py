"""The paper's BookCorpus masked LM as a Hugging Face ``PreTrainedModel``, and a small GPT-2 for the causal variant.

The paper's model (paper.md section 2.4): token table -> 3 post-LN Transformer encoder layers (4 heads, d 128,
FFN 512, GELU, no dropout) with a key-padding mask -> a bias-free output table. Both tables are (V, 128),
initialised N(0, 0.3^2) with the padding row zeroed. Its quirk: **no positional encoding**, so the MLM sees a bag of
words; `position_embeddings=True` adds learned positions.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import MaskedLMOutput

from untie_recipes.common import token_mean_loss


class TwinEncoderConfig(PretrainedConfig):
    """Sizes of the paper's BookCorpus encoder; the defaults are the paper's."""

    model_type = "untie-twin-encoder"

    def __init__(
        self,
        vocab_size: int = 30_622,
        hidden_size: int = 128,
        num_hidden_layers: int = 3,
        num_attention_heads: int = 4,
        intermediate_size: int = 512,
        max_position_embeddings: int = 128,
        position_embeddings: bool = False,
        init_std: float = 0.3,
        pad_token_id: int = 0,
        tie_word_embeddings: bool = True,
        **kwargs,
    ) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.max_position_embeddings = max_position_embeddings
        self.position_embeddings = position_embeddings
        self.init_std = init_std
        super().__init__(pad_token_id=pad_token_id, tie_word_embeddings=tie_word_embeddings, **kwargs)


class TwinEncoderForMaskedLM(PreTrainedModel):
    """Embedding (+ optional positions) -> post-LN encoder layers -> bias-free output table; mean CE over labels, over
    Trainer's `num_items_in_batch` when it passes one (`untie_recipes.common.token_mean_loss`: the same loss on any
    number of processes)."""

    config_class = TwinEncoderConfig
    base_model_prefix = "twin_encoder"
    _tied_weights_keys = {"lm_head.weight": "embed_tokens.weight"}

    def __init__(self, config: TwinEncoderConfig) -> None:
        super().__init__(config)
        d = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, d, padding_idx=config.pad_token_id)
        self.embed_positions = nn.Embedding(config.max_position_embeddings, d) if config.position_embeddings else None
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(
                d,
                config.num_attention_heads,
                config.intermediate_size,
                dropout=0.0,
                activation="gelu",
                batch_first=True,
            )  # fmt: skip
            for _ in range(config.num_hidden_layers)
        )
        self.lm_head = nn.Linear(d, config.vocab_size, bias=False)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        # The paper initialises both tables N(0, 0.3^2) with the pad row zeroed; other layers keep PyTorch's init.
        if module is self.embed_tokens or module is self.lm_head:
            nn.init.normal_(module.weight, mean=0.0, std=self.config.init_std)
            with torch.no_grad():
                module.weight[self.config.pad_token_id].zero_()

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        num_items_in_batch: torch.Tensor | int | None = None,
        **kwargs,
    ) -> MaskedLMOutput:
        hidden = self.embed_tokens(input_ids)
        if self.embed_positions is not None:
            hidden = hidden + self.embed_positions(torch.arange(input_ids.shape[1], device=input_ids.device))
        padding = (attention_mask == 0) if attention_mask is not None else None
        for layer in self.layers:
            hidden = layer(hidden, src_key_padding_mask=padding)
        if labels is not None and self.training:
            # Training needs the loss only: score the labelled ~15% of positions, not the whole (tokens x V) table.
            scored = labels != -100
            loss = token_mean_loss(self.lm_head(hidden[scored]).float(), labels[scored], num_items_in_batch)
            return MaskedLMOutput(loss=loss, logits=None)
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = token_mean_loss(logits.flatten(0, 1).float(), labels.flatten(), num_items_in_batch)
        return MaskedLMOutput(loss=loss, logits=logits)


def paper_mlm_model(vocab_size: int, *, tied: bool, pad_token_id: int = 0, **sizes) -> TwinEncoderForMaskedLM:
    """The paper's masked LM over `vocab_size` ids (tokenizer + twins). Seed first: tied and untied models built
    from the same seed start from the same input table."""
    config = TwinEncoderConfig(vocab_size=vocab_size, pad_token_id=pad_token_id, tie_word_embeddings=tied, **sizes)
    return TwinEncoderForMaskedLM(config)


def small_gpt2(
    vocab_size: int,
    *,
    tied: bool,
    max_length: int = 128,
    hidden_size: int = 128,
    num_hidden_layers: int = 3,
    num_attention_heads: int = 4,
    intermediate_size: int = 512,
    init_std: float = 0.02,
) -> GPT2LMHeadModel:
    """A GPT-2 of the paper's MLM size for the causal variant (learned positions, no dropout, GPT-2's init)."""
    config = GPT2Config(
        vocab_size=vocab_size,
        n_positions=max_length,
        n_embd=hidden_size,
        n_layer=num_hidden_layers,
        n_head=num_attention_heads,
        n_inner=intermediate_size,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        initializer_range=init_std,
        bos_token_id=None,
        eos_token_id=None,
        tie_word_embeddings=tied,
    )
    return GPT2LMHeadModel(config)
