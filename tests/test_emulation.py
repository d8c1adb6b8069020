"""Emulated tying (untie.engines.emulation): a separate head that trains exactly as if tied, then forks like a live
untie."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as tf

import untie
from untie.engines.emulation import EmulatedTying
from untie.signals.probe import RoleGradientProbe
from untie.testing import ToyLMDataset, tiny_model

# Weight decay, gradient clipping that bites (max_grad_norm below every step's norm) and gradient accumulation.
HARD = dict(max_steps=16, gradient_accumulation_steps=2, per_device_train_batch_size=4, max_grad_norm=0.3)


class _Attach(tf.TrainerCallback):
    def __init__(self, emulation: EmulatedTying, release_at: int | None = None) -> None:
        self.emulation, self.release_at = emulation, release_at

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        self.emulation.attach_optimizer(optimizer)

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        if state.global_step == self.release_at:
            self.emulation.release(optimizer)


def _train(model, make_args, name, callbacks=()):
    trainer = tf.Trainer(
        model=model, args=make_args(output_dir=name, **HARD), train_dataset=ToyLMDataset(64), callbacks=list(callbacks)
    )
    trainer.train()
    return [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_emulated_tying_trains_like_real_tying(arch, make_args, tmp_path):
    tied = tiny_model(arch)
    emulated = untie.untie_embeddings(copy.deepcopy(tied))
    emulation = EmulatedTying(emulated)
    real_logs = _train(tied, make_args, tmp_path / "tied")
    emulated_logs = _train(emulated, make_args, tmp_path / "emulated", [_Attach(emulation)])
    # The same losses and the same pre-clipping gradient norms (clipping sees the tied gradient once, not twice).
    assert max(n for _, n in real_logs) > 3 * HARD["max_grad_norm"]  # clipping was active
    for (loss, norm), (loss_e, norm_e) in zip(real_logs, emulated_logs, strict=True):
        assert loss_e == pytest.approx(loss, abs=1e-5) and norm_e == pytest.approx(norm, rel=1e-5)
    shared = tied.get_input_embeddings().weight
    embedding, head = emulated.get_input_embeddings().weight, emulated.get_output_embeddings().weight
    assert head is not embedding and torch.equal(head, embedding)  # mirrored bit for bit
    torch.testing.assert_close(embedding, shared, rtol=0, atol=1e-6)  # float summation order only
    for (name, param), (_, param_e) in zip(tied.named_parameters(), emulated.named_parameters(), strict=False):
        torch.testing.assert_close(param_e, param, rtol=0, atol=1e-5, msg=name)


def test_release_forks_like_a_live_untie(make_args, tmp_path):
    """Emulated until step 6, then released: equals a tied run live-untied at step 6 (optimizer state copied)."""
    live = tiny_model("gpt2")
    emulated = untie.untie_embeddings(copy.deepcopy(live))
    emulation = EmulatedTying(emulated)
    _train(
        live,
        make_args,
        tmp_path / "live",
        [untie.UntieCallback(untie_when=None, untie_at=6, metrics_every=0, save_at_untie=False)],
    )
    _train(emulated, make_args, tmp_path / "emulated", [_Attach(emulation, release_at=6)])
    assert not emulation.active
    for get in ("get_input_embeddings", "get_output_embeddings"):
        torch.testing.assert_close(getattr(emulated, get)().weight, getattr(live, get)().weight, rtol=0, atol=1e-5)
    head, embedding = emulated.get_output_embeddings().weight, emulated.get_input_embeddings().weight
    assert not torch.allclose(head, embedding)  # they separated after the release


def test_emulation_refuses_a_really_tied_model():
    with pytest.raises(ValueError, match="really tied.*untie_embeddings"):
        EmulatedTying(tiny_model("gpt2"))


# -- through UntieCallback(tying_mode="emulated") --------------------------------------------------------------------


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("state", ["copy", "reset", "fresh"])
def test_callback_emulated_mode_equals_a_live_untie(state, make_args, tmp_path):
    live, emulated = tiny_model("gpt2"), tiny_model("gpt2")
    _train(
        live, make_args, tmp_path / "live", [untie.UntieCallback(untie_when=None, untie_at=6, optimizer_state=state)]
    )
    callback = untie.UntieCallback(untie_when=None, untie_at=6, optimizer_state=state, tying_mode="emulated")
    _train(emulated, make_args, tmp_path / "emulated", [callback])
    assert (callback.untie_step, callback.untie_reason, callback.untied) == (6, "deadline", True)
    reference, params = _params(live), _params(emulated)
    assert params.keys() == reference.keys()
    assert max((params[n] - reference[n]).abs().max().item() for n in reference) <= 1e-5


def test_callback_emulated_mode_resumes_before_and_after_the_untie(make_args, tmp_path):
    def run(resume=None):
        args = make_args(output_dir=str(tmp_path / "full"), save_strategy="steps", save_steps=4, max_steps=12)
        model = tiny_model("gpt2")
        callback = untie.UntieCallback(untie_when=None, untie_at=6, tying_mode="emulated")
        trainer = tf.Trainer(model=model, args=args, train_dataset=ToyLMDataset(64), callbacks=[callback])
        trainer.train(resume_from_checkpoint=resume)
        assert callback.untie_step == 6
        return model

    reference = _params(run())
    for ckpt in ("checkpoint-4", "checkpoint-8"):  # emulating (tied), and after the release at step 6
        params = _params(run(resume=str(tmp_path / "full" / ckpt)))
        worst = max((params[n] - reference[n]).abs().max().item() for n in reference)
        assert worst <= 1e-6, (ckpt, worst)


def test_probe_splits_the_emulated_tied_gradient_into_its_two_roles():
    model = untie.untie_embeddings(tiny_model("gpt2")).eval()  # no dropout: the twin sees the same forward
    twin = copy.deepcopy(model)  # the same untied matrices, trained without emulation: the dense role gradients
    emulation = EmulatedTying(model)
    probe = RoleGradientProbe(model, pairs=[(3, 5)], emulation=emulation)
    probe.armed = True
    ids = ToyLMDataset(8).ids[:4]
    for micro in (ids[:2], ids[2:]):  # two micro-batches: both roles accumulate, like the folded gradient
        model(input_ids=micro, labels=micro).loss.backward()
        twin(input_ids=micro, labels=micro).loss.backward()
    grads = probe.collect()
    head = model.get_output_embeddings().weight
    assert head.grad is None and emulation.active  # folded: the embedding holds the tied gradient
    dense_in, dense_out = twin.get_input_embeddings().weight.grad, twin.get_output_embeddings().weight.grad
    torch.testing.assert_close(grads.input_grad, dense_in[grads.rows], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grads.output_grad, dense_out[grads.rows], rtol=1e-5, atol=1e-6)
    assert grads.output_sq_norm == pytest.approx(dense_out.double().square().sum().item(), rel=1e-6)
    assert grads.input_grad.abs().sum() > 0 and grads.output_grad.abs().sum() > 0
    with pytest.raises(ValueError, match="really tied"):
        RoleGradientProbe(tiny_model("gpt2"), emulation=emulation)
    with pytest.raises(ValueError, match="emulation=EmulatedTying"):
        RoleGradientProbe(untie.untie_embeddings(tiny_model("gpt2")))


def test_divergence_trigger_in_emulated_mode_measures_and_fires_like_live_tying(make_args, tmp_path):
    """The role signals and conditional gaps, and the step the trigger fires, equal a live run's (accumulation 2)."""
    rule = untie.UntieWhen(signal="cosine", threshold=2.0, smoothing=0.0, warmup=0, patience=3)  # fires at step 6
    settings = dict(untie_at=None, untie_when=rule, metrics_every=2, pairs=[(3, 5), (7, 40)])
    live, emulated = untie.UntieCallback(**settings), untie.UntieCallback(**settings, tying_mode="emulated")
    live_model, emulated_model = tiny_model("gpt2"), tiny_model("gpt2")
    _train(live_model, make_args, tmp_path / "live", [live])
    _train(emulated_model, make_args, tmp_path / "emulated", [emulated])
    assert (emulated.tying_mode, emulated.untie_step, emulated.untie_reason) == ("emulated", 6, "trigger")
    assert (live.untie_step, live.untie_reason) == (6, "trigger")
    assert [h["step"] for h in emulated.history] == [h["step"] for h in live.history] == [2, 4, 6, 8, 10, 12, 14, 16]
    for mine, reference in zip(emulated.history[:3], live.history[:3], strict=True):
        assert "gap/3-5" in mine and "tension/7-40" in mine and mine.keys() == reference.keys()
        for key, value in reference.items():
            assert mine[key] == pytest.approx(value, rel=1e-4, abs=1e-6, nan_ok=True), key
    reference, params = _params(live_model), _params(emulated_model)
    assert max((params[n] - reference[n]).abs().max().item() for n in reference) <= 1e-5


