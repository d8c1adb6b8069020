"""Bad input is refused early, naming the setting or the matrix and the fix (issue 78, item 5): a pair outside the
vocabulary at attach (not an IndexError at the first measurement), a fraction's max_steps only where a schedule is set,
a float8 embedding before torch's initialiser, and a frozen tied embedding's untie said."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

import untie
from untie.testing import tiny_model


@pytest.mark.parametrize("adapter", ["Untier", "UntieCallback"])
def test_a_pair_outside_the_vocabulary_is_refused_at_attach_naming_pairs(adapter, make_args):
    model = tiny_model("llama")  # 48 rows
    with pytest.raises(ValueError, match=r"pairs=\[\(3, 999\)\] holds token id\(s\) \[999\] outside .* \[0, 48\)"):
        if adapter == "Untier":
            untie.Untier(model, torch.optim.AdamW(model.parameters()), pairs=[(3, 999)], max_steps=10)
        else:
            callback = untie.UntieCallback(pairs=[(3, 999)])
            tf.Trainer(model=model, args=make_args(), train_dataset=[], callbacks=[callback])


def test_a_default_untier_needs_no_max_steps_and_a_model_that_cannot_tie_gets_its_own_refusal():
    model = tiny_model("llama")
    untier = untie.Untier(model)  # the default plan unties at step 0: no deadline to resolve
    assert untier.untie_step is None and not untie.is_tied(model)
    untier.close()
    body = tf.BertModel(
        tf.BertConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=32, vocab_size=48)
    )
    with pytest.raises(ValueError, match="has no output embeddings"):
        untie.Untier(body)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_a_float8_embedding_is_refused_before_anything_changes(dtype):
    model = tiny_model("llama")
    embedding = model.get_input_embeddings()
    embedding.weight.data = embedding.weight.data.to(dtype)
    with pytest.raises(ValueError, match=rf"input embedding is stored as {dtype} \(float8\).* bfloat16 or float32"):
        untie.Untier(model, max_steps=10)  # torch's initialiser failed inside the default's draw
    assert untie.is_tied(model)


def test_untying_a_frozen_tied_embedding_says_the_head_is_frozen_too():
    model = tiny_model("llama")
    model.get_input_embeddings().weight.requires_grad_(False)
    with pytest.warns(UserWarning, match=r"tied embedding is frozen \(requires_grad=False\).*requires_grad_\(True\)"):
        untie.Untier(model, from_scratch=False)  # a copy, untied at once
    head = model.get_output_embeddings().weight
    assert not untie.is_tied(model) and not head.requires_grad


def test_a_frozen_tied_embedding_untied_mid_run_is_said_at_the_untie():
    model = tiny_model("llama")
    model.get_input_embeddings().weight.requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters())  # AdamW skips the frozen matrix (no gradient)
    untier = untie.Untier(model, optimizer, untie_at=1, untie_when=None, metrics_every=0)
    batch = torch.arange(1, 17).view(2, 8)
    model(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()
    with pytest.warns(UserWarning, match="tied embedding is frozen"):
        untier.step()
    assert untier.untie_step == 1
