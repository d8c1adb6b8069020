"""Half precision: untie / tie on bf16 and fp16 models (dtype and optimizer state kept), and Trainer runs under
`bf16=True` / `fp16=True` (autocast; fp16 with accelerate's gradient scaler) that untie, save, resume and reload."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from conftest import assert_reloads_untied, assert_resumed_equals, training_args

import untie
from untie.testing import ToyLMDataset, tiny_model

HALF = [torch.bfloat16, torch.float16]


def _adam_steps(model, steps: int = 2) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)  # 1e-8 underflows to 0 in fp16
    ids = ToyLMDataset(n=4).ids
    batch = {"input_ids": ids, "labels": ids}
    for _ in range(steps):
        loss = model(**batch).loss
        assert torch.isfinite(loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return optimizer


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_untie_on_a_half_precision_model_keeps_its_dtype_and_copies_the_optimizer_state_as_is(arch, dtype, tmp_path):
    model = tiny_model(arch).to(dtype)
    optimizer = _adam_steps(model)
    shared = model.get_input_embeddings().weight
    shared_state = {k: v.clone() for k, v in optimizer.state[shared].items()}
    untie.untie_embeddings(model, optimizer)
    head = model.get_output_embeddings().weight
    assert head is not shared and head.dtype == dtype and torch.equal(head, shared)
    copied = optimizer.state[head]
    assert copied.keys() == shared_state.keys()
    for key, value in shared_state.items():  # each state tensor in its own dtype, bit for bit
        assert copied[key].dtype == value.dtype and torch.equal(copied[key], value), key
        assert copied[key].data_ptr() != optimizer.state[shared][key].data_ptr(), key
    _adam_steps(model, 1)  # trains on: the same optimizer now steps the head too
    model.save_pretrained(tmp_path / "saved")
    reloaded = type(model).from_pretrained(tmp_path / "saved", dtype=dtype)
    assert not untie.is_tied(reloaded) and reloaded.get_output_embeddings().weight.dtype == dtype
    assert torch.equal(reloaded.get_output_embeddings().weight, model.get_output_embeddings().weight)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_tie_with_the_mean_of_half_precision_matrices_averages_in_float32(dtype):
    model = tiny_model("gpt2")
    untie.untie_embeddings(model)
    with torch.no_grad():
        model.get_output_embeddings().weight.add_(torch.randn_like(model.get_output_embeddings().weight))
    model = model.to(dtype)
    w_in = model.get_input_embeddings().weight.detach().clone()
    w_out = model.get_output_embeddings().weight.detach().clone()
    untie.tie_embeddings(model, init="mean")
    assert untie.is_tied(model) and model.get_input_embeddings().weight.dtype == dtype
    expected = ((w_in.float() + w_out.float()) / 2).to(dtype)
    assert torch.equal(model.get_input_embeddings().weight, expected)


def _run(tmp_path, precision: str, resume: str | None = None) -> tuple[tf.Trainer, untie.UntieCallback]:
    args = training_args(tmp_path / "run", save_strategy="steps", save_steps=4, max_steps=10, **{precision: True})
    callback = untie.UntieCallback(untie_at=6, untie_when=None)
    trainer = tf.Trainer(model=tiny_model("gpt2"), args=args, train_dataset=ToyLMDataset(), callbacks=[callback])
    trainer.train(resume_from_checkpoint=resume)
    return trainer, callback


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trainer_unties_resumes_and_reloads(precision, tmp_path):
    """`bf16=True` / `fp16=True` (autocast; on a GPU fp16 adds accelerate's GradScaler, on CPU accelerate uses none):
    the untie happens at its step, the weights stay float32 masters, and resuming before or after the untie gives
    the uninterrupted run's weights."""
    reference, callback = _run(tmp_path, precision)
    assert callback.untie_step == 6 and not untie.is_tied(reference.model)
    assert reference.accelerator.mixed_precision == precision
    model = reference.model
    assert model.get_output_embeddings().weight.dtype == torch.float32
    final = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert not torch.equal(final["lm_head.weight"], final["transformer.wte.weight"])
    for checkpoint in ("checkpoint-4", "checkpoint-8"):  # before and after the untie at 6
        resumed, resumed_callback = _run(tmp_path, precision, resume=str(tmp_path / "run" / checkpoint))
        assert resumed_callback.untie_step == 6
        assert_resumed_equals(resumed.model, final, checkpoint)
    assert_reloads_untied(tmp_path / "run" / "checkpoint-10", final)


def test_custom_loop_with_fp16_autocast_and_a_gradient_scaler_unties_and_keeps_training():
    """A plain loop with `torch.autocast(float16)` and `torch.amp.GradScaler`: the untied head joins the scaler's
    unscale / inf check through the optimizer, and a step with an inf gradient is skipped for the head too."""
    torch.manual_seed(0)
    model = tiny_model("gpt2")
    untier = untie.Untier(model, max_steps=8, untie_at=3, untie_when=None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    untier.start(optimizer)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    ids = ToyLMDataset(n=8).ids
    head_at_untie = None
    for step in range(8):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(input_ids=ids, labels=ids).loss
        scaler.scale(loss).backward()
        if step == 5:  # an overflow: the scaler must skip this step for every parameter, the new head included
            model.get_output_embeddings().weight.grad[0, 0] = float("inf")
            before = model.get_output_embeddings().weight.detach().clone()
            before_input = model.get_input_embeddings().weight.detach().clone()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        untier.step()
        if step == 5:
            assert torch.equal(model.get_output_embeddings().weight, before)  # skipped, not corrupted
            # The inf is in the head's gradient only: the embedding skipped too, so the scaler saw the new head.
            assert torch.equal(model.get_input_embeddings().weight, before_input)
        if untier.global_step == 3:
            head_at_untie = model.get_output_embeddings().weight.detach().clone()
    assert untier.untie_step == 3 and not untie.is_tied(model)
    head = model.get_output_embeddings().weight
    assert head.dtype == torch.float32 and torch.isfinite(head).all()
    assert not torch.equal(head, head_at_untie)  # it kept training after the untie
    assert not torch.equal(head, model.get_input_embeddings().weight)
