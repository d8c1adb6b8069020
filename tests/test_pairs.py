"""pairs="auto": case and word-start variants read from WordPiece, byte-level BPE and SentencePiece vocabularies."""

from __future__ import annotations

import gzip
import json

import pytest
import transformers as tf
from tokenizers import ByteLevelBPETokenizer, SentencePieceBPETokenizer

import untie
from untie.cli import main
from untie.signals.pairs import tokenizer_family, tokenizer_pairs
from untie.testing import ToyLMDataset
from untie_recipes.tasks.bookcorpus.data import OFFLINE_CORPUS, load_tokenizer

SHIPPED_TEXT = OFFLINE_CORPUS


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, tf.PreTrainedTokenizerBase]:
    """The shipped WordPiece vocabulary, and GPT-2-style byte-level BPE and SentencePiece BPE trained on its text."""
    lines = gzip.open(SHIPPED_TEXT, "rt", encoding="utf-8").read().splitlines()[:20000]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(lines, vocab_size=2000, min_frequency=2, show_progress=False)
    sentencepiece = SentencePieceBPETokenizer()
    sentencepiece.train_from_iterator(lines, vocab_size=2000, min_frequency=2, show_progress=False)
    return {
        "wordpiece": load_tokenizer("offline"),
        "byte-level-bpe": tf.GPT2TokenizerFast(tokenizer_object=bpe._tokenizer),
        "sentencepiece": tf.PreTrainedTokenizerFast(tokenizer_object=sentencepiece._tokenizer),
    }


def _bare(token: str) -> str:
    return token.removeprefix("Ġ").removeprefix("▁").removeprefix("##")


@pytest.mark.parametrize("family", ["wordpiece", "byte-level-bpe", "sentencepiece"])
def test_pairs_are_spelling_variants_of_one_word_most_frequent_first(family, tokenizers):
    tokenizer = tokenizers[family]
    vocab = tokenizer.get_vocab()
    assert tokenizer_family(vocab) == family
    pairs = tokenizer_pairs(tokenizer, limit=200)
    assert 100 <= len(pairs) <= 200
    special = set(tokenizer.all_special_ids)
    for pair in pairs:
        a, b = pair.tokens
        assert tuple(vocab[t] for t in pair.tokens) == pair.ids and a != b and not special & set(pair.ids)
        if pair.kind == "case":
            assert _bare(a).lower() == _bare(b).lower() and _bare(a) != _bare(b) and _bare(a).isalpha()
            assert a[: len(a) - len(_bare(a))] == b[: len(b) - len(_bare(b))]  # same word-start form
        else:
            assert _bare(a) == _bare(b) and len(_bare(a)) >= 2
    ranks = [max(p.ids) for p in pairs]
    assert ranks == sorted(ranks)  # the rarer member's id: most frequent pairs first
    assert len({tuple(sorted(p.ids)) for p in pairs}) == len(pairs)


def test_each_family_gives_the_variants_its_convention_has(tokenizers):
    kinds = {name: {p.kind for p in tokenizer_pairs(tok)} for name, tok in tokenizers.items()}
    assert kinds["wordpiece"] == {"word-start"}  # the shipped vocabulary is uncased
    assert kinds["byte-level-bpe"] == kinds["sentencepiece"] == {"case", "word-start"}
    tokens = {p.tokens for p in tokenizer_pairs(tokenizers["byte-level-bpe"], limit=1000)}
    assert ("Ġthe", "ĠThe") in tokens and ("Ġthe", "the") in tokens
    tokens = {p.tokens for p in tokenizer_pairs(tokenizers["sentencepiece"], limit=1000)}
    assert ("▁the", "▁The") in tokens
    tokens = {p.tokens for p in tokenizer_pairs(tokenizers["wordpiece"], limit=5000)}
    assert ("ing", "##ing") in tokens


def test_ids_beyond_the_model_are_left_out(tokenizers):
    pairs = tokenizer_pairs(tokenizers["byte-level-bpe"], max_id=600)
    assert pairs and all(max(p.ids) < 600 for p in pairs)


def test_callback_reads_the_pairs_from_the_trainers_tokenizer(tokenizers, make_args):
    tokenizer = tokenizers["byte-level-bpe"]
    vocab = len(tokenizer)
    model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=vocab, n_embd=16, n_layer=1, n_head=2, n_positions=64))
    callback = untie.UntieCallback(untie_at=None, untie_when=None, pairs="auto", metrics_every=2)
    data = ToyLMDataset(vocab=vocab)
    trainer = tf.Trainer(
        model=model,
        args=make_args(max_steps=4),
        train_dataset=data,
        data_collator=tf.default_data_collator,  # the toy batches need no padding
        processing_class=tokenizer,
        callbacks=[callback],
    )
    assert callback.pairs == [p.ids for p in tokenizer_pairs(tokenizer)]
    trainer.train()
    first = callback.pairs[0]
    assert f"gap/{first[0]}-{first[1]}" in callback.history[0]
    assert untie.UntieConfig.from_json(callback.config.to_json()).pairs == "auto"


