"""The EXor data generator and models, pinned to the paper's code (paper.md section 1)."""

from __future__ import annotations

import collections

import pytest
import torch
import transformers as tf

import untie
from untie_recipes.tasks.exor import ExorDataset, exor_model, exor_splits, vocabulary
from untie_recipes.tasks.exor.modeling import ExorForMaskedLM

pytestmark = pytest.mark.recipes  # a test of recipes/, scripts/ or the docs' tables (pytest -m 'not recipes')


def _draw(variant: str, n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    data = ExorDataset("train", variant, seed=seed, repeats=n)
    return data.draw(list(range(len(data))))


def test_split_is_the_papers_fixed_split():
    splits = exor_splits()
    assert [len(splits[s]) for s in ("train", "heldout", "test")] == [114, 12, 1]
    everything = [s for part in splits.values() for s in part]
    assert len(set(everything)) == 127 and (1,) * 7 not in everything  # the paper's off-by-one drops all-ones
    # The paper's note gives the training bit counts: 402 zeros and 396 ones.
    bits = collections.Counter(b for s in splits["train"] for b in s)
    assert (bits[0], bits[1]) == (402, 396)
    assert splits["test"] == [(0, 0, 0, 1, 1, 0, 1)]
    assert exor_splits() == splits  # fixed: Random(14), independent of any run seed


@pytest.mark.parametrize("variant", ["main", "ydh", "ndh"])
def test_sequences_carry_parity_and_one_masked_bit(variant):
    vocab = vocabulary(variant)
    data = ExorDataset("train", variant, seed=3, repeats=4)
    batch = data.draw(list(range(len(data))))
    ids, labels = batch["input_ids"], batch["labels"]
    assert ids.shape == labels.shape == (len(data), 8) and vocab.size == 7
    bits = data.bits.repeat(4, 1)
    parity = torch.where(bits.sum(-1) % 2 == 1, vocab.odd, vocab.even)
    assert torch.equal(ids[:, -1], parity)  # the label symbol is last and never masked
    assert ((labels != -100).sum(-1) == 1).all() and (labels[:, -1] == -100).all()
    masked = (ids == vocab.mask).nonzero()
    assert torch.equal(masked[:, 0], torch.arange(len(ids)))  # exactly one [MASK] per row
    targets = labels[labels != -100]
    masked_bits = bits[masked[:, 0], masked[:, 1]]
    # The target is the surface form of the hidden bit; every other position shows a form of its own bit.
    assert all((t in vocab.one_forms) == bool(b) for t, b in zip(targets.tolist(), masked_bits.tolist(), strict=True))
    visible = ids[:, :-1] != vocab.mask
    shown_ones = torch.isin(ids[:, :-1], torch.tensor(list(vocab.one_forms)))
    assert torch.equal(shown_ones[visible], bits.bool()[visible])


@pytest.mark.parametrize(
    "variant, zero_share, one_share",
    [("main", 0.1, 0.5), ("ydh", 1.0, 0.5), ("ndh", 1.0, 0.1)],
)
def test_surface_form_frequencies(variant, zero_share, one_share):
    batch = _draw(variant, 200)
    forms = torch.where(batch["labels"] != -100, batch["labels"], batch["input_ids"])[:, :-1].flatten()
    counts = torch.bincount(forms, minlength=4).double()
    assert abs(counts[0] / counts[:2].sum() - zero_share) < 0.01  # first zero form
    assert abs(counts[2] / counts[2:4].sum() - one_share) < 0.01  # first one form
    if variant != "main":
        assert counts[1] == 0  # symbol 1 never occurs where zero_dst is [1, 0]


def test_masked_position_is_uniform_over_the_bits():
    batch = _draw("main", 300)
    positions = (batch["labels"] != -100).nonzero()[:, 1]
    share = torch.bincount(positions, minlength=8).double() / len(positions)
    assert share[7] == 0 and (share[:7] - 1 / 7).abs().max() < 0.01


def test_forms_are_redrawn_on_every_read_and_reproducible_from_the_seed():
    first, again = ExorDataset(seed=5), ExorDataset(seed=5)
    reads = [first.__getitems__(list(range(114))) for _ in range(2)]
    assert not all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(*reads, strict=True))
    replay = again.__getitems__(list(range(114)))
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(reads[0], replay, strict=True))
    assert set(first[0]) == {"input_ids", "labels"} and first[0]["input_ids"].shape == (8,)


def test_bayes_ceilings_match_the_paper():
    assert vocabulary("main").bayes_accuracy() == pytest.approx(0.70)
    assert vocabulary("ydh").bayes_accuracy() == pytest.approx(0.75)
    assert vocabulary("ndh").bayes_accuracy() == pytest.approx(0.95)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="Unknown EXor variant 'xor'"):
        ExorDataset(variant="xor")
    with pytest.raises(ValueError, match="Unknown EXor split"):
        ExorDataset("validation")
    with pytest.raises(ValueError, match="Unknown EXor model"):
        exor_model("gru", tied=True)


def test_transformer_has_the_papers_parameter_counts_and_shared_init():
    torch.manual_seed(0)
    tied = exor_model("transformer", tied=True)
    torch.manual_seed(0)
    untied = exor_model("transformer", tied=False)
    assert sum(p.numel() for p in untied.parameters()) == 192  # the paper's 192 untied / 164 tied
    assert sum(p.numel() for p in tied.parameters()) == 164
    assert untie.is_tied(tied) and not untie.is_tied(untied)
    assert untied.get_output_embeddings().bias is None
    # Same seed, same input table: the tied arm differs from the untied one only by the tie.
    assert torch.equal(tied.embed_tokens.weight, untied.embed_tokens.weight)


@pytest.mark.parametrize("body", ["transformer", "lstm", "mixer"])
def test_models_untie_save_and_reload(body, tmp_path):
    torch.manual_seed(0)
    model = exor_model(body, tied=True)
    batch = ExorDataset(seed=0).draw(list(range(16)))
    loss = model(**batch).loss
    assert loss.ndim == 0 and torch.isfinite(loss)
    untie.untie_embeddings(model)
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    model.save_pretrained(tmp_path)
    reloaded = ExorForMaskedLM.from_pretrained(tmp_path)
    assert not untie.is_tied(reloaded)
    assert torch.equal(reloaded.lm_head.weight, model.lm_head.weight)
    assert torch.equal(reloaded.embed_tokens.weight, model.embed_tokens.weight)
    model.eval(), reloaded.eval()
    assert torch.equal(reloaded(**batch).logits, model(**batch).logits)


def test_model_trains_with_trainer(make_args):
    torch.manual_seed(0)
    model = exor_model("transformer", tied=True)
    args = make_args(max_steps=3, per_device_train_batch_size=114)
    trainer = tf.Trainer(model=model, args=args, train_dataset=ExorDataset(seed=0))
    trainer.train()
    assert trainer.state.global_step == 3 and untie.is_tied(model)
