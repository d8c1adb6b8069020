"""Model and optimizer surgery: untie/tie on every supported architecture, save/reload, bad input."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import transformers as tf
from safetensors import safe_open
from torch import nn

import untie
from untie.structure.surgery import add_param_like
from untie.testing import TINY_MODELS, ToyLMDataset, tiny_model

ARCHS = sorted(TINY_MODELS)


def _train_a_little(model, steps=3, seed=0):
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = ToyLMDataset(n=8)
    batch = {"input_ids": data.ids, "labels": data.ids.clone()}
    for _ in range(steps):
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad()


def _trainable_state(model):
    """Every saved tensor except frozen bias aliases (BERT's `cls.predictions.bias`, which forward never reads)."""
    aliases = set(untie.embedding_layout(model).bias_aliases)
    return {k: v.detach().clone() for k, v in model.state_dict().items() if k not in aliases}


@pytest.mark.parametrize("arch", ARCHS)
def test_untie_copies_shared_matrix_exactly(arch):
    model = tiny_model(arch)
    assert untie.is_tied(model)
    shared = model.get_input_embeddings().weight.detach().clone()
    untie.untie_embeddings(model)
    head, emb = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    assert not untie.is_tied(model)
    assert head is not emb and head.data_ptr() != emb.data_ptr()
    assert torch.equal(head, shared) and torch.equal(emb, shared)
    assert head.requires_grad


@pytest.mark.parametrize("arch", ARCHS)
def test_untied_model_survives_save_reload_tie_weights_and_resize(arch, tmp_path):
    model = tiny_model(arch)
    untie.untie_embeddings(model)
    _train_a_little(model)
    layout = untie.embedding_layout(model)
    saved = _trainable_state(model)
    assert not torch.equal(saved[layout.output_weight], saved[layout.input_weight])
    model.save_pretrained(tmp_path)

    reloaded = type(model).from_pretrained(tmp_path)
    assert not untie.is_tied(reloaded)
    assert untie.was_untied(reloaded)
    untie.untie_embeddings(reloaded)  # re-applies the bookkeeping a reload loses (a no-op on the values)
    reloaded.tie_weights()
    reloaded.resize_token_embeddings(reloaded.get_input_embeddings().weight.shape[0])
    assert not untie.is_tied(reloaded)
    after = _trainable_state(reloaded)
    for key in (layout.input_weight, layout.output_weight, layout.output_bias):
        if key is not None:
            assert torch.equal(after[key], saved[key]), key
    assert all(torch.equal(after[k], v) for k, v in saved.items())


@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "t5"])
def test_plain_reload_needs_no_untie_call(arch, tmp_path):
    """Where the config flag can record the untie, a plain from_pretrained + tie_weights/resize stays untied."""
    model = tiny_model(arch)
    untie.untie_embeddings(model)
    _train_a_little(model)
    saved = _trainable_state(model)
    model.save_pretrained(tmp_path)
    reloaded = type(model).from_pretrained(tmp_path)
    reloaded.tie_weights()
    reloaded.resize_token_embeddings(reloaded.get_input_embeddings().weight.shape[0])
    assert not untie.is_tied(reloaded)
    assert all(torch.equal(_trainable_state(reloaded)[k], v) for k, v in saved.items())


def test_an_untied_bart_saves_its_embeddings_as_equal_copies_and_untie_shares_them_again(tmp_path):
    """BART's flag also ties the encoder/decoder embeddings to `shared`; it is saved False anyway (so plain
    transformers cannot re-tie the head), with all three embeddings stored equal; untie_embeddings re-shares them."""
    model = tiny_model("bart")
    untie.untie_embeddings(model)
    _train_a_little(model)
    assert model.model.encoder.embed_tokens.weight is model.model.shared.weight  # one matrix while training
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] is False
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys() if k.endswith(("shared.weight", "embed_tokens.weight"))}
    assert len(stored) == 3 and all(torch.equal(t, stored["model.shared.weight"]) for t in stored.values())
    plain = type(model).from_pretrained(tmp_path)
    assert plain.model.encoder.embed_tokens.weight is not plain.model.shared.weight  # upstream: loaded apart, equal
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # re-sharing equal copies is silent
        untie.untie_embeddings(plain)
    shared = plain.model.shared.weight
    assert plain.model.encoder.embed_tokens.weight is shared and plain.model.decoder.embed_tokens.weight is shared
    assert torch.equal(plain.lm_head.weight, model.lm_head.weight) and not untie.is_tied(plain)
    untie.tie_embeddings(plain)  # re-tying gives the plain BART structure and flag back
    assert untie.is_tied(plain) and plain.config.tie_word_embeddings is True
    plain.save_pretrained(tmp_path / "tied")
    assert untie.is_tied(type(model).from_pretrained(tmp_path / "tied"))


