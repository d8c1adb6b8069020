"""Tiny random models and data for tests, examples and smoke runs (no download needed), and the dense reference forms
of the library's measurements."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import transformers as tf
from torch import nn

from untie.decision.metric_keys import pair_key
from untie.errors import UntieValueError
from untie.signals.metrics import (
    Pairs,
    RoleGradients,
    cross_entropy_sums_from_target_logits,
    pair_gap_sums_from_log_probs,
    role_signals_on_rows,
)
from untie.structure.policy import normalisation_modules

if TYPE_CHECKING:
    from untie.adapters.untier import Untier

VOCAB = 48
HIDDEN = 16

# Shared sizes of the Llama-family decoders below.
_DECODER: dict[str, Any] = dict(
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
            decoder_start_token_id=0,  # type: ignore[call-arg]  # a PreTrainedConfig keyword T5Config passes on
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


def tiny_gemma3_multimodal_config() -> tf.Gemma3Config:
    """A tiny multimodal Gemma 3 config (tied): its vocabulary (64) and its tie live in `text_config` too, as the real
    model's do, the level PEFT's merge and a hand-copied head leave alone."""
    return tf.Gemma3Config(
        text_config=dict(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, hidden_size=16,
                         intermediate_size=32, head_dim=8, vocab_size=64),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14),
        mm_tokens_per_image=4, image_token_index=63, boi_token_index=62, eoi_token_index=61,
    )  # fmt: skip


def tiny_tokenizer() -> tf.PreTrainedTokenizerBase:
    """A WordPiece tokenizer of VOCAB entries, the tiny models' vocabulary, with case and word-start variants
    (`the`/`The`, `the`/`##the`, ...) for `pairs="auto"` and the default trigger to read."""
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    for word in ("the", "and", "of", "to", "in", "is"):
        words += [word, word.capitalize(), f"##{word}"]
    words += [f"w{i}" for i in range(VOCAB - len(words))]
    return tf.BertTokenizer(vocab={word: i for i, word in enumerate(words)})


#: The step task's vocabulary (`step_task`): chance is log 300 = 5.70 nat.
STEP_VOCAB = 300


def step_task(rows: int = 64, length: int = 24, seed: int = 0, vocab: int = STEP_VOCAB) -> torch.Tensor:
    """Sequences following x -> (7x + 3) mod `vocab` from a uniform start: a learnable task whose loss falls far below
    chance, so a model trained on it for a few dozen steps predicts what a fresh one cannot (issue 67's cases)."""
    generator = torch.Generator().manual_seed(seed)
    columns = [torch.randint(vocab, (rows,), generator=generator)]
    for _ in range(length - 1):
        columns.append((columns[-1] * 7 + 3) % vocab)
    return torch.stack(columns, 1)


def step_llama_config() -> tf.LlamaConfig:
    """A tied one-layer Llama, 32 wide, for the step task's vocabulary."""
    return tf.LlamaConfig(
        vocab_size=STEP_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=True,
    )  # fmt: skip


def step_model(family: str, seed: int, init: float | None = None) -> tf.PreTrainedModel:
    """A tied model for the step task's vocabulary, drawn under `seed`: "t5" (a one-layer T5, its embedding's entries
    of std `initializer_factor`, `init`, 1 by default) or "llama" (`step_llama_config`, at `initializer_range`
    `init`, 0.02 by default). At a large spread (T5; a Llama at 0.2) a few optimizer steps barely move the embedding."""
    torch.manual_seed(seed)
    if family == "t5":
        config = tf.T5Config(vocab_size=STEP_VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=1, num_heads=2,
                             dropout_rate=0.0, pad_token_id=0)  # fmt: skip
        config.decoder_start_token_id = 0  # a keyword T5Config takes through **kwargs (typed as unknown)
        if init is not None:
            config.initializer_factor = init
        return tf.T5ForConditionalGeneration(config)
    llama = step_llama_config()
    if init is not None:
        llama.initializer_range = init
    return tf.LlamaForCausalLM(llama)


def step_batch(family: str, seed: int) -> dict[str, torch.Tensor]:
    """16 rows of the step task as `step_model(family)` trains on them: a T5 reads the first 12 tokens and predicts
    the next 12; a causal model predicts each next token."""
    rows = step_task(rows=16, length=24, seed=seed)
    if family == "t5":
        return {"input_ids": rows[:, :12].contiguous(), "labels": rows[:, 12:].contiguous()}
    return {"input_ids": rows, "labels": rows}


def train_on_step_task(model: nn.Module, steps: int, lr: float, freeze_embedding: bool = False) -> nn.Module:
    """`model` trained `steps` AdamW steps of 16 rows on the step task (seed 0); with `freeze_embedding`, only its
    body's matrices train (the embedding keeps its fresh draw and the normalisation layers their constants: the
    weights' evidence reads it as built fresh, and only the model's function tells)."""
    frozen = [model.get_input_embeddings().weight] if freeze_embedding else []  # type: ignore[operator]
    if freeze_embedding:
        frozen += [p for _, m in normalisation_modules(model) for p in m.parameters(recurse=False)]
    trained = [p for p in model.parameters() if p.requires_grad and not any(p is f for f in frozen)]
    optimizer = torch.optim.AdamW(trained, lr=lr)
    data = step_task()
    for step in range(steps):
        batch = data[(step * 16) % 64 :][:16]
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    for param in frozen:
        param.grad = None  # computed (the matrix is shared or in the graph), never applied
    return model


def loss_on(model: nn.Module, batch: torch.Tensor) -> float:
    """The model's loss on `batch` (labels = inputs), without gradients."""
    with torch.no_grad():
        return float(model(input_ids=batch, labels=batch).loss)


def first_step_at_lr_zero(untier: Untier, model: nn.Module, batch: torch.Tensor) -> float:
    """One custom-loop step at learning rate 0 of a `model` that `untier` (an `untie.Untier`) attached: start it, one
    forward and backward on `batch`, the optimizer's step and the untier's. Returns the first forward's loss, the
    loss of the head the run trains its first step on (the step changes no weight)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    untier.start(optimizer)
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    optimizer.step()
    untier.step()
    return float(loss.detach())


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


# --------------------------------------------------------------------------------------------------------------- Dense
# reference metrics: the measurements of `untie.signals.metrics` from whole (V, d) gradients and (N, V) logits, which
# the tests check the probe's row-wise forms against (the library itself never materialises these).
# ---------------------------------------------------------------------------------------------------------------


def role_signals(
    input_grad: torch.Tensor,
    output_grad: torch.Tensor,
    weight: torch.Tensor | None = None,
    pairs: Pairs = (),
    sample_rows: int = 256,
) -> dict[str, float]:
    """`untie.signals.metrics.role_signals_on_rows` (which defines the signals) from the two dense (V, d) role
    gradients of a tied matrix: the reference the tests check the probe's row-wise measurement against."""
    if pairs and weight is None:
        raise UntieValueError("role_signals: pass the shared `weight` to get per-pair pushes and tension.")
    grads = RoleGradients.from_dense(input_grad, output_grad, weight, pairs)
    return role_signals_on_rows(grads, pairs=pairs, sample_rows=sample_rows)


def conditional_gaps(logits: torch.Tensor, pairs: Pairs, positions: torch.Tensor | None = None) -> dict[str, float]:
    """The conditional gap of each pair (a, b): how differently the model predicts a and b, in nats.

    gap(a, b) = sum_r w_r |log p(a|r) - log p(b|r)| / sum_r w_r over the contexts r (rows of ``logits``, or the
    rows where ``positions`` is True: those that carry a loss), with w_r = p(a|r) + p(b|r). Zero when the model
    predicts both symbols alike in every context that matters to them (conditionally equivalent, so the paper's
    output theorem wants their output rows equal); log(9) = 2.2 for two spellings of one word drawn .1/.9.
    Weighting by p(a|r) + p(b|r) keeps contexts where neither symbol is plausible from drowning the measure.
    NaN for a pair that no context makes plausible.
    """
    total, weight = pair_gap_sums(logits, pairs, positions)
    return {pair_key(p): _ratio(float(t), float(w)) for p, t, w in zip(pairs, total, weight, strict=True)}


def _ratio(numerator: float, denominator: float) -> float:
    if not (math.isfinite(numerator) and math.isfinite(denominator)) or denominator == 0:
        return math.nan
    return numerator / denominator


def log_normalizers(logits: torch.Tensor) -> torch.Tensor:
    """(N, 1) float32 log-sum-exp of each row of the (..., V) logits: the one O(N V) pass the sums below share."""
    return logits.detach().reshape(-1, logits.shape[-1]).float().logsumexp(dim=-1, keepdim=True)


def pair_gap_sums(
    logits: torch.Tensor,
    pairs: Pairs,
    positions: torch.Tensor | None = None,
    log_norm: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Numerator and denominator of `conditional_gaps`, as (P,) float64 tensors, to sum over batches and ranks.
    ``log_norm``: the rows' `log_normalizers`, when the caller has them already (after ``positions``)."""
    flat = logits.detach().reshape(-1, logits.shape[-1])
    if positions is not None:
        flat = flat[positions.reshape(-1)]
    index = torch.as_tensor(pairs, device=flat.device).reshape(-1, 2)
    if log_norm is None:
        log_norm = log_normalizers(flat)
    log_a = flat[:, index[:, 0]].float() - log_norm
    log_b = flat[:, index[:, 1]].float() - log_norm
    return pair_gap_sums_from_log_probs(log_a, log_b)


def cross_entropy_sums(
    logits: torch.Tensor, targets: torch.Tensor, log_norm: torch.Tensor | None = None
) -> torch.Tensor:
    """(3,) float64: the sum of the positions' cross-entropies, the sum of their squares and the positions' count.
    ``log_norm``: the rows' `log_normalizers`, when the caller has them already."""
    flat = logits.detach().reshape(-1, logits.shape[-1])
    if log_norm is None:
        log_norm = log_normalizers(flat)
    target_logit = flat.gather(1, targets.reshape(-1, 1)).squeeze(1).float()
    return cross_entropy_sums_from_target_logits(log_norm.reshape(-1), target_logit)
