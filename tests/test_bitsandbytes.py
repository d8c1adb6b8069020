"""8-bit optimizers (bitsandbytes, CPU): the untied head gets an exact copy of the shared matrix's quantised state
and its per-parameter precision override, and Trainer runs with bitsandbytes untie, resume and reload.

They need bitsandbytes >= 0.50 (`pip install -e ".[bitsandbytes]"`, Linux x86-64) and are skipped without it,
except where UNTIE_REQUIRE_BITSANDBYTES is set (CI's bitsandbytes step), where a missing bitsandbytes fails them.
"""

from __future__ import annotations

import os

import pytest
import torch
import transformers as tf
from conftest import assert_reloads_untied, assert_resumed_equals, training_args

import untie
from untie.engines.emulation import EmulatedTying
from untie.testing import ToyLMDataset, tiny_model

if os.environ.get("UNTIE_REQUIRE_BITSANDBYTES"):
    import bitsandbytes as bnb
else:
    bnb = pytest.importorskip("bitsandbytes")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # bitsandbytes warns that paging is CUDA-only

EIGHT_BIT = ["AdamW8bit", "PagedAdamW8bit", "Lion8bit"]


@pytest.fixture(autouse=True)
def fresh_override_manager():
    """bitsandbytes keeps per-parameter overrides in a process-wide singleton: give every test an empty one."""
    manager = bnb.optim.GlobalOptimManager.get_instance()
    manager.initialize()
    yield manager
    manager.initialize()