def test_untie_leaves_embeddings_trained_apart_with_a_warning(tmp_path):
    model = tiny_model("bart")
    untie.untie_embeddings(model)
    model.save_pretrained(tmp_path)
    plain = type(model).from_pretrained(tmp_path)
    with torch.no_grad():
        plain.model.encoder.embed_tokens.weight.add_(0.1)  # fine-tuned apart with plain transformers
    with pytest.warns(UserWarning, match="differs from model.shared.weight"):
        untie.untie_embeddings(plain)
    assert plain.model.encoder.embed_tokens.weight is not plain.model.shared.weight


def test_upstream_reties_reloaded_t5_without_untie_call(tmp_path):
    """Known upstream behaviour (transformers 5.23): T5's config forces `tie_word_embeddings=True` on load (a saved
    False becomes `scale_decoder_outputs=False`), so a plain reload followed by `tie_weights()` re-ties the head.
    untie.untie_embeddings() after the reload (or UntieCallback, which calls it) prevents it; see test above. This test
    fails when upstream changes."""
    model = tiny_model("t5")
    untie.untie_embeddings(model)
    _train_a_little(model)
    model.save_pretrained(tmp_path)
    reloaded = type(model).from_pretrained(tmp_path)
    assert not untie.is_tied(reloaded)
    reloaded.tie_weights()
    assert untie.is_tied(reloaded)


@pytest.mark.parametrize("arch", ["gpt2", "bert", "t5"])
@pytest.mark.parametrize("init", ["input", "output", "mean"])
def test_tie_embeddings_init_modes_save_and_reload_tied(arch, init, tmp_path):
    model = tiny_model(arch)
    untie.untie_embeddings(model)
    _train_a_little(model)
    layout = untie.embedding_layout(model)
    w_in = model.get_input_embeddings().weight.detach().clone()
    w_out = model.get_output_embeddings().weight.detach().clone()
    bias = model.get_parameter(layout.output_bias).detach().clone() if layout.output_bias else None
    expected = {"input": w_in, "output": w_out, "mean": (w_in + w_out) / 2}[init]

    untie.tie_embeddings(model, init=init)
    assert untie.is_tied(model)
    assert torch.equal(model.get_input_embeddings().weight, expected)
    if bias is not None:
        assert torch.equal(model.get_parameter(layout.output_bias), bias), "trained output bias lost on tie"
    model.save_pretrained(tmp_path)
    reloaded = type(model).from_pretrained(tmp_path)
    assert untie.is_tied(reloaded)
    assert not untie.was_untied(reloaded)
    assert torch.equal(reloaded.get_input_embeddings().weight, expected)
    if bias is not None:
        assert torch.equal(reloaded.get_parameter(layout.output_bias), bias)


@pytest.mark.parametrize("state", ["copy", "reset", "fresh"])
def test_optimizer_gets_head_in_same_group_and_scheduler_keeps_working(state):
    model = tiny_model("gpt2")
    decay = [p for n, p in model.named_parameters() if p.ndim > 1]
    no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    _step(model, opt, sched)
    shared = model.get_input_embeddings().weight
    untie.untie_embeddings(model, opt, optimizer_state=state)
    head = model.get_output_embeddings().weight
    assert any(p is head for p in opt.param_groups[0]["params"])
    assert len(opt.param_groups) == 2
    if state == "copy":
        for key, value in opt.state[shared].items():
            assert torch.equal(opt.state[head][key], value) and opt.state[head][key] is not value
    else:
        assert head not in opt.state
    assert (shared in opt.state) == (state != "fresh")  # "fresh": the embedding's moments restart too
    order = {id(p): i for i, (_, p) in enumerate(model.named_parameters())}
    assert [order[id(p)] for p in opt.param_groups[0]["params"]] == sorted(order[id(p)] for p in decay + [head])
    _step(model, opt, sched)  # torch >= 2.13 schedulers raise here after add_param_group
    assert head.grad is None and int(opt.state[head]["step"]) == (2 if state == "copy" else 1)
    assert int(opt.state[shared]["step"]) == (1 if state == "fresh" else 2)


def test_copy_takes_adafactors_factored_moments_and_quantised_state():
    model = tiny_model("gpt2")
    opt = tf.optimization.Adafactor(model.parameters(), lr=1e-3, relative_step=False, scale_parameter=False)
    _step(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))
    shared = model.get_input_embeddings().weight
    assert {"exp_avg_sq_row", "exp_avg_sq_col"} <= set(opt.state[shared])  # (V,) and (d,): not the matrix's shape
    untie.untie_embeddings(model, opt, optimizer_state="copy")
    head = model.get_output_embeddings().weight
    for key, value in opt.state[shared].items():
        copied = opt.state[head][key]
        assert (torch.equal(copied, value) and copied is not value) if torch.is_tensor(value) else copied == value

    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters())
    shared = model.get_input_embeddings().weight
    codes = torch.randint(0, 256, shared.shape, dtype=torch.uint8)  # quantised state: copied bit for bit too
    opt.state[shared] = {"step": torch.tensor(3.0), "state1": codes, "absmax1": torch.rand(3), "bits": [8]}
    untie.untie_embeddings(model, opt, optimizer_state="copy")
    copied = opt.state[model.get_output_embeddings().weight]
    assert copied.keys() == opt.state[shared].keys() and copied["bits"] == [8]
    assert copied["bits"] is not opt.state[shared]["bits"]
    for key in ("step", "state1", "absmax1"):
        assert torch.equal(copied[key], opt.state[shared][key]) and copied[key] is not opt.state[shared][key]


