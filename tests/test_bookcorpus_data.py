"""untie_recipes.tasks.bookcorpus: offline corpus, local and hub loading (up to the network), tokenizer, twins,
collators, model."""

from __future__ import annotations

import json

import datasets
import pytest
import torch

import untie
from untie_recipes.tasks.bookcorpus import (
    COMMON_WORDS,
    build_twins,
    data,
    lm_collator,
    load_corpus,
    load_tokenizer,
    offline_sentences,
    paper_mlm_model,
    tokenize_corpus,
)

pytestmark = pytest.mark.recipes  # a test of recipes/, scripts/ or the docs' tables (pytest -m 'not recipes')


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("offline")


def test_offline_corpus_is_real_english_split_reproducibly():
    sentences = offline_sentences()
    assert len(sentences) > 20_000 and all(s.strip() for s in sentences)
    words = " ".join(sentences).lower().split()
    assert words.count("the") > 5_000  # English prose, not a placeholder
    first, second = load_corpus(seed=3), load_corpus(seed=3)
    assert len(first["train"]) + len(first["validation"]) == len(sentences)
    assert 0.04 < len(first["validation"]) / len(sentences) < 0.06
    assert first["validation"]["text"] == second["validation"]["text"]


def test_offline_tokenizer_is_the_shipped_uncased_wordpiece():
    tokenizer = load_tokenizer("offline")
    assert len(tokenizer) == 8192 and tokenizer.pad_token_id == 0
    ids = tokenizer("The KING said")["input_ids"]
    assert ids[0] == tokenizer.cls_token_id and ids[-1] == tokenizer.sep_token_id
    assert tokenizer.convert_ids_to_tokens(ids[1:4]) == ["the", "king", "said"]
    assert len(build_twins(tokenizer, "dh").words) == 100  # every common word is one token


def test_trained_tokenizer_is_cached_so_every_arm_shares_it(tmp_path):
    first = load_tokenizer("train", offline_sentences()[:4000], vocab_size=2000, cache_dir=str(tmp_path))
    assert first.pad_token_id == 0 and len(first) == 2000
    assert first.convert_ids_to_tokens(first("The KING")["input_ids"]) == ["[CLS]", "the", "king", "[SEP]"]
    again = load_tokenizer("train", None, cache_dir=str(tmp_path))  # reloaded, not retrained
    assert first.get_vocab() == again.get_vocab()
    with pytest.raises(ValueError, match="needs the texts"):
        load_tokenizer("train", None)


def test_twins_get_new_ids_after_the_vocabulary(tokenizer):
    twins = build_twins(tokenizer, "dh")
    assert twins.twin_ids == tuple(range(len(tokenizer), len(tokenizer) + len(twins.words)))
    assert set(twins.probabilities) == {0.5}
    assert twins.words[0] == "the" and twins.word_ids[0] == tokenizer.convert_tokens_to_ids("the")
    mixed = build_twins(tokenizer, "mixed")
    assert mixed.probabilities[:4] == (0.5, 0.9, 0.5, 0.9)
    assert len(mixed.pairs_where(skewed=True)) + len(mixed.pairs_where(skewed=False)) == len(mixed.words)
    randoms = twins.random_pairs()
    assert len(randoms) == len(twins.words) and all(a != b for a, b in randoms)
    assert {a for a, _ in randoms} == set(twins.word_ids)


def test_words_outside_the_vocabulary_are_reported_and_skipped(tokenizer):
    with pytest.warns(UserWarning, match="qwxzv"):
        twins = build_twins(tokenizer, "dh", words=("the", "qwxzv"))
    assert twins.words == ("the",)
    with pytest.raises(ValueError, match="variant"):
        build_twins(tokenizer, "ndh")
    with pytest.raises(ValueError, match="None of the common words"), pytest.warns(UserWarning, match="qwxzv"):
        build_twins(tokenizer, "dh", words=("qwxzv",))


def test_swap_draws_twins_at_their_probabilities(tokenizer):
    twins = build_twins(tokenizer, "mixed")
    collator = lm_collator(tokenizer, "mlm", twins, seed=0)
    (half_word, half_twin), (skew_word, skew_twin) = twins.pairs[0], twins.pairs[1]
    other = tokenizer.convert_tokens_to_ids("king")
    assert other not in twins.word_ids
    ids = torch.tensor([half_word, skew_word, other]).repeat(20_000)
    swapped = collator.swap(ids).view(-1, 3)
    assert set(swapped[:, 0].tolist()) == {half_word, half_twin}
    assert set(swapped[:, 1].tolist()) == {skew_word, skew_twin}
    assert (swapped[:, 2] == other).all()
    assert abs((swapped[:, 0] == half_twin).float().mean() - 0.5) < 0.02
    assert abs((swapped[:, 1] == skew_twin).float().mean() - 0.9) < 0.02