def test_emulated_mode_refuses_an_unknown_tying_mode():
    with pytest.raises(ValueError, match="tying_mode='shared'"):
        untie.UntieConfig(tying_mode="shared")


def test_a_run_that_ends_tied_takes_its_hooks_off_the_optimizer(make_args, tmp_path):
    """Emulated tying mirrors the head after every optimizer step while the run lasts; once Trainer's run is over
    (on_train_end) the optimizer steps without it."""
    model = tiny_model("gpt2")
    callback = untie.UntieCallback(untie_at=None, untie_when=None, tying_mode="emulated", metrics_every=0)
    trainer = tf.Trainer(model=model, args=make_args(max_steps=4), train_dataset=ToyLMDataset(64), callbacks=[callback])
    trainer.train()
    head = model.get_output_embeddings().weight
    assert torch.equal(head, model.get_input_embeddings().weight) and not untie.is_tied(model)  # emulated to the end
    with torch.no_grad():
        head.zero_()
    trainer.optimizer.step()  # no gradients: nothing moves, and no mirror copies the embedding into the head any more
    assert not head.any()


def test_each_engine_has_its_tied_phase_from_one_table_behind_one_interface():
    from untie.engines import TIED_PHASES, tied_phase_for
    from untie.engines.emulation import EmulatedTying
    from untie.engines.zero_tying import ZeroTying

    assert TIED_PHASES == {None: EmulatedTying, "FSDP2": EmulatedTying, "DEEPSPEED": ZeroTying}
    assert (EmulatedTying.reads_at_step, ZeroTying.reads_at_step) == (False, True)
    for cls in (EmulatedTying, ZeroTying):
        assert all(callable(getattr(cls, name)) for name in ("attach_optimizer", "release", "remove")), cls
    model = untie.untie_embeddings(tiny_model("gpt2"))
    tying = tied_phase_for("FSDP2", model)
    assert isinstance(tying, EmulatedTying) and tying.head is model.get_output_embeddings()
    tying.remove()