def _train(model, optimizer, steps: int) -> None:
    ids = ToyLMDataset(n=8).ids
    for _ in range(steps):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def _step_with_gradient(optimizer, grads: dict) -> None:
    """One optimizer step in which only the given parameters have a gradient."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = grads.get(param)
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.parametrize("optimizer_name", EIGHT_BIT)
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_untie_copies_the_quantised_state_exactly_so_the_fork_is_smooth(arch, optimizer_name):
    model = tiny_model(arch)
    optimizer = getattr(bnb.optim, optimizer_name)(model.parameters(), lr=1e-2, min_8bit_size=16)
    _train(model, optimizer, 3)
    shared = model.get_input_embeddings().weight
    assert optimizer.state[shared]["state1"].dtype == torch.uint8  # quantised moments, per-block scales
    untie.untie_embeddings(model, optimizer, optimizer_state="copy")
    head = model.get_output_embeddings().weight
    assert head is not shared and optimizer.state[head].keys() == optimizer.state[shared].keys()
    for key, value in optimizer.state[shared].items():
        copied = optimizer.state[head][key]
        if torch.is_tensor(value):
            assert copied.dtype == value.dtype and torch.equal(copied, value), key
            assert copied.data_ptr() != value.data_ptr(), key
        else:
            assert copied == value, key
    # Same values, same state, same gradient: the head and the embedding take the same 8-bit step. A fresh state
    # (or a copy that lost the block scales) would step differently.
    gradient = torch.randn(shared.shape, generator=torch.Generator().manual_seed(0))
    before = shared.detach().clone()
    _step_with_gradient(optimizer, {shared: gradient.clone(), head: gradient.clone()})
    assert not torch.equal(shared, before) and torch.equal(head, shared)
    _train(model, optimizer, 2)  # and trains on, each matrix its own way
    assert not torch.equal(head, shared) and torch.isfinite(head).all()


def test_reset_state_starts_the_head_fresh_in_8_bits():
    model = tiny_model("gpt2")
    optimizer = bnb.optim.AdamW8bit(model.parameters(), lr=1e-2, min_8bit_size=16)
    _train(model, optimizer, 2)
    untie.untie_embeddings(model, optimizer, optimizer_state="reset")
    head = model.get_output_embeddings().weight
    assert head not in optimizer.state
    _train(model, optimizer, 1)
    assert optimizer.state[head]["step"] == 1 and optimizer.state[head]["state1"].dtype == torch.uint8


@pytest.mark.parametrize("steps_before", [0, 2], ids=["untie-before-the-first-step", "untie-after-two-steps"])
def test_the_head_keeps_the_embeddings_precision_override(steps_before, fresh_override_manager):
    """Trainer asks bitsandbytes for 32-bit state on every nn.Embedding; the head forked from it (an nn.Linear) gets
    the same override, so even a fresh head state is 32-bit, and the position-keyed overrides follow the reordered
    groups: the optimizer is built over the parameters in reverse so that sorting them moves every one."""
    model = tiny_model("gpt2")
    embedding = model.get_input_embeddings()
    fresh_override_manager.register_module_override(embedding, "weight", {"optim_bits": 32})
    optimizer = bnb.optim.AdamW8bit(list(model.parameters())[::-1], lr=1e-2, min_8bit_size=16)
    _train(model, optimizer, steps_before)
    untie.untie_embeddings(model, optimizer, optimizer_state="reset")
    _train(model, optimizer, 1)
    head = model.get_output_embeddings().weight
    assert optimizer.state[embedding.weight]["state1"].dtype == torch.float32
    assert optimizer.state[head]["state1"].dtype == torch.float32
    assert optimizer.state[model.transformer.h[0].mlp.c_fc.weight]["state1"].dtype == torch.uint8
    group = optimizer.param_groups[0]
    bits = {id(p): optimizer.get_config(0, i, group)["optim_bits"] for i, p in enumerate(group["params"])}
    expected = {id(p): 32 if p is embedding.weight or p is head else 8 for p in group["params"]}
    assert bits == expected
    for group_index, param_index in fresh_override_manager.index2config:
        param = optimizer.param_groups[group_index]["params"][param_index]
        assert param is embedding.weight or param is head, "a stale override points at another parameter"


@pytest.mark.parametrize("optimizer_state", ["copy", "reset", "fresh"])
def test_emulated_tying_releases_the_head_with_the_embeddings_state_and_precision(
    optimizer_state, fresh_override_manager
):
    """Emulated tying (the FSDP2 path): the head had no state while tied; on release it gets a copy of the
    embedding's 32-bit state, or fresh state that is 32-bit too, not the 8-bit default of an nn.Linear."""
    model = untie.untie_embeddings(tiny_model("gpt2"))
    emulation = EmulatedTying(model)
    embedding = model.get_input_embeddings()
    fresh_override_manager.register_module_override(embedding, "weight", {"optim_bits": 32})
    optimizer = bnb.optim.AdamW8bit(model.parameters(), lr=1e-2, min_8bit_size=16)
    emulation.attach_optimizer(optimizer)
    _train(model, optimizer, 2)
    head = model.get_output_embeddings().weight
    assert head not in optimizer.state and torch.equal(head, embedding.weight)
    emulation.release(optimizer, optimizer_state=optimizer_state)
    if optimizer_state == "copy":
        assert torch.equal(optimizer.state[head]["state2"], optimizer.state[embedding.weight]["state2"])
    _train(model, optimizer, 1)
    assert optimizer.state[head]["state1"].dtype == torch.float32
    assert optimizer.state[head]["step"] == (3 if optimizer_state == "copy" else 1)
    assert optimizer.state[embedding.weight]["step"] == (1 if optimizer_state == "fresh" else 3)  # restarted, 32-bit
    assert optimizer.state[embedding.weight]["state1"].dtype == torch.float32


def _wider_gpt2() -> tf.GPT2LMHeadModel:
    """A GPT-2 whose matrices have >= 4,096 elements, bitsandbytes' default threshold for 8-bit state."""
    torch.manual_seed(0)
    config = tf.GPT2Config(vocab_size=96, n_positions=32, n_embd=64, n_layer=2, n_head=4, tie_word_embeddings=True)
    return tf.GPT2LMHeadModel(config)


