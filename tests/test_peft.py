"""PEFT: untie the base model before wrapping it works end to end; every other tie/untie under PEFT is refused early."""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers as tf
from packaging.version import Version

import untie
from untie.decision.plan import MERGE_RECORDS_THE_SPLIT
from untie.structure.peft_support import PeftUnsupported
from untie.testing import ToyLMDataset, tiny_model

peft = pytest.importorskip("peft")  # in the `test` extra: installed wherever the suite runs
LoraConfig, get_peft_model, PeftModel = peft.LoraConfig, peft.get_peft_model, peft.PeftModel

LORA = dict(target_modules=["c_attn"], r=4, lora_alpha=8, lora_dropout=0.0)
#: Whether the installed PEFT's merge_and_unload() writes tie_word_embeddings=False after modules_to_save split a tied
#: model (peft >= 0.19.0; 0.18 keeps True). The suite runs on the installed peft; CI's oldest run covers 0.18.
MERGE_RECORDS = Version(peft.__version__) >= Version(MERGE_RECORDS_THE_SPLIT)


def _trainer(model, make_args, **callback):
    return tf.Trainer(
        model=model,
        args=make_args(max_steps=6, learning_rate=1e-2),
        train_dataset=ToyLMDataset(),
        callbacks=[untie.UntieCallback(**callback)],
    )


def _wrap(base, **config):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft's own warnings about tied layers are what these tests are about
        return get_peft_model(base, LoraConfig(**{**LORA, **config}))


def test_untie_before_wrapping_trains_saves_merges_and_reloads(make_args, tmp_path):
    tiny_model("gpt2").save_pretrained(tmp_path / "pretrained")  # "an existing tied checkpoint"
    base = tf.GPT2LMHeadModel.from_pretrained(tmp_path / "pretrained")
    embedding_before = base.transformer.wte.weight.detach().clone()
    untie.untie_embeddings(base)
    model = _wrap(base, modules_to_save=["lm_head"])
    trainer = _trainer(model, make_args, untie_at=0)
    trainer.train()
    callback = next(c for c in trainer.callback_handler.callbacks if isinstance(c, untie.UntieCallback))
    assert callback.untied and callback.untie_step == 0 and callback.untie_reason == "start"
    trained_head = model.base_model.model.lm_head.modules_to_save["default"].weight.detach().clone()
    assert not torch.equal(trained_head, embedding_before), "the untied head did not train"
    assert torch.equal(base.transformer.wte.weight, embedding_before), "the frozen embedding moved"
    model.save_pretrained(tmp_path / "adapter")

    # Load the adapter onto a fresh base untied the same way, merge, save, reload with plain from_pretrained.
    fresh = tf.GPT2LMHeadModel.from_pretrained(tmp_path / "pretrained")
    untie.untie_embeddings(fresh)
    merged = PeftModel.from_pretrained(fresh, tmp_path / "adapter").merge_and_unload()
    assert torch.equal(merged.lm_head.weight, trained_head)
    merged.save_pretrained(tmp_path / "merged")
    reloaded = tf.GPT2LMHeadModel.from_pretrained(tmp_path / "merged")
    assert not untie.is_tied(reloaded)
    reloaded.tie_weights()
    reloaded.resize_token_embeddings(reloaded.config.vocab_size + 4, mean_resizing=False)
    assert torch.equal(reloaded.lm_head.weight[: trained_head.shape[0]], trained_head)
    assert torch.equal(reloaded.transformer.wte.weight[: trained_head.shape[0]], embedding_before)


def test_merged_onto_a_tied_base_keeps_the_trained_head(make_args, tmp_path):
    """The peft#2777 trap: an adapter's head merged onto a base whose config says tied.

    peft >= 0.21 clears `tie_word_embeddings` after such a merge; `untie.untie_embeddings(merged)` records the untie
    either way (nothing is copied), so the reload keeps the trained head through tie_weights().
    """
    base = tiny_model("gpt2")
    untie.untie_embeddings(base)
    model = _wrap(base, modules_to_save=["lm_head"])
    _trainer(model, make_args, untie_at=0).train()
    trained_head = model.base_model.model.lm_head.modules_to_save["default"].weight.detach().clone()
    model.save_pretrained(tmp_path / "adapter")

    tied_base = tiny_model("gpt2")  # forgot to untie: the config says tied
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        merged = PeftModel.from_pretrained(tied_base, tmp_path / "adapter").merge_and_unload()
    assert torch.equal(merged.lm_head.weight, trained_head) and not untie.is_tied(merged)
    with pytest.warns(UserWarning, match="already untied"):
        untie.untie_embeddings(merged)  # records the untie in the config; nothing is copied
    assert merged.config.tie_word_embeddings is False and untie.was_untied(merged)
    merged.save_pretrained(tmp_path / "merged")
    reloaded = tf.GPT2LMHeadModel.from_pretrained(tmp_path / "merged")
    reloaded.tie_weights()
    assert not untie.is_tied(reloaded) and torch.equal(reloaded.lm_head.weight, trained_head)