def test_a_tied_baseline_under_emulated_tying_says_at_its_end_that_it_saves_two_equal_matrices_and_how_to_tie_them(
    make_args, tmp_path, caplog
):
    """Issue 78: a run that never unties under emulated tying (a tied baseline under FSDP2 / DeepSpeed) ended with two
    equal matrices that save untied, with no word. It now says so at its end, and the way it names ties them again."""
    model = tiny_model("gpt2")
    callback = untie.UntieCallback(untie_when=None, untie_at=None, tying_mode="emulated")
    args = make_args(output_dir=str(tmp_path / "run"), max_steps=4)
    trainer = tf.Trainer(model=model, args=args, train_dataset=ToyLMDataset(64), callbacks=[callback])
    with caplog.at_level("WARNING", logger="untie"):
        trainer.train()
    ended = [r.getMessage() for r in caplog.records if "ended tied under emulated tying" in r.getMessage()]
    assert len(ended) == 1 and "untie convert SAVED OUT --tie" in ended[0]
    assert not callback.untied and not untie.is_tied(model)
    assert torch.equal(model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    trainer.save_model(str(tmp_path / "saved"))
    reloaded = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    untie.tie_embeddings(reloaded, init="input")
    assert untie.is_tied(reloaded)
    batch = ToyLMDataset(n=2)[:]
    with torch.no_grad():
        assert torch.equal(reloaded(**batch).logits, model.eval()(**batch).logits)


def test_a_run_that_unties_under_emulated_tying_says_nothing_of_equal_matrices(make_args, tmp_path, caplog):
    model = tiny_model("gpt2")
    callback = untie.UntieCallback(untie_when=None, untie_at=2, tying_mode="emulated")
    trainer = tf.Trainer(model=model, args=make_args(output_dir=str(tmp_path / "run"), max_steps=4),
                         train_dataset=ToyLMDataset(64), callbacks=[callback])  # fmt: skip
    with caplog.at_level("INFO", logger="untie"):
        trainer.train()
    assert callback.untied and not any("ended tied" in r.getMessage() for r in caplog.records)