def _run(tmp_path, optimizer_setup: dict, resume: str | None = None) -> tf.Trainer:
    args = training_args(tmp_path / "run", save_strategy="steps", save_steps=4, max_steps=10, **optimizer_setup["args"])
    trainer = tf.Trainer(
        model=_wider_gpt2(),
        args=args,
        train_dataset=ToyLMDataset(vocab=96),
        callbacks=[untie.UntieCallback(untie_at=6, untie_when=None)],
        **optimizer_setup["trainer"],
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer


OPTIMIZER_SETUPS = {
    # Trainer's own 8-bit AdamW: 32-bit state for the embedding (and so for the head), 8-bit for the other matrices.
    "optim=adamw_bnb_8bit": {"args": {"optim": "adamw_bnb_8bit"}, "trainer": {}, "head_state": torch.float32},
    # A class passed to Trainer: no override, so the shared matrix and the head keep 8-bit state.
    "AdamW8bit-class": {
        "args": {},
        "trainer": {"optimizer_cls_and_kwargs": (bnb.optim.AdamW8bit, {"lr": 5e-3})},
        "head_state": torch.uint8,
    },
}


@pytest.mark.parametrize("setup_name", OPTIMIZER_SETUPS)
def test_trainer_with_an_8bit_optimizer_unties_resumes_and_reloads(setup_name, tmp_path):
    setup = OPTIMIZER_SETUPS[setup_name]
    reference = _run(tmp_path, setup)
    model = reference.model
    assert not untie.is_tied(model)
    optimizer = getattr(reference.optimizer, "optimizer", reference.optimizer)
    assert type(optimizer).__module__.startswith("bitsandbytes.")
    head = model.get_output_embeddings().weight
    assert optimizer.state[head]["state1"].dtype == setup["head_state"]
    assert optimizer.state[model.transformer.h[0].mlp.c_fc.weight]["state1"].dtype == torch.uint8
    final = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert not torch.equal(final["lm_head.weight"], final["transformer.wte.weight"])
    for checkpoint in ("checkpoint-4", "checkpoint-8"):  # before and after the untie at 6
        resumed = _run(tmp_path, setup, resume=str(tmp_path / "run" / checkpoint))
        assert_resumed_equals(resumed.model, final, checkpoint)
    assert_reloads_untied(tmp_path / "run" / "checkpoint-10", final)


def test_per_role_rates_with_trainer_8bit_adamw_keep_the_32bit_state_and_resume_exactly(tmp_path):
    """Issue 76 with `optim="adamw_bnb_8bit"`: the embedding and the head in groups of their own keep the 32-bit state
    Trainer asks for embeddings (bitsandbytes' overrides, re-indexed after the groups moved), train at 0.1x / 2x after
    the untie, and a resume from after the untie equals the uninterrupted run."""

    def run(resume=None):
        args = training_args(tmp_path / "run", max_steps=10, save_strategy="steps", save_steps=4,
                             optim="adamw_bnb_8bit", learning_rate=5e-3)  # fmt: skip
        callback = untie.UntieCallback(untie_at=6, untie_when=None, embedding_lr_scale=0.1, head_lr_scale=2.0)
        data = ToyLMDataset(vocab=96)
        trainer = tf.Trainer(model=_wider_gpt2(), args=args, train_dataset=data, callbacks=[callback])
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    trainer = run()
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    model = trainer.model
    roles = {g.get("untie_role"): g for g in optimizer.param_groups}
    assert roles["input_embedding"]["params"] == [model.get_input_embeddings().weight]
    assert roles["head"]["params"] == [model.get_output_embeddings().weight]
    for param in (model.get_input_embeddings().weight, model.get_output_embeddings().weight):
        assert optimizer.state[param]["state1"].dtype == torch.float32
    assert optimizer.state[model.transformer.h[0].mlp.c_fc.weight]["state1"].dtype == torch.uint8
    logged = [h for h in trainer.state.log_history if "loss" in h]
    for h in logged:
        scale = (1.0, 1.0) if h["step"] <= 6 else (0.1, 2.0)
        assert (h["untie/lr_input_embedding"], h["untie/lr_head"]) == (scale[0] * h["learning_rate"],
                                                                         scale[1] * h["learning_rate"])  # fmt: skip
    final = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert_resumed_equals(run(resume=str(tmp_path / "run" / "checkpoint-8")).model, final, "checkpoint-8", 0.0)