def test_mlm_labels_hold_twins_and_random_replacements_are_original_ids(tokenizer):
    twins = build_twins(tokenizer, "dh")
    collator = lm_collator(tokenizer, "mlm", twins, seed=1)
    corpus = tokenize_corpus(load_corpus(), tokenizer, "mlm", max_length=32)
    batch = collator([corpus["train"][i] for i in range(512)])
    labels, inputs = batch["labels"], batch["input_ids"]
    scored = labels != -100
    assert 0.12 < scored[batch["attention_mask"].bool()].float().mean() < 0.18  # 15% of real tokens
    assert (labels[scored] >= len(tokenizer)).any()  # twins are prediction targets
    assert (inputs >= len(tokenizer)).any()  # and inputs
    replaced = scored & (inputs != tokenizer.mask_token_id) & (inputs != labels)
    assert replaced.any() and (inputs[replaced] < len(tokenizer)).all()
    assert not scored[inputs == tokenizer.pad_token_id].any()


def test_clm_blocks_and_labels(tokenizer):
    twins = build_twins(tokenizer, "dh")
    corpus = tokenize_corpus(load_corpus(), tokenizer, "clm", max_length=64)
    assert {len(x) for x in corpus["train"][:50]["input_ids"]} == {64}
    batch = lm_collator(tokenizer, "clm", twins, seed=0)([corpus["train"][i] for i in range(8)])
    assert torch.equal(batch["labels"], batch["input_ids"])
    assert (batch["input_ids"] >= len(tokenizer)).any()
    with pytest.raises(ValueError, match="objective"):
        lm_collator(tokenizer, "seq2seq", twins, seed=0)


def test_local_text_json_and_parquet_files(tmp_path):
    lines = [f"sentence number {i} is here ." for i in range(100)]
    (tmp_path / "a.txt").write_text("\n".join(lines))
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in lines))
    datasets.Dataset.from_dict({"text": lines}).to_parquet(str(tmp_path / "a.parquet"))
    for name in ("a.txt", "a.jsonl", "a.parquet"):
        corpus = load_corpus(data_files=[str(tmp_path / name)], validation_fraction=0.1)
        assert len(corpus["train"]) == 90 and len(corpus["validation"]) == 10, name
        assert set(corpus["train"]["text"]) | set(corpus["validation"]["text"]) == set(lines)
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        load_corpus(data_files=[str(tmp_path / "missing.txt")])
    with pytest.raises(ValueError, match="Cannot tell how to read"):
        load_corpus(data_files=[str(tmp_path / "a.xml")])


def test_hub_loading_up_to_the_network(monkeypatch):
    """BookCorpus comes from the hub's parquet export with the paper's 70% / 10% split; other ids stream."""
    calls = []

    def fake_load_dataset(path, name=None, **kwargs):
        calls.append((path, name, kwargs))
        rows = datasets.Dataset.from_dict({"text": [f"line {i}" for i in range(50)]})
        if kwargs.get("streaming"):
            return datasets.IterableDatasetDict(train=rows.to_iterable_dataset())
        return rows if "split" in kwargs else datasets.DatasetDict(train=rows)

    monkeypatch.setattr(data, "load_dataset", fake_load_dataset)
    corpus = load_corpus("bookcorpus/bookcorpus")
    assert [(c[0], c[2]["split"], c[2]["revision"]) for c in calls] == [
        ("bookcorpus/bookcorpus", "train[:70%]", "refs/convert/parquet"),
        ("bookcorpus/bookcorpus", "train[70%:80%]", "refs/convert/parquet"),
    ]
    assert set(corpus) == {"train", "validation"}
    calls.clear()
    streamed = load_corpus("someone/corpus", dataset_config="en", streaming=True, validation_size=5)
    assert calls == [("someone/corpus", "en", {"revision": None, "streaming": True})]
    assert len(list(streamed["validation"])) == 5 and len(list(streamed["train"])) == 45


def test_paper_model_init_padding_and_training_loss(tokenizer):
    torch.manual_seed(0)
    model = paper_mlm_model(len(tokenizer) + 100, tied=True)
    assert untie.is_tied(model)
    table = model.get_input_embeddings().weight
    assert torch.count_nonzero(table[0]) == 0 and 0.28 < table[1:].std() < 0.32
    ids = torch.randint(5, 500, (4, 30))
    labels = torch.full_like(ids, -100)
    labels[:, ::5], ids[:, ::5] = ids[:, ::5], tokenizer.mask_token_id
    mask = torch.ones_like(ids)
    mask[0, 20:] = 0
    model.train()
    train_loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss  # scores labelled positions only
    model.eval()
    eval_loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss  # full logits
    torch.testing.assert_close(train_loss, eval_loss)


def test_paper_model_is_a_bag_of_words_unless_positions_are_on():
    torch.manual_seed(0)
    ids = torch.randint(1, 200, (1, 12))
    order = torch.randperm(12)
    for positions, equivariant in ((False, True), (True, False)):
        model = paper_mlm_model(200, tied=True, position_embeddings=positions).eval()
        logits, permuted = model(input_ids=ids).logits, model(input_ids=ids[:, order]).logits
        assert torch.allclose(logits[:, order], permuted, atol=1e-5) is equivariant


def test_common_words_are_the_papers_hundred():
    assert len(COMMON_WORDS) == len(set(COMMON_WORDS)) == 100
    assert COMMON_WORDS[:3] == ("the", "be", "to") and COMMON_WORDS[-1] == "us"