def _step(model, opt, sched):
    batch = ToyLMDataset(n=4)[0]
    model(input_ids=batch["input_ids"][None], labels=batch["labels"][None]).loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad()


def test_add_param_like_refuses_a_param_outside_the_optimizer():
    model = tiny_model("gpt2")
    opt = torch.optim.SGD([model.transformer.h[0].mlp.c_fc.weight], lr=0.1)
    with pytest.raises(ValueError, match="not in the optimizer"):
        untie.untie_embeddings(model, opt)
    with pytest.raises(ValueError, match="not in the optimizer"):
        add_param_like(opt, new=nn.Parameter(torch.zeros(1)), like=nn.Parameter(torch.zeros(1)))


# ----------------------------------------------------------------------------------------------------------- bad input


def test_model_without_output_embeddings_is_refused():
    from transformers import GPT2Model

    model = GPT2Model(TINY_MODELS["gpt2"][0]())
    with pytest.raises(ValueError, match="no output embeddings.*AutoModelForCausalLM"):
        untie.untie_embeddings(model)
    with pytest.raises(ValueError, match="no output embeddings"):
        untie.is_tied(model)


def test_non_hf_module_is_refused_with_unwrap_hint():
    with pytest.raises(TypeError, match="unwrap"):
        untie.is_tied(nn.Linear(2, 2))


def test_tying_mismatched_shapes_is_refused():
    model = tiny_model("gpt2")
    untie.untie_embeddings(model)
    model.lm_head = nn.Linear(16, 40, bias=False)
    with pytest.raises(ValueError, match=r"shape \(48, 16\).*shape \(40, 16\).*resize_token_embeddings"):
        untie.tie_embeddings(model)


def test_untying_an_untied_model_warns_and_changes_nothing():
    model = tiny_model("gpt2")
    model.lm_head.weight = nn.Parameter(torch.randn_like(model.lm_head.weight))  # a user's own untied head
    head = model.lm_head.weight
    with pytest.warns(UserWarning, match="already untied.*Nothing was copied"):
        untie.untie_embeddings(model)
    assert model.lm_head.weight is head


def test_tying_a_tied_model_warns():
    with pytest.warns(UserWarning, match="already tied"):
        untie.tie_embeddings(tiny_model("gpt2"))


def test_unknown_init_and_state_choices_are_refused():
    model = tiny_model("gpt2")
    untie.untie_embeddings(model)
    with pytest.raises(ValueError, match="init='avg' is not one of"):
        untie.tie_embeddings(model, init="avg")
    with pytest.raises(ValueError, match="optimizer_state='zeros' is not one of"):
        untie.untie_embeddings(tiny_model("gpt2"), optimizer_state="zeros")


def test_the_untie_never_changes_the_config_object_the_model_was_built_from():
    """A second model built from the same config (or a model_init that closes over it) must come out as the first
    did: the untie gives the model a config of its own, and every module that held the old one holds the copy."""

    config = tf.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=48, n_positions=64, bos_token_id=0,
                           eos_token_id=0)  # fmt: skip
    first = tf.GPT2LMHeadModel(config)
    untie.untie_embeddings(first)
    assert config.tie_word_embeddings is True and not hasattr(config, "untied_output_embeddings")
    assert first.config.tie_word_embeddings is False and first.transformer.config is first.config
    assert untie.is_tied(tf.GPT2LMHeadModel(config))  # before: built untied, silently
    untie.tie_embeddings(first)
    assert config.tie_word_embeddings is True and first.config is not config


def test_a_multimodal_untie_leaves_the_text_sub_config_it_was_built_from_alone():
    config = untie.testing.tiny_gemma3_multimodal_config()
    text = config.text_config
    model = tf.Gemma3ForConditionalGeneration(config)
    untie.untie_embeddings(model)
    assert text.tie_word_embeddings is True and model.config.text_config.tie_word_embeddings is False
    assert model.model.language_model.config is model.config.text_config


def test_a_model_init_that_closes_over_one_config_trains_the_same_schedule_on_every_train(make_args):
    """Trainer's hyperparameter search calls model_init once per train(): each model must start tied."""

    config = tf.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=48, n_positions=64, bos_token_id=0,
                           eos_token_id=0)  # fmt: skip
    steps = []
    for _ in range(2):
        callback = untie.UntieCallback(untie_at=2, untie_when=None, policy="off")
        trainer = tf.Trainer(model_init=lambda: tf.GPT2LMHeadModel(config), args=make_args(max_steps=4),
                             train_dataset=ToyLMDataset(n=16), callbacks=[callback])  # fmt: skip
        trainer.train()
        steps.append((callback.untie_step, callback.untie_reason))
    assert steps == [(2, "deadline"), (2, "deadline")] and config.tie_word_embeddings is True