@pytest.mark.parametrize(
    "config, match",
    [
        (dict(), "cannot untie a PEFT model during training"),  # LoRA only: both matrices frozen and shared
        (dict(modules_to_save=["lm_head"], ensure_weight_tying=True), "cannot untie a PEFT model"),
        (dict(target_modules=["c_attn", "lm_head"], ensure_weight_tying=True), "cannot untie a PEFT model"),
        # trainable_token_indices on a tied model: PEFT ties the rows' deltas in both roles, the merge stays tied
        (dict(trainable_token_indices=[5, 6]), "PEFT keeps this model tied"),
        # peft 0.21 wraps only the embedding here, so the head stays the frozen original: untied against the setting
        (dict(modules_to_save=["transformer.wte"], ensure_weight_tying=True), r"ensure_weight_tying=True\) asks PEFT"),
    ],
)
def test_callback_refuses_peft_cases_when_the_trainer_is_built(config, match, make_args):
    if config.get("ensure_weight_tying") and config.get("modules_to_save") == ["lm_head"] and not MERGE_RECORDS:
        pytest.skip(f"peft {peft.__version__}'s get_peft_model raises AttributeError on this config (upstream)")
    model = _wrap(tiny_model("gpt2"), **config)
    with pytest.raises(PeftUnsupported, match=match) as error:
        _trainer(model, make_args)
    assert "untie.untie_embeddings(base_model)" in str(error.value)


def test_the_refusal_names_the_adapter_that_refuses():
    """A reviewer's note: under Untier, the PEFT refusal named UntieCallback (and told to train without it)."""
    with pytest.raises(PeftUnsupported, match=r"^Untier cannot untie a PEFT model.*train without Untier:"):
        untie.Untier(_wrap(tiny_model("gpt2")), max_steps=6)


def _copies(model) -> list[torch.Tensor]:
    """The trained copies PEFT's modules_to_save holds for the embedding and the head."""
    inner = model.base_model.model
    return [m.modules_to_save["default"].weight.detach().clone() for m in (inner.model.embed_tokens, inner.lm_head)]


def test_modules_to_save_on_both_tied_matrices_trains_untied_where_peft_merges_them_untied(make_args, tmp_path):
    """Issue 69: PEFT's modules_to_save gives each role of a tied model a trainable copy. From peft 0.19 the merge
    writes tie_word_embeddings=False, so both trained matrices survive tie_weights() and a reload: UntieCallback()
    accepts the model and says PEFT untied it. peft 0.18 keeps the flag, and the reload loses the trained head:
    refused, and the same run without the callback shows the loss it prevents."""
    base = tiny_model("qwen2")
    original = base.model.embed_tokens.weight.detach().clone()
    model = _wrap(base, target_modules=["q_proj"], modules_to_save=["embed_tokens", "lm_head"])
    if MERGE_RECORDS:
        trainer = _trainer(model, make_args)
        trainer.train()
        callback = next(c for c in trainer.callback_handler.callbacks if isinstance(c, untie.UntieCallback))
        assert "PEFT's modules_to_save gave the input embedding and the LM head" in callback.plan
        assert "this library has nothing to untie" in callback.plan and callback.untie_step == 0
    else:
        with pytest.raises(PeftUnsupported, match=f"peft {peft.__version__} keeps that declaration"):
            _trainer(model, make_args)
        tf.Trainer(model=model, args=make_args(max_steps=6, learning_rate=1e-2), train_dataset=ToyLMDataset()).train()
    embedding, head = _copies(model)
    assert not torch.equal(embedding, original) and not torch.equal(head, original) and not torch.equal(embedding, head)
    merged = model.merge_and_unload()
    assert (merged.config.tie_word_embeddings is False) == MERGE_RECORDS
    merged.tie_weights()  # what a later resize or trainer call does
    assert torch.equal(merged.lm_head.weight, head) == MERGE_RECORDS
    merged.save_pretrained(tmp_path / "merged")
    reloaded = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert torch.equal(reloaded.model.embed_tokens.weight, embedding)
    assert torch.equal(reloaded.lm_head.weight, head) == MERGE_RECORDS, "the trained head survives the reload"


