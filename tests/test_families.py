"""Today's tied model families, tiny builds from config: Trainer with the callback, `untie inspect`, `untie convert`
both ways, PEFT merge, and a plain reload read the way serving engines read the tie (the text sub-config)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import transformers as tf

import untie
from untie.cli import main as cli
from untie.testing import ToyLMDataset, tiny_tokenizer

peft = pytest.importorskip("peft")  # in the `test` extra

VOCAB = 64
#: Token ids the toy data uses stay under this; multimodal builds put their image tokens above it.
TEXT_IDS = 48
_TEXT = dict(
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,  # grouped-query attention, as the real ones
    hidden_size=16,
    intermediate_size=32,
    vocab_size=VOCAB,
    max_position_embeddings=64,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def _vision() -> dict:
    return dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)


#: family -> a tied tiny model built from its config (every one is tied as its small checkpoints are).
FAMILIES = {
    "qwen3": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(**_TEXT, head_dim=8, tie_word_embeddings=True)),
    "llama-3.2": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**_TEXT, head_dim=8, tie_word_embeddings=True)),
    "smollm3": lambda: tf.SmolLM3ForCausalLM(tf.SmolLM3Config(**_TEXT, tie_word_embeddings=True)),
    "granite": lambda: tf.GraniteForCausalLM(tf.GraniteConfig(**_TEXT, tie_word_embeddings=True)),
    "olmo2": lambda: tf.Olmo2ForCausalLM(tf.Olmo2Config(**_TEXT, tie_word_embeddings=True)),
    "phi-4-mini": lambda: tf.Phi3ForCausalLM(
        tf.Phi3Config(**_TEXT, partial_rotary_factor=0.75, tie_word_embeddings=True)
    ),
    "gemma3-text": lambda: tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**_TEXT, head_dim=8)),
    "gemma3": lambda: tf.Gemma3ForConditionalGeneration(
        tf.Gemma3Config(
            text_config=dict(**_TEXT, head_dim=8),
            vision_config=dict(**_vision(), image_size=28, patch_size=14),
            mm_tokens_per_image=4,
            image_token_index=VOCAB - 1,
            boi_token_index=VOCAB - 2,
            eoi_token_index=VOCAB - 3,
        )
    ),
    "qwen2.5-vl": lambda: tf.Qwen2_5_VLForConditionalGeneration(
        tf.Qwen2_5_VLConfig(
            text_config=dict(**_TEXT, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}),
            vision_config=dict(
                depth=1,
                hidden_size=16,
                intermediate_size=32,
                num_heads=2,
                out_hidden_size=16,
                fullatt_block_indexes=[0],
                window_size=28,
                patch_size=14,
            ),  # fmt: skip
            image_token_id=VOCAB - 1,
            video_token_id=VOCAB - 2,
            vision_start_token_id=VOCAB - 3,
            tie_word_embeddings=True,
        )
    ),
}


def build(family: str, seed: int = 0) -> tf.PreTrainedModel:
    torch.manual_seed(seed)
    return FAMILIES[family]()


def served_as_tied(folder) -> bool:
    """What a serving engine reads: `tie_word_embeddings` of the text sub-config of the saved config.json (vLLM's
    loaders, for multimodal models too), falling back to the top level. Where the two levels disagree an engine may
    read either, so this fails on a disagreement."""
    config = json.loads((folder / "config.json").read_text())
    text = config.get("text_config") or {}
    top = config.get("tie_word_embeddings", True)
    assert "tie_word_embeddings" not in text or text["tie_word_embeddings"] == top, f"levels disagree: {config}"
    return bool(text.get("tie_word_embeddings", top))


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


IDS = torch.tensor([[1, 5, 9, 13, 17, 21, 25, 2]])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_inspect_and_convert_both_ways_keep_what_serving_reads(family, tmp_path, capsys):
    model = build(family)
    assert untie.is_tied(model), f"{family}: the tiny build should be tied, as its small checkpoints are"
    model.save_pretrained(tmp_path / "tied")
    assert cli(["inspect", str(tmp_path / "tied"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["status"] == "tied" and report["model_class"] == type(model).__name__

    assert cli(["convert", str(tmp_path / "tied"), str(tmp_path / "untied"), "--untie"]) == 0
    untied = type(model).from_pretrained(tmp_path / "untied")
    assert not untie.is_tied(untied) and not served_as_tied(tmp_path / "untied")
    assert torch.equal(untied.get_output_embeddings().weight, model.get_input_embeddings().weight)  # a copy
    assert torch.allclose(logits(untied, IDS), logits(model, IDS), atol=1e-5)

    assert cli(["convert", str(tmp_path / "untied"), str(tmp_path / "retied"), "--tie"]) == 0
    retied = type(model).from_pretrained(tmp_path / "retied")
    assert untie.is_tied(retied) and served_as_tied(tmp_path / "retied")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_trainer_with_the_callback_unties_mid_run_and_a_plain_reload_gives_the_trained_logits(
    family, make_args, tmp_path
):
    model = build(family)
    callback = untie.UntieCallback(untie_at=2, untie_when=None, policy="off")
    trainer = tf.Trainer(
        model=model,
        args=make_args(max_steps=4, learning_rate=1e-2, save_strategy="no"),
        train_dataset=ToyLMDataset(n=16, vocab=TEXT_IDS),
        callbacks=[callback],
    )
    trainer.train()
    assert callback.untied and callback.untie_step == 2
    head, embedding = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    assert not torch.equal(head, embedding), f"{family}: the two roles did not separate after the untie"
    model.save_pretrained(tmp_path / "out")
    assert not served_as_tied(tmp_path / "out")
    reloaded = type(model).from_pretrained(tmp_path / "out")  # plain transformers
    reloaded.tie_weights()  # what a later resize or a trainer does: must not re-tie
    assert torch.equal(reloaded.get_output_embeddings().weight, head.detach())
    assert (logits(reloaded, IDS) - logits(model, IDS)).abs().max() <= 1e-5


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_lora_with_the_head_on_an_untied_copy_merges_and_reloads_exactly(family, tmp_path):
    model = build(family)
    untie.untie_embeddings(model)
    attention = "qkv_proj" if family == "phi-4-mini" else "q_proj"  # Phi packs q, k and v in one projection
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=[attention], modules_to_save=["lm_head"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped = peft.get_peft_model(model, config)
    optimizer = torch.optim.AdamW([p for p in wrapped.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):
        wrapped(input_ids=IDS, labels=IDS).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    trained = logits(wrapped, IDS)
    merged = wrapped.merge_and_unload()
    merged.save_pretrained(tmp_path / "merged")
    assert not served_as_tied(tmp_path / "merged")
    reloaded = type(merged).from_pretrained(tmp_path / "merged")
    assert not untie.is_tied(reloaded)
    assert (logits(reloaded, IDS) - trained).abs().max() <= 1e-5


# ------------------------------------------------------------------------------------------------ new tokens, LoRA, TRL
NEW = [VOCAB, VOCAB + 1]  # the two tokens added to the vocabulary
#: A pattern whose next token after (5, 9) is the first new token, and after it the second.
PATTERN = torch.tensor([[1, 5, 9, NEW[0], 13, NEW[1], 17, 2]] * 4)


def _add_tokens_and_untie(family: str, folder) -> tf.PreTrainedModel:
    """A pretrained tied checkpoint, loaded; two new tokens, their rows started at the mean of the old ones
    (`mean_resizing`: a tied model resizes both roles at once); untied so their input and output rows can differ."""
    build(family).save_pretrained(folder)
    model = type(build(family)).from_pretrained(folder)
    model.resize_token_embeddings(VOCAB + len(NEW), mean_resizing=True)
    assert untie.is_tied(model)
    untie.untie_embeddings(model)
    return model


def _train(model, steps: int = 40, lr: float = 3e-2) -> None:
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    for _ in range(steps):
        model(input_ids=PATTERN, labels=PATTERN).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def _peft_config(route: str) -> peft.LoraConfig:
    if route.startswith("lora-modules-to-save"):  # LoRA, with the embedding and the head trained whole
        return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                               modules_to_save=["embed_tokens", "lm_head"],
                               ensure_weight_tying=route.endswith("ensure-weight-tying"))  # fmt: skip
    # PEFT's trainable tokens: only the new tokens' rows train, in each of the two (now separate) matrices
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                           trainable_token_indices={"embed_tokens": NEW, "lm_head": NEW})  # fmt: skip


ROUTES = ["full", "lora-modules-to-save", "lora-modules-to-save-ensure-weight-tying", "trainable-tokens"]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("family", ["qwen3", "gemma3-text", "llama-3.2"])
def test_new_tokens_on_a_tied_model_train_merge_and_reload_in_plain_transformers(family, route, tmp_path):
    """transformers#45127 / LlamaFactory#6446: new tokens on a tied model, trained, merged, reloaded. Untied first,
    the reload without `import untie` gives the trained logits and generates the new tokens."""
    model = _add_tokens_and_untie(family, tmp_path / "pretrained")
    if route != "full":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = peft.get_peft_model(model, _peft_config(route))
    _train(model)
    trained = logits(model, PATTERN[:1])
    merged = model if route == "full" else model.merge_and_unload()
    merged.save_pretrained(tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["vocab_size"] == VOCAB + len(NEW)

    reloaded = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "out")  # plain transformers
    assert (logits(reloaded, PATTERN[:1]) - trained).abs().max() <= 1e-5
    embedding, head = reloaded.get_input_embeddings().weight, reloaded.get_output_embeddings().weight
    assert not torch.equal(embedding[NEW], head[NEW])  # the new tokens' two roles differ
    generated = reloaded.generate(PATTERN[:1, :3], max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert generated[0, 3] == NEW[0] and NEW[1] in generated[0, 4:].tolist(), generated  # both new tokens


def test_lora_on_the_head_of_a_tied_model_through_trl_after_an_explicit_untie(tmp_path):
    """TRL's SFTTrainer(peft_config=...) wraps the model itself: untie it first, name the head (and the embedding) in
    modules_to_save, and the merged model reloads untied with the trained logits."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    model = build("qwen3")
    untie.untie_embeddings(model)  # before SFTTrainer wraps it
    data = Dataset.from_dict({"input_ids": [row.tolist() for row in ToyLMDataset(n=16, vocab=TEXT_IDS).ids]})
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=["embed_tokens", "lm_head"])
    args = trl.SFTConfig(output_dir=str(tmp_path / "run"), max_steps=3, learning_rate=1e-2, report_to="none",
                         per_device_train_batch_size=4, save_strategy="no", use_cpu=True, bf16=False)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=data, peft_config=config,
                                 processing_class=tiny_tokenizer())  # fmt: skip
    trainer.train()
    trained = logits(trainer.model, IDS)
    merged = trainer.model.merge_and_unload()
    merged.save_pretrained(tmp_path / "merged")
    assert not served_as_tied(tmp_path / "merged")
    reloaded = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert (logits(reloaded, IDS) - trained).abs().max() <= 1e-5
