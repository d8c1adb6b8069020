"""The paper's small EXor models as Hugging Face ``PreTrainedModel``s, so Trainer and untie use them like any LM.

All three share the paper's frame: an input table and an output table of shape (vocab, d) initialised N(0, 1),
logits = hidden @ E_out^T with no bias, no positional encoding. ``tie_word_embeddings`` makes them one matrix.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import MaskedLMOutput

from untie_recipes.common import token_mean_loss

BODIES = ("transformer", "lstm", "mixer")


class ExorConfig(PretrainedConfig):
    """Sizes of one EXor model. Defaults are the paper's TransformerSmall (1 layer, 1 head, d 4, FFN 4, GELU)."""

    model_type = "untie-exor"

    def __init__(
        self,
        body: str = "transformer",
        vocab_size: int = 7,
        hidden_size: int = 4,
        num_layers: int = 1,
        num_heads: int = 1,
        intermediate_size: int = 4,
        token_mixing_size: int = 4,
        sequence_length: int = 8,
        tie_word_embeddings: bool = False,
        **kwargs,
    ) -> None:
        if body not in BODIES:
            raise ValueError(f"Unknown EXor model body {body!r}; choose one of {BODIES}.")
        self.body = body
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.intermediate_size = intermediate_size
        self.token_mixing_size = token_mixing_size
        self.sequence_length = sequence_length
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)


#: The paper's small models (paper.md section 1.3).
PAPER_MODELS: dict[str, dict] = {
    "transformer": dict(body="transformer", num_layers=1, num_heads=1, intermediate_size=4),
    "lstm": dict(body="lstm", num_layers=2, intermediate_size=8),  # bidirectional, hidden 8, Linear(16 -> 4)
    "mixer": dict(body="mixer", num_layers=1, token_mixing_size=4, intermediate_size=8),
}


class MixerBlock(nn.Module):
    """Pre-LayerNorm MLP-Mixer block: an MLP across positions, then one across channels, each residual."""

    def __init__(self, config: ExorConfig) -> None:
        super().__init__()
        d, length = config.hidden_size, config.sequence_length
        self.token_norm = nn.LayerNorm(d)
        self.token_mlp = nn.Sequential(
            nn.Linear(length, config.token_mixing_size), nn.ReLU(), nn.Linear(config.token_mixing_size, length)
        )
        self.channel_norm = nn.LayerNorm(d)
        self.channel_mlp = nn.Sequential(
            nn.Linear(d, config.intermediate_size), nn.ReLU(), nn.Linear(config.intermediate_size, d)
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.token_mlp(self.token_norm(hidden).transpose(1, 2)).transpose(1, 2)
        return hidden + self.channel_mlp(self.channel_norm(hidden))


class ExorForMaskedLM(PreTrainedModel):
    """Embedding -> body -> bias-free output table; the loss is the mean cross-entropy over labelled positions."""

    config_class = ExorConfig
    base_model_prefix = "exor"
    _tied_weights_keys = {"lm_head.weight": "embed_tokens.weight"}

    def __init__(self, config: ExorConfig) -> None:
        super().__init__(config)
        d = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, d)
        if config.body == "transformer":
            self.layers = nn.ModuleList(
                nn.TransformerEncoderLayer(
                    d, config.num_heads, config.intermediate_size, dropout=0.0, activation="gelu", batch_first=True
                )
                for _ in range(config.num_layers)
            )
        elif config.body == "lstm":
            self.lstm = nn.LSTM(
                d, config.intermediate_size, num_layers=config.num_layers, bidirectional=True, batch_first=True
            )
            self.lstm_out = nn.Linear(2 * config.intermediate_size, d)
        else:
            self.layers = nn.ModuleList(MixerBlock(config) for _ in range(config.num_layers))
        self.lm_head = nn.Linear(d, config.vocab_size, bias=False)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        # Only the tables follow the paper's nn.Embedding init; every other layer keeps PyTorch's default init.
        if module is self.embed_tokens or module is self.lm_head:
            nn.init.normal_(module.weight, mean=0.0, std=1.0)

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        num_items_in_batch: torch.Tensor | int | None = None,
        **kwargs,
    ) -> MaskedLMOutput:
        hidden = self.embed_tokens(input_ids)
        if self.config.body == "lstm":
            hidden = self.lstm_out(self.lstm(hidden)[0])
        else:
            for layer in self.layers:
                hidden = layer(hidden)
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            # Over Trainer's num_items_in_batch when it passes one: the same loss on any number of processes.
            loss = token_mean_loss(logits.flatten(0, 1), labels.flatten(), num_items_in_batch)
        return MaskedLMOutput(loss=loss, logits=logits)


def exor_model(
    body: str = "transformer", *, tied: bool, vocab_size: int = 7, sequence_length: int = 8
) -> ExorForMaskedLM:
    """One of the paper's small models, tied or untied. Seed before calling: tied and untied models built from
    the same seed start from the same input table."""
    if body not in PAPER_MODELS:
        raise ValueError(f"Unknown EXor model {body!r}; choose one of {sorted(PAPER_MODELS)}.")
    config = ExorConfig(
        **PAPER_MODELS[body], vocab_size=vocab_size, sequence_length=sequence_length, tie_word_embeddings=tied
    )
    return ExorForMaskedLM(config)