def test_modules_to_save_on_a_multimodal_model_says_that_text_config_needs_the_untie_after_the_merge(make_args):
    """PEFT's merge writes the top-level flag only; Gemma 3's text_config keeps saying tied until untie records it."""
    if not MERGE_RECORDS:
        pytest.skip(f"peft {peft.__version__} < {MERGE_RECORDS_THE_SPLIT}: such a model is refused (test above)")
    config = untie.testing.tiny_gemma3_multimodal_config()
    torch.manual_seed(0)
    model = _wrap(tf.Gemma3ForConditionalGeneration(config), target_modules=["q_proj"],
                  modules_to_save=["embed_tokens", "lm_head"])  # fmt: skip
    with pytest.warns(UserWarning, match="text_config keeps tie_word_embeddings=True"):
        _trainer(model, make_args)
    merged = model.merge_and_unload()
    assert merged.config.tie_word_embeddings is False and merged.config.text_config.tie_word_embeddings is True
    with pytest.warns(UserWarning, match="already untied"):
        untie.untie_embeddings(merged)
    assert merged.config.text_config.tie_word_embeddings is False and not untie.is_tied(merged)


def test_an_untied_peft_model_stays_untied_as_without_peft_and_a_tie_is_refused(make_args):
    """Issue 59: an untied model trains untied under every default, wrapped by PEFT or not; only a tie asked for
    (tie_init) is refused, as PEFT cannot take it."""
    config = tiny_model("gpt2").config
    config.tie_word_embeddings = False  # an untied checkpoint (Pythia-like), not untied by this library
    model = _wrap(tf.GPT2LMHeadModel(config), modules_to_save=["lm_head"])
    with pytest.raises(PeftUnsupported, match="tie_init asks UntieCallback to tie it first"):
        _trainer(model, make_args, untie_at=0.5, tie_init="input")
    for settings in ({}, {"untie_at": 0.5}, {"untie_at": 0}):  # the default, a schedule, untied from the start
        trainer = _trainer(model, make_args, **settings)
        trainer.train()
        assert not untie.is_tied(model.base_model.model), settings


def test_untie_and_tie_refuse_peft_models_and_transformers_adapters():
    wrapped = _wrap(tiny_model("gpt2"))
    with pytest.raises(PeftUnsupported, match="before wrapping"):
        untie.untie_embeddings(wrapped)
    with pytest.raises(PeftUnsupported, match="Tie the base model before wrapping"):
        untie.tie_embeddings(wrapped)
    assert untie.is_tied(wrapped.base_model.model), "a refused call must leave the model as it was"


def _transformers_peft_floor() -> str | None:
    """The PEFT release transformers' own adapter API (`model.add_adapter`) requires, if the installed peft is older.

    transformers 5.24.0 raised `MIN_PEFT_VERSION` to 0.22.0 before peft released it, so `add_adapter` itself raises
    with every released peft: an upstream refusal, not this library's.
    """
    from packaging.version import Version
    from transformers.integrations import peft as hf_peft

    floor = hf_peft.MIN_PEFT_VERSION
    return floor if Version(peft.__version__) < Version(floor) else None


def _attach_adapter_as_transformers_does(model: tf.PreTrainedModel) -> None:
    """What `model.add_adapter(LoraConfig(...))` does, through peft's own API: inject the layers, record the config."""
    config = LoraConfig(**LORA)
    peft.inject_adapter_in_model(config, model, "default")
    model._hf_peft_config_loaded = True
    model.peft_config = {"default": config}


def test_untie_and_tie_refuse_transformers_adapters():
    """A transformers model with an adapter attached is refused like a PeftModel, and left as it was."""
    with_adapter = tiny_model("gpt2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _attach_adapter_as_transformers_does(with_adapter)
    for surgery in (untie.untie_embeddings, untie.tie_embeddings):
        with pytest.raises(PeftUnsupported, match="before wrapping"):
            surgery(with_adapter)
    assert untie.is_tied(with_adapter), "a refused call must leave the model as it was"


def test_untie_refuses_a_model_given_an_adapter_by_transformers_add_adapter():
    floor = _transformers_peft_floor()
    if floor is not None:
        pytest.skip(
            f"transformers {tf.__version__} requires peft >= {floor} for model.add_adapter (its MIN_PEFT_VERSION), "
            f"and peft {peft.__version__} is installed: upstream refuses add_adapter itself; "
            "test_untie_and_tie_refuse_transformers_adapters covers this library's side"
        )
    with_adapter = tiny_model("gpt2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with_adapter.add_adapter(LoraConfig(**LORA))
    with pytest.raises(PeftUnsupported):
        untie.untie_embeddings(with_adapter)
    assert untie.is_tied(with_adapter), "a refused call must leave the model as it was"


def test_a_base_untied_before_wrapping_is_said_to_arrive_untied(make_args):
    """Issue 67: the line of a PEFT model whose base was untied before wrapping said "the head starts as a copy of the
    embedding": its head is the base's own matrix, and nothing was copied."""
    base = tiny_model("gpt2")
    untie.untie_embeddings(base)
    trainer = _trainer(_wrap(base, modules_to_save=["lm_head"]), make_args)
    trainer.train()
    callback = next(c for c in trainer.callback_handler.callbacks if isinstance(c, untie.UntieCallback))
    assert callback.plan == "untie: trains untied from step 0; the model arrived untied: its head is its own matrix"
