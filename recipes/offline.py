"""Offline data and a small pre-trained checkpoint for the examples: the shipped Shakespeare text cut into causal-LM
blocks, and a GPT-2 pre-trained on it (tied or untied), so that every example runs without a download."""

from __future__ import annotations

import torch
import transformers as tf

from untie_recipes.tasks.bookcorpus.data import load_tokenizer, offline_sentences


def shakespeare_blocks(tokenizer, block_size: int = 64, sentences: int | None = 4000) -> list[dict[str, torch.Tensor]]:
    """Causal-LM examples (labels = input_ids) cut from the shipped Shakespeare text: offline data for examples."""
    texts = offline_sentences()[:sentences]
    ids = [i for row in tokenizer(texts, add_special_tokens=False)["input_ids"] for i in row]
    blocks = torch.tensor(ids[: len(ids) // block_size * block_size]).view(-1, block_size)
    return [{"input_ids": block, "labels": block.clone()} for block in blocks]


def small_checkpoint(path: str, *, tied: bool = True, pretrain_steps: int = 60, seed: int = 0) -> str:
    """Write a small GPT-2 (the shipped WordPiece vocabulary, d 64, 2 layers) pre-trained `pretrain_steps` steps on
    the shipped text, with its tokenizer: an "existing checkpoint", tied or untied, for examples that run offline."""
    tokenizer = load_tokenizer("offline")
    torch.manual_seed(seed)
    config = tf.GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=128,
        n_embd=64,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=tokenizer.cls_token_id,
        eos_token_id=tokenizer.sep_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=tied,
    )
    model = tf.GPT2LMHeadModel(config)
    data = torch.stack([b["input_ids"] for b in shakespeare_blocks(tokenizer, 64, sentences=2000)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(pretrain_steps):
        batch = data[torch.randint(len(data), (16,), generator=generator)]
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
