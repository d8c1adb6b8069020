"""The tied-checkpoint guide's snippets, run as a user would, on a tiny tied Qwen3 saved in place of the checkpoint."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest
import torch
import transformers as tf

import untie
from untie.testing import tiny_tokenizer

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "guides" / "tied-checkpoints.md"
CHECKPOINT = '"Qwen/Qwen3-0.6B"'


def snippets(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)


def _tiny_qwen3(folder: Path) -> None:
    config = tf.Qwen3Config(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, hidden_size=16,
                            intermediate_size=32, head_dim=8, vocab_size=48, tie_word_embeddings=True,
                            pad_token_id=0, bos_token_id=2, eos_token_id=3)  # fmt: skip
    torch.manual_seed(0)
    tf.Qwen3ForCausalLM(config).save_pretrained(folder)
    tokenizer = tiny_tokenizer()
    tokenizer.add_special_tokens({"eos_token": "[SEP]"})  # an LM tokenizer's end of text (TRL appends it)
    tokenizer.save_pretrained(folder)


def test_the_tied_checkpoint_guide_runs_and_does_what_it_says(tmp_path, monkeypatch):
    pytest.importorskip("peft")
    pytest.importorskip("trl")
    code = snippets(GUIDE)
    assert len(code) == 4 and CHECKPOINT in code[0]
    _tiny_qwen3(tmp_path / "checkpoint")
    rows = [{"text": " ".join(["the", "The", "and", "of", "to", "in", "is"][i % 7 :] * 2)} for i in range(8)]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(row) for row in rows))
    monkeypatch.chdir(tmp_path)  # the snippets write my-model, sft, ... where they run
    namespace: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for snippet in code:
            exec(snippet.replace(CHECKPOINT, repr(str(tmp_path / "checkpoint"))), namespace)  # noqa: S102
    reloaded = namespace["reloaded"]
    assert reloaded.config.vocab_size == 48 + 2 and not untie.is_tied(reloaded)
    sft = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "my-model-sft")
    assert not untie.is_tied(sft) and sft.config.get_text_config().tie_word_embeddings is False
