"""Resuming across settings: the run continues as written, or stops early with the fix named; never a silent change."""

from __future__ import annotations

import logging
import os
import shutil

import numpy as np
import pytest
import torch
import transformers as tf

import untie
from untie.testing import ToyLMDataset, tiny_model


def _trainer(model, args, callbacks):
    return tf.Trainer(model=model, args=args, train_dataset=ToyLMDataset(), callbacks=list(callbacks))


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _worst(params, reference):
    assert params.keys() == reference.keys()
    return max((params[n] - reference[n]).abs().max().item() for n in reference)


@pytest.fixture
def checkpoints(make_args, tmp_path):
    """Run tied until the untie at step 8, saving every 4 steps; returns (args factory, run folder)."""

    def write(tying_mode: str):
        folder = tmp_path / f"full-{tying_mode}"
        args = make_args(output_dir=str(folder), save_strategy="steps", save_steps=4)
        model = tiny_model("gpt2")
        callback = untie.UntieCallback(untie_when=None, untie_at=8, tying_mode=tying_mode)
        _trainer(model, args, [callback]).train()
        assert callback.untie_step == 8
        return folder, _params(model)

    return write


def test_an_emulated_tied_checkpoint_resumes_emulated_on_one_device(checkpoints, make_args):
    folder, reference = checkpoints("emulated")
    args = make_args(output_dir=str(folder), save_strategy="no")
    model = tiny_model("gpt2")
    callback = untie.UntieCallback(
        untie_when=None, untie_at=8
    )  # tying_mode="auto" is live on one device: it follows the checkpoint
    _trainer(model, args, [callback]).train(resume_from_checkpoint=str(folder / "checkpoint-4"))
    assert (callback.untie_step, callback.untie_reason) == (8, "deadline")
    assert _worst(_params(model), reference) <= 1e-6


@pytest.mark.parametrize(
    ("written", "asked", "message"),
    [
        ("emulated", "live", r"emulated tying.*tying_mode='emulated'"),
        ("live", "emulated", r"live tying.*tying_mode='auto' or 'live'"),
    ],
)
def test_a_tied_checkpoint_resumed_in_the_other_tying_mode_names_the_fix(
    written, asked, message, checkpoints, make_args
):
    folder, _ = checkpoints(written)
    args = make_args(output_dir=str(folder), save_strategy="no")
    trainer = _trainer(tiny_model("gpt2"), args, [untie.UntieCallback(untie_when=None, untie_at=8, tying_mode=asked)])
    with pytest.raises(ValueError, match=message):
        trainer.train(resume_from_checkpoint=str(folder / "checkpoint-4"))


def test_a_tied_checkpoint_resumed_with_untie_at_0_unties_at_the_resume_step_and_says_so(checkpoints, make_args):
    folder, _ = checkpoints("live")
    args = make_args(output_dir=str(folder), save_strategy="no")
    model = tiny_model("gpt2")
    callback = untie.UntieCallback(untie_when=None, untie_at=0)
    embedding_at_4 = tf.GPT2LMHeadModel.from_pretrained(folder / "checkpoint-4").transformer.wte.weight.detach()
    with pytest.warns(UserWarning, match=r"resumed at step 4 with changed settings \(untie_at: 8 -> 0\)"):
        _trainer(model, args, [callback]).train(resume_from_checkpoint=str(folder / "checkpoint-4"))
    assert (callback.untie_step, callback.untie_reason) == (4, "deadline")
    assert not untie.is_tied(model)
    head = model.get_output_embeddings().weight
    assert not torch.equal(head, model.get_input_embeddings().weight)  # both trained apart after step 4
    assert not torch.equal(model.get_input_embeddings().weight, embedding_at_4)


def test_a_changed_untie_at_after_the_untie_is_reported_as_without_effect(checkpoints, make_args):
    folder, reference = checkpoints("live")
    args = make_args(output_dir=str(folder), save_strategy="no")
    model = tiny_model("gpt2")
    callback = untie.UntieCallback(untie_when=None, untie_at=10)
    with pytest.warns(UserWarning, match=r"untie_at: 8 -> 10\), which have no effect: .* untied at step 8"):
        _trainer(model, args, [callback]).train(resume_from_checkpoint=str(folder / "checkpoint-8"))
    assert callback.untie_step == 8 and _worst(_params(model), reference) <= 1e-6


@pytest.mark.parametrize("damage", ["trainer_state.json", "model.safetensors"])
def test_a_half_written_latest_checkpoint_is_named_with_what_to_do(damage, checkpoints, make_args):
    folder, _ = checkpoints("live")
    (folder / "checkpoint-12" / damage).unlink()
    args = make_args(output_dir=str(folder), save_strategy="no")
    trainer = _trainer(tiny_model("gpt2"), args, [untie.UntieCallback(untie_when=None, untie_at=8)])
    with pytest.raises(ValueError, match=r"checkpoint-12 is incomplete.*Move it out of .* or delete it"):
        trainer.train(resume_from_checkpoint=True)
    shutil.rmtree(folder / "checkpoint-12")  # as the message says: then the newest complete one resumes
    model = tiny_model("gpt2")
    _trainer(model, args, [untie.UntieCallback(untie_when=None, untie_at=8)]).train(resume_from_checkpoint=True)
    assert not untie.is_tied(model)