@pytest.mark.parametrize("with_tokenizer", [True, False])
def test_the_default_reads_pairs_when_trainer_has_a_tokenizer(tokenizers, make_args, with_tokenizer, caplog):
    """The tied phase's defaults (`UntieCallback(policy="off")`, what `UntieCallback()` runs for a loaded model):
    pairs from Trainer's tokenizer and the evidence rule; without a tokenizer,
    no pairs and the pair-free rule, said at the default log level. A per-pair rule the user chose, with no
    tokenizer, is refused with the fix."""
    tokenizer = tokenizers["byte-level-bpe"]
    model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=len(tokenizer), n_embd=16, n_layer=1, n_head=2))
    callback = untie.UntieCallback(policy="off")
    with caplog.at_level("WARNING", logger="untie"):  # said at train begin, where a trigger runs
        _build_trainer(model, make_args, tokenizer if with_tokenizer else None, callback).train()
    if with_tokenizer:
        assert callback.pairs == [p.ids for p in tokenizer_pairs(tokenizer)]
        assert callback.rule == callback.divergence.rule == untie.RULES["evidence"]
        assert "pair-free rule" not in caplog.text
    else:
        assert callback.pairs == []
        assert callback.rule == callback.divergence.rule == untie.RULES["cancellation"]
        assert "reads no pairs: no tokenizer was given." in caplog.text and "processing_class=" in caplog.text
        with pytest.raises(ValueError, match="no tokenizer"):
            tf.Trainer(
                model=model,
                args=make_args(max_steps=4),
                train_dataset=ToyLMDataset(vocab=len(tokenizer)),
                callbacks=[untie.UntieCallback(untie_when="evidence")],
            )


def test_auto_pairs_without_a_tokenizer_name_the_fix(make_args):
    with pytest.raises(ValueError, match="processing_class=tokenizer"):
        tf.Trainer(
            model=tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=48, n_embd=16, n_layer=1, n_head=2)),
            args=make_args(),
            train_dataset=ToyLMDataset(),
            callbacks=[untie.UntieCallback(pairs="auto")],
        )


def test_inspect_pairs_auto(tokenizers, tmp_path, capsys):
    tokenizer = tokenizers["sentencepiece"]
    model = tf.LlamaForCausalLM(
        tf.LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            tie_word_embeddings=True,
        )
    )
    untie.untie_embeddings(model)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    assert main(["inspect", str(tmp_path), "--pairs", "auto", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    expected = tokenizer_pairs(tokenizer)
    assert report["pairs_from"].startswith(f"tokenizer: {len(expected)} ")
    first = "-".join(expected[0].tokens)
    assert report["pairs"][first]["ids"] == list(expected[0].ids)
    assert main(["inspect", str(tmp_path), "--pairs", "auto"]) == 0
    assert "the 10 most frequent" in capsys.readouterr().out


def test_the_default_says_when_the_tokenizer_gives_no_pairs(make_args, caplog):
    """A tokenizer without case or word-start variants: the default changes to the pair-free rule and says why at
    the default log level, naming what it could not read."""
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(59)]
    tokenizer = tf.BertTokenizer(vocab={word: i for i, word in enumerate(words)})
    model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=len(words), n_embd=16, n_layer=1, n_head=2))
    callback = untie.UntieCallback(policy="off")  # the tied phase's defaults
    with caplog.at_level("WARNING", logger="untie"):  # said at train begin, where a trigger runs
        _build_trainer(model, make_args, tokenizer, callback).train()
    assert callback.pairs == [] and callback.rule == untie.RULES["cancellation"]
    assert f"no case or word-start variants among the model's {len(words)} embedding rows" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="untie"):  # the rule chosen by name: nothing to say
        _build_trainer(model, make_args, tokenizer, untie.UntieCallback(untie_when="cancellation")).train()
    assert "pair-free rule" not in caplog.text


def _build_trainer(model, make_args, tokenizer, callback) -> tf.Trainer:
    """A 4-step Trainer on random tokens of the model's vocabulary, with `tokenizer` as its processing_class."""
    vocab = model.get_input_embeddings().weight.shape[0]
    return tf.Trainer(
        model=model,
        args=make_args(max_steps=4),
        train_dataset=ToyLMDataset(vocab=vocab),
        processing_class=tokenizer,
        data_collator=tf.default_data_collator,  # equal-length rows: no padding (some tokenizers have no pad token)
        callbacks=[callback],
    )