def test_a_truncated_weight_file_in_the_resumed_checkpoint_is_named(checkpoints, make_args):
    folder, _ = checkpoints("live")
    weights = folder / "checkpoint-8" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    args = make_args(output_dir=str(folder), save_strategy="no")
    trainer = _trainer(tiny_model("gpt2"), args, [untie.UntieCallback(untie_when=None, untie_at=8)])
    with pytest.raises(ValueError, match=r"checkpoint-8 is incomplete: its weights cannot be read"):
        trainer.train(resume_from_checkpoint=str(folder / "checkpoint-8"))


def test_two_untie_callbacks_in_one_trainer_are_refused(make_args):
    with pytest.raises(ValueError, match="2 UntieCallbacks"):
        _trainer(
            tiny_model("gpt2"), make_args(), [untie.UntieCallback(untie_when=None, untie_at=4), untie.UntieCallback]
        )


def test_save_strategy_no_wins_over_save_at_untie(make_args, caplog):
    args = make_args(save_strategy="no")
    with caplog.at_level(logging.INFO, logger="untie"):
        _trainer(tiny_model("gpt2"), args, [untie.UntieCallback(untie_when=None, untie_at=5)]).train()
    assert not os.path.exists(args.output_dir) or not os.listdir(args.output_dir)
    assert "save_strategy='no'" in caplog.text


def test_numpy_steps_are_steps():
    assert untie.UntieCallback(untie_when=None, untie_at=np.int64(5)).config.untie_at == 5
    assert type(untie.UntieConfig(untie_when=None, untie_at=np.int32(5)).untie_at) is int
    assert untie.UntieConfig(untie_when=None, untie_at=np.float32(0.25)).untie_at == 0.25
    assert untie.UntieConfig(metrics_every=np.int64(10)).metrics_every == 10


def test_untie_on_the_meta_device_prepares_the_structure_for_loading(tmp_path):
    trained = tiny_model("gpt2")
    untie.untie_embeddings(trained)
    with torch.no_grad():
        trained.lm_head.weight.add_(0.3)
    with torch.device("meta"):
        model = tiny_model("gpt2")
    untie.untie_embeddings(model)
    assert not untie.is_tied(model) and model.lm_head.weight.is_meta
    model.to_empty(device="cpu")
    model.load_state_dict(trained.state_dict())
    assert torch.equal(model.lm_head.weight, trained.lm_head.weight)
    assert not torch.equal(model.lm_head.weight, model.transformer.wte.weight)


# -- a resume continues its checkpoint's plan (issue 78, item 3) -------------------------------------------------------
@pytest.fixture
def half_way_run(make_args, tmp_path):
    """`untie_at=0.5, untie_when=None` over 20 steps (the untie at 10), saved at step 4 while tied: the folder and the
    uninterrupted run's parameters."""
    folder = tmp_path / "half"
    args = make_args(output_dir=str(folder), max_steps=20, save_strategy="steps", save_steps=4)
    model = tiny_model("gpt2")
    callback = untie.UntieCallback(untie_at=0.5, untie_when=None)
    _trainer(model, args, [callback]).train()
    assert callback.untie_step == 10
    return folder, _params(model)


def test_a_default_callback_resumes_with_the_checkpoints_schedule_exactly(half_way_run, make_args, recwarn):
    """Settings left unset take the checkpoint's: a plain `UntieCallback()` continues `untie_at=0.5, untie_when=None`
    (it used to untie at step 6, the unset default 0.3, with the trigger back on)."""
    folder, reference = half_way_run
    args = make_args(output_dir=str(folder), max_steps=20, save_strategy="no")
    model = tiny_model("gpt2")
    callback = untie.UntieCallback()
    _trainer(model, args, [callback]).train(resume_from_checkpoint=str(folder / "checkpoint-4"))
    assert (callback.untie_step, callback.untie_reason) == (10, "deadline")
    assert (callback.config.untie_at, callback.config.untie_when) == (0.5, None)
    assert _worst(_params(model), reference) == 0
    assert not [w for w in recwarn if "changed settings" in str(w.message)]  # nothing the user set changed


def test_a_schedule_set_at_the_resume_wins_and_the_warning_names_how_to_keep_the_old_plan(half_way_run, make_args):
    folder, _ = half_way_run
    args = make_args(output_dir=str(folder), max_steps=20, save_strategy="no")
    callback = untie.UntieCallback(untie_at=0.75)  # untie_when left unset: the checkpoint's None
    with pytest.warns(UserWarning, match=r"changed settings \(untie_at: 0\.5 -> 0\.75\)") as said:
        _trainer(tiny_model("gpt2"), args, [callback]).train(resume_from_checkpoint=str(folder / "checkpoint-4"))
    assert (callback.untie_step, callback.untie_reason, callback.config.untie_when) == (15, "deadline", None)
    message = next(str(w.message) for w in said if "changed settings" in str(w.message))
    assert "pass untie_at=0.5 (the checkpoint's), or leave it unset" in message
