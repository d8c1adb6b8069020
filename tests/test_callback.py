"""UntieCallback with Trainer: the tied phase, the untie, logging, checkpoints, resume and fine-tuning."""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import os
import pydoc
import types

import pytest
import torch
import transformers as tf
from conftest import training_args

import untie
from untie.core.run import RunOrderError
from untie.decision.share_bands import SHARE_DEFAULT
from untie.distributed import resolve_tying_mode, training_engine
from untie.structure.policy import embedding_share
from untie.testing import TINY_MODELS, ToyLMDataset, tiny_model


def _train(model, args, callbacks=(), resume=None):
    trainer = tf.Trainer(model=model, args=args, train_dataset=ToyLMDataset(), callbacks=list(callbacks))
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def _losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _eval_loss(model, batch):
    """Loss without dropout (and without consuming the training RNG's state in a way that matters)."""
    model.eval()
    with torch.no_grad():
        loss = model(**batch).loss.item()
    model.train()
    return loss


class _Recorder(tf.TrainerCallback):
    """Stands in for a reporting integration (TensorBoard, W&B): it is registered before UntieCallback."""

    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


def test_tied_phase_equals_plain_tied_run_then_head_and_embedding_drift(make_args):
    plain = _train(tiny_model("gpt2"), make_args())
    model = tiny_model("gpt2")
    cb = untie.UntieCallback(untie_when=None, untie_at=6)
    grads = {}

    class GradProbe(tf.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            grads[state.global_step] = (
                model.get_input_embeddings().weight.grad,
                model.get_output_embeddings().weight.grad,
            )

    run = _train(model, make_args(), [cb, GradProbe()])
    assert cb.untie_step == 6 and not untie.is_tied(model)
    assert _losses(run)[:7] == _losses(plain)[:7]  # steps 1..7: loss of step 7 is computed before its update
    emb_grad, head_grad = grads[10]
    assert emb_grad is not None and head_grad is not None and emb_grad.abs().sum() > 0 and head_grad.abs().sum() > 0
    assert (model.get_output_embeddings().weight - model.get_input_embeddings().weight).abs().max() > 1e-3


def test_untie_is_loss_preserving(make_args):
    """The untie itself does not change the function: loss on a fixed batch is bit-identical across it."""
    model = tiny_model("gpt2")
    data = ToyLMDataset(n=8)
    batch = {"input_ids": data.ids, "labels": data.ids.clone()}
    seen = {}

    class AroundUntie(tf.TrainerCallback):
        """Measures after the optimizer update (before the untie) and at step end (UntieCallback runs first)."""

        def on_optimizer_step(self, args, state, control, model=None, **kwargs):
            seen["before"] = _eval_loss(model, batch)

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step == 6:
                assert not untie.is_tied(model)
                seen["after"] = _eval_loss(model, batch)
                seen["before_at_6"] = seen["before"]

    run = _train(model, make_args(), [untie.UntieCallback(untie_when=None, untie_at=6), AroundUntie()])
    assert seen["after"] == seen["before_at_6"]
    losses = _losses(run)
    jumps = [abs(b - a) for a, b in zip(losses[:6], losses[1:7], strict=True)]
    assert abs(losses[6] - losses[5]) <= max(jumps)  # the step after the untie continues the curve


def test_class_passed_without_arguments_follows_the_share_default_and_off_runs_the_trigger_with_a_30_percent_deadline(
    make_args,
):
    model = tiny_model("gpt2")  # 15% of its parameters in the embedding: the lowest band of the committed table
    band = SHARE_DEFAULT.band(embedding_share(model)[0])
    assert band is not None and (band.untie_at, band.embedding_lr_scale) == (0, 16.0)  # cell C's choice
    trainer = tf.Trainer(
        model=model, args=make_args(max_steps=20), train_dataset=ToyLMDataset(), callbacks=[untie.UntieCallback]
    )
    trainer.train()
    cb = next(c for c in trainer.callback_handler.callbacks if isinstance(c, untie.UntieCallback))
    assert (cb.untie_step, cb.untie_reason) == (0, "start") and cb.policy_choice.policy == "by-share"
    rows = [r for r in trainer.state.log_history if r.get("untie/lr_head", 0) > 0]  # the head at 1x its group's rate
    assert rows and all(math.isclose(r["untie/lr_input_embedding"], 16 * r["untie/lr_head"]) for r in rows)
    model = tiny_model("gpt2")
    cb = untie.UntieCallback(policy="off")  # the tied-phase schedule at its defaults
    _train(model, make_args(max_steps=20), [cb])
    assert cb.rule == untie.UntieWhen()  # the pair-free rule: no pairs were given
    assert (cb.untie_step, cb.untie_reason) == (6, "deadline")  # 0.3 * 20; no measurement before step 50
    assert not untie.is_tied(model)


def test_default_trigger_unties_before_the_deadline_when_it_fires(make_args, monkeypatch):
    # Half of the two roles' updates cancel at every measurement: the default rule (warm-up 5% = step 2, patience 5)
    # fires at step 6, before the default deadline at 30% of 40 steps (12).
    monkeypatch.setattr(untie.core.measuring, "role_signals_on_rows", lambda *a, **k: {"cancellation": 0.9})
    # the former default plan for trained weights (policy "fresh-untied"): tied, the trigger, the deadline at 30%
    callback = untie.UntieCallback(metrics_every=1, from_scratch=False, policy="fresh-untied")
    _train(tiny_model("gpt2"), make_args(max_steps=40), [callback])
    assert (callback.untie_step, callback.untie_reason, callback.divergence.fired_step) == (6, "trigger", 6)


def test_a_chosen_untie_at_is_an_exact_schedule_unless_a_rule_is_given(make_args, monkeypatch):
    monkeypatch.setattr(untie.core.measuring, "role_signals_on_rows", lambda *a, **k: {"cancellation": 0.9})
    scheduled = untie.UntieCallback(untie_when=None, untie_at=0.3, metrics_every=1)  # the default's value, but chosen
    _train(tiny_model("gpt2"), make_args(max_steps=40), [scheduled])
    assert scheduled.rule is None and (scheduled.untie_step, scheduled.untie_reason) == (12, "deadline")
    deadline = untie.UntieCallback(untie_at=0.3, untie_when="divergence", metrics_every=1)
    _train(tiny_model("gpt2"), make_args(max_steps=40), [deadline])
    assert (deadline.untie_step, deadline.untie_reason) == (6, "trigger")


def test_logs_reach_integrations_registered_before_the_callback(make_args):
    recorder = _Recorder()
    _train(tiny_model("gpt2"), make_args(), [recorder, untie.UntieCallback(untie_when=None, untie_at=4)])
    train_logs = [log for log in recorder.logs if "loss" in log]
    # A log is written after its step's on_step_end: the log of step 4 already reports the untie.
    assert [log["untie/tied"] for log in train_logs[:3]] == [1.0] * 3
    assert all(log["untie/tied"] == 0.0 and log["untie/untie_step"] == 4 for log in train_logs[3:])


def test_untie_values_reach_log_history_and_trainer_state_json(make_args):
    """Trainer copies a log into log_history before on_log: the untie/* values are added to that copy too."""
    args = make_args(save_strategy="steps", save_steps=6)
    trainer = _train(tiny_model("gpt2"), args, [untie.UntieCallback(untie_when=None, untie_at=4, metrics_every=2)])
    train_logs = [log for log in trainer.state.log_history if "loss" in log]
    assert [log["untie/tied"] for log in train_logs] == [1.0] * 3 + [0.0] * 9
    assert "untie/cancellation" in train_logs[1] and "untie/cka" in train_logs[5]  # role signals, then drift
    saved = json.load(open(os.path.join(args.output_dir, "checkpoint-6", "trainer_state.json")))["log_history"]
    assert [log.get("untie/untie_step") for log in saved if "loss" in log] == [None] * 3 + [4] * 3


def test_checkpoint_at_untie_and_state_in_trainer_state(make_args):
    args = make_args(save_strategy="steps", save_steps=100)  # only the untie saves
    _train(tiny_model("gpt2"), args, [untie.UntieCallback(untie_when=None, untie_at=5)])
    ckpt = os.path.join(args.output_dir, "checkpoint-5")
    assert os.path.isdir(ckpt)
    state = json.load(open(os.path.join(ckpt, "trainer_state.json")))["stateful_callbacks"]["UntieCallback"]
    run_state = state["attributes"]["untie_state"]  # the layout Untier.state_dict() has too
    attributes = run_state["attributes"]
    assert (attributes["untied"], attributes["untie_step"], attributes["untie_reason"]) == (True, 5, "deadline")
    assert (run_state["format"], run_state["adapter"], run_state["global_step"]) == (3, "UntieCallback", 5)
    assert untie.UntieConfig.from_dict(state["args"]) == untie.UntieConfig(untie_when=None, untie_at=5)
    assert untie.checkpoint_is_untied(ckpt) is True
    assert json.load(open(os.path.join(ckpt, "config.json")))["tie_word_embeddings"] is False


class _MyUntieCallback(untie.UntieCallback):
    """A user's subclass: Trainer files its state under this class name."""


def test_a_subclass_keeps_its_state_across_a_resume(make_args, tmp_path):
    """The saved state is found by its marker, not by the class name: the subclass's resumed run knows its untie
    and history, and the checkpoint tools read it."""
    args = make_args(output_dir=str(tmp_path / "run"), save_strategy="steps", save_steps=6)
    first = _MyUntieCallback(untie_when=None, untie_at=4, metrics_every=2)
    _train(tiny_model("gpt2"), args, [first])
    ckpt = str(tmp_path / "run" / "checkpoint-6")
    saved = json.load(open(os.path.join(ckpt, "trainer_state.json")))["stateful_callbacks"]
    assert "_MyUntieCallback" in saved and "UntieCallback" not in saved
    assert untie.checkpoint_is_untied(ckpt) is True
    resumed = _MyUntieCallback(untie_when=None, untie_at=4, metrics_every=2)
    _train(tiny_model("gpt2"), args, [resumed], resume=ckpt)
    assert (resumed.untie_step, resumed.untie_reason) == (4, "deadline")
    assert [h["step"] for h in resumed.history] == [h["step"] for h in first.history]


@pytest.mark.parametrize("adapter", ["UntieCallback", "Untier"])
def test_every_setting_is_declared_once_and_help_lists_it_with_its_meaning(adapter):
    """The settings are UntieConfig's fields, declared there only: the adapters take `config` and settings by name
    (**overrides), and help(UntieCallback) / help(untie.Untier) list every setting with its meaning."""
    cls = getattr(untie, adapter)
    parameters = inspect.signature(cls.__init__).parameters
    assert "config" in parameters and any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    rendered = " ".join(pydoc.render_doc(cls, renderer=pydoc.plaintext).split())
    for field in dataclasses.fields(untie.UntieConfig):
        assert field.name not in parameters, field.name
        assert f"{field.name}: {field.metadata['help'][:60]}" in rendered, field.name


def test_no_checkpoint_at_untie_when_disabled(make_args):
    """With saving on (save_strategy="steps", no periodic save before the end), save_at_untie=False is the only
    thing that keeps checkpoint-5 away: the test above shows the same run with the default writes it."""
    args = make_args(save_strategy="steps", save_steps=100)
    _train(tiny_model("gpt2"), args, [untie.UntieCallback(untie_when=None, untie_at=5, save_at_untie=False)])
    assert os.path.isdir(args.output_dir)
    assert not os.path.exists(os.path.join(args.output_dir, "checkpoint-5"))


def test_config_round_trips_through_json():
    config = untie.UntieConfig(
        untie_when=None, untie_at=0.25, optimizer_state="reset", tie_init="mean", save_at_untie=False
    )
    assert untie.UntieConfig.from_json(config.to_json()) == config
    with pytest.raises(ValueError, match="Unknown UntieConfig keys"):
        untie.UntieConfig.from_dict({"untie_step": 3})


# -------------------------------------------------------------------------------------------------------------- resume


@pytest.mark.parametrize(
    ("arch", "state"),
    [(arch, state) for arch in ("gpt2", "bert", "bart") for state in ("copy", "reset")] + [("gpt2", "fresh")],
)
def test_resume_before_at_and_after_untie_matches_uninterrupted_run(arch, state, make_args, tmp_path):
    def run(resume=None):
        args = make_args(output_dir=str(tmp_path / "full"), save_strategy="steps", save_steps=4)
        model = tiny_model(arch)
        callback = untie.UntieCallback(untie_when=None, untie_at=6, optimizer_state=state)
        _train(model, args, [callback], resume=resume)
        assert callback.untie_step == 6  # restored from the checkpoint's callback state when resumed after it
        return model

    reference = _params(run())
    for ckpt in ("checkpoint-4", "checkpoint-6", "checkpoint-8"):  # before, at, after the untie (step 6)
        resumed = run(resume=str(tmp_path / "full" / ckpt))
        assert not untie.is_tied(resumed)
        params = _params(resumed)
        assert params.keys() == reference.keys()
        worst = max((params[n] - reference[n]).abs().max().item() for n in reference)
        assert worst <= 1e-6, (ckpt, worst)


@pytest.mark.parametrize("tying_mode", ["live", "emulated"])
def test_resume_with_trainer_restoring_callback_states_matches_uninterrupted_run(
    tying_mode, make_args, tmp_path, monkeypatch
):
    """With restore_callback_states_from_checkpoint=True, Trainer swaps in a new UntieCallback built from the
    checkpoint: it takes over the model's setup and the trigger's streak, and the run ends as if never stopped."""
    monkeypatch.setattr(untie.core.measuring, "role_signals_on_rows", lambda *a, **k: {"cancellation": 0.9})
    rule = untie.UntieWhen(signal="cancellation", threshold=0.5, smoothing=0.0, warmup=0, patience=6)

    def run(resume=None):
        args = make_args(
            output_dir=str(tmp_path / "full"),
            save_strategy="steps",
            save_steps=4,
            restore_callback_states_from_checkpoint=True,
        )
        model = tiny_model("gpt2")
        callback = untie.UntieCallback(untie_at=None, untie_when=rule, metrics_every=1, tying_mode=tying_mode)
        trainer = _train(model, args, [callback], resume=resume)
        live = trainer.callback_handler.callbacks[0]
        assert isinstance(live, untie.UntieCallback) and (live is callback) == (resume is None)
        # The streak saved at step 4 (4 of 6) carries over: the trigger fires at step 6, not at 4 + 6.
        assert (live.untie_step, live.untie_reason, live.divergence.fired_step) == (6, "trigger", 6)
        assert [h["step"] for h in live.history][:6] == [1, 2, 3, 4, 5, 6]
        return model

    reference = _params(run())
    for ckpt in ("checkpoint-4", "checkpoint-8"):  # before and after the untie at step 6
        params = _params(run(resume=str(tmp_path / "full" / ckpt)))
        assert params.keys() == reference.keys()
        worst = max((params[n] - reference[n]).abs().max().item() for n in reference)
        assert worst <= 1e-6, (ckpt, worst)


def test_a_restored_default_callback_still_knows_its_trigger_is_the_default(make_args, tmp_path):
    """The saved args keep the default rule's name ("divergence"), so the swapped-in callback still knows the user
    left it at its default (which FSDP2 turns off unless a rule is named)."""
    args = make_args(output_dir=str(tmp_path / "full"), save_strategy="steps", save_steps=8)
    _train(tiny_model("gpt2"), args, [untie.UntieCallback(policy="off")])
    original = untie.UntieCallback(policy="off")
    args = make_args(output_dir=str(tmp_path / "full"), restore_callback_states_from_checkpoint=True)
    trainer = _train(tiny_model("gpt2"), args, [original], resume=str(tmp_path / "full" / "checkpoint-8"))
    live = trainer.callback_handler.callbacks[0]
    assert live is not original and live.config.untie_when == original.config.untie_when
    assert live.config.is_default_rule and (live.untie_step, live.untie_reason) == (4, "deadline")


def test_a_callback_added_after_the_trainer_was_built_is_refused(make_args):
    trainer = tf.Trainer(model=tiny_model("gpt2"), args=make_args(), train_dataset=ToyLMDataset())
    trainer.add_callback(untie.UntieCallback(untie_when=None, untie_at=6))
    with pytest.raises(
        RunOrderError,
        match=r"on_train_begin\(\) in phase 'new'.*Pass it to the constructor: Trainer\(\.\.\., callbacks=",
    ):
        trainer.train()


def _untied_gpt2():
    """A tiny GPT-2 whose config does not tie (an untied model from elsewhere, as a model_init may return)."""
    make_config, model_class = TINY_MODELS["gpt2"]
    config = make_config()
    config.tie_word_embeddings = False
    return model_class(config)


def test_every_train_call_with_model_init_is_a_fresh_tie_then_untie_run(make_args):
    """hyperparameter_search calls train() once per trial on one Trainer, and Trainer builds each trial's model with
    model_init after the callbacks' init: each model is tied like the constructor's, and each run starts afresh."""
    callback = untie.UntieCallback(untie_when=None, untie_at=4, metrics_every=2, tie_init="input")
    trainer = tf.Trainer(model_init=_untied_gpt2, args=make_args(), train_dataset=ToyLMDataset(), callbacks=[callback])
    runs = []
    for _ in range(2):
        with pytest.warns(UserWarning, match="arrived untied; tying it"):
            trainer.train()
        assert (callback.untie_step, callback.untie_reason) == (4, "deadline")
        assert [h["step"] for h in callback.history] == [2, 4, 6, 8, 10, 12]
        runs.append((_params(trainer.model), _losses(trainer)))
    assert runs[0][1] == runs[1][1]  # the second run is the first again: nothing carried over
    assert all(torch.equal(runs[0][0][n], runs[1][0][n]) for n in runs[0][0])


def test_resume_with_model_init_after_the_untie_matches_uninterrupted_run(make_args, tmp_path):
    """The model Trainer builds with model_init gets the checkpoint guard before the checkpoint is loaded into it."""

    def run(resume=None):
        args = make_args(output_dir=str(tmp_path / "full"), save_strategy="steps", save_steps=4)
        callback = untie.UntieCallback(untie_when=None, untie_at=6)
        trainer = tf.Trainer(
            model_init=lambda: tiny_model("gpt2"), args=args, train_dataset=ToyLMDataset(), callbacks=[callback]
        )
        trainer.train(resume_from_checkpoint=resume)
        assert (callback.untie_step, callback.untie_reason) == (6, "deadline")
        return trainer.model

    reference = _params(run())
    resumed = _params(run(resume=str(tmp_path / "full" / "checkpoint-8")))
    assert resumed.keys() == reference.keys()
    assert max((resumed[n] - reference[n]).abs().max().item() for n in reference) <= 1e-6


def test_a_model_swapped_in_after_the_trainer_was_built_is_refused(make_args):
    trainer = tf.Trainer(
        model=tiny_model("gpt2"), args=make_args(), train_dataset=ToyLMDataset(), callbacks=[untie.UntieCallback()]
    )
    trainer.model = trainer.model_wrapped = _untied_gpt2()
    with pytest.raises(RunOrderError, match=r"on_train_begin\(\) got a model .* Build a new Trainer with that model"):
        trainer.train()


def test_resume_without_callback_uses_prepare_for_resume(make_args, tmp_path):
    args = make_args(output_dir=str(tmp_path / "full"), save_strategy="steps", save_steps=8)
    reference_model = tiny_model("gpt2")
    _train(reference_model, args, [untie.UntieCallback(untie_when=None, untie_at=4)])
    ckpt = str(tmp_path / "full" / "checkpoint-8")

    # Upstream (transformers 5.23, README Limits): without the callback or prepare_for_resume, Trainer loads the head
    # into the shared matrix and then fails in torch's optimizer loader; no untie code runs to catch it.
    with pytest.raises(ValueError, match="doesn't match the size of optimizer's group"):
        _train(tiny_model("gpt2"), args, resume=ckpt)
    model = untie.prepare_for_resume(tiny_model("gpt2"), ckpt)
    assert not untie.is_tied(model)
    _train(model, args, resume=ckpt)  # plain Trainer: the model already has the checkpoint's structure
    ref = _params(reference_model)
    assert max((p - ref[n]).abs().max().item() for n, p in _params(model).items()) <= 1e-6


def test_resume_guard_never_overwrites_the_embedding_with_the_head(make_args, tmp_path):
    """An untied checkpoint loaded into a tied model: the guard unties first, so both matrices are restored."""
    args = make_args(output_dir=str(tmp_path / "full"), save_strategy="steps", save_steps=12)
    trained = tiny_model("gpt2")
    _train(trained, args, [untie.UntieCallback(untie_when=None, untie_at=3)])
    fresh = tiny_model("gpt2")
    untie.install_resume_guard(fresh)
    from safetensors.torch import load_file

    fresh.load_state_dict(load_file(str(tmp_path / "full" / "checkpoint-12" / "model.safetensors")), strict=False)
    assert not untie.is_tied(fresh)
    assert torch.equal(fresh.transformer.wte.weight, trained.transformer.wte.weight)
    assert torch.equal(fresh.lm_head.weight, trained.lm_head.weight)


def test_tied_checkpoint_into_untied_model_gives_head_the_shared_matrix(tmp_path):
    tied = tiny_model("bert", seed=1)
    with torch.no_grad():
        tied.cls.predictions.bias.add_(0.5)
    model = tiny_model("bert", seed=2)
    untie.untie_embeddings(model)
    untie.install_resume_guard(model)
    head_keys = ("cls.predictions.decoder.weight", "cls.predictions.decoder.bias")  # as save_pretrained drops them
    tied_checkpoint = {k: v for k, v in tied.state_dict().items() if k not in head_keys}
    with pytest.warns(UserWarning, match="tied checkpoint into an untied model"):
        model.load_state_dict(tied_checkpoint, strict=False)
    assert torch.equal(model.cls.predictions.decoder.weight, tied.bert.embeddings.word_embeddings.weight)
    assert torch.equal(model.cls.predictions.decoder.bias, tied.cls.predictions.bias)


def test_prepare_for_resume_needs_a_checkpoint_that_says(tmp_path):
    with pytest.raises(ValueError, match="does not say whether its model is tied"):
        untie.prepare_for_resume(tiny_model("gpt2"), tmp_path)


# --------------------------------------------------------------------------------------------------------- fine-tuning


@pytest.mark.parametrize("arch", ["gpt2", "bert", "t5"])
def test_finetune_tied_checkpoint_untied_from_step_zero(arch, make_args, tmp_path):
    tiny_model(arch).save_pretrained(tmp_path / "pretrained")
    model = type(tiny_model(arch)).from_pretrained(tmp_path / "pretrained")
    assert untie.is_tied(model)
    cb = untie.UntieCallback(untie_when=None, untie_at=0)
    trainer = _train(model, make_args(), [cb])
    assert cb.untie_step == 0 and not untie.is_tied(model)
    layout = untie.embedding_layout(model)
    assert (model.get_parameter(layout.output_weight) - model.get_parameter(layout.input_weight)).abs().max() > 0
    trainer.save_model(str(tmp_path / "finetuned"))
    saved = _params(model)
    reloaded = type(model).from_pretrained(tmp_path / "finetuned")
    untie.untie_embeddings(reloaded)
    assert not untie.is_tied(reloaded)
    assert all(torch.equal(p, saved[n]) for n, p in _params(reloaded).items() if n in saved)


def _third_party_untied_llama(tmp_path) -> tf.PreTrainedModel:
    """A tiny Llama reloaded from an untied checkpoint whose head differs from its embedding, without this library's
    untie marker (as a checkpoint trained untied elsewhere)."""
    source = tiny_model("llama")
    untie.untie_embeddings(source)
    with torch.no_grad():
        source.lm_head.weight.mul_(2.0)
    source.save_pretrained(tmp_path / "untied")
    model = type(source).from_pretrained(tmp_path / "untied")
    model.config.__dict__.pop(untie.structure.surgery.UNTIED_MARKER)
    return model


def test_the_default_keeps_an_untied_checkpoint_untied_and_says_so(make_args, tmp_path):
    """`callbacks=[UntieCallback]` on a third-party untied checkpoint: both trained matrices are kept and train apart
    from the first step; tying it is a setting (tie_init), never the default."""
    model = _third_party_untied_llama(tmp_path)
    head = model.lm_head.weight.detach().clone()
    with pytest.warns(UserWarning, match="arrived untied .* trains untied from the first step"):
        trainer = tf.Trainer(
            model=model, args=make_args(max_steps=3), train_dataset=ToyLMDataset(), callbacks=[untie.UntieCallback]
        )
    assert not untie.is_tied(model) and torch.equal(model.lm_head.weight, head)
    trainer.train()
    callback = next(c for c in trainer.callback_handler.callbacks if isinstance(c, untie.UntieCallback))
    assert callback.untied and (callback.untie_step, callback.untie_reason) == (0, "start")
    assert not untie.is_tied(model) and not torch.equal(model.lm_head.weight, head)  # the kept head trained


@pytest.mark.parametrize("init", ["input", "output", "mean"])
def test_callback_ties_an_untied_checkpoint(init, make_args, tmp_path):
    model = _third_party_untied_llama(tmp_path)
    w_in, w_out = model.model.embed_tokens.weight.detach().clone(), model.lm_head.weight.detach().clone()
    with pytest.warns(UserWarning, match="arrived untied; tying it"):
        trainer = tf.Trainer(
            model=model,
            args=make_args(max_steps=2),
            train_dataset=ToyLMDataset(),
            callbacks=[untie.UntieCallback(untie_when=None, untie_at=None, tie_init=init)],
        )
    assert untie.is_tied(model)
    expected = {"input": w_in, "output": w_out, "mean": (w_in + w_out) / 2}[init]
    assert torch.equal(model.model.embed_tokens.weight, expected)
    trainer.train()
    trainer.save_model(str(tmp_path / "tied"))
    assert untie.is_tied(type(model).from_pretrained(tmp_path / "tied"))


# ----------------------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("untie_at", "message"),
    [
        (-1, "negative"),
        (-2.0, "negative"),
        (1.5, "neither a whole step nor a fraction in \\(0, 1\\)"),
        (float("nan"), "neither a whole step nor a fraction"),
        (True, "pass a step \\(500\\)"),
        ("10", "pass a step \\(500\\)"),
    ],
)
def test_invalid_untie_at_is_refused(untie_at, message):
    with pytest.raises(ValueError, match=message):
        untie.UntieCallback(untie_when=None, untie_at=untie_at)


def test_untie_at_beyond_the_run_is_refused(make_args):
    with pytest.raises(ValueError, match="beyond the end of the run \\(max_steps=12\\)"):
        _train(tiny_model("gpt2"), make_args(), [untie.UntieCallback(untie_when=None, untie_at=50)])


def test_unknown_settings_are_refused():
    with pytest.raises(ValueError, match="tie_init='avg'"):
        untie.UntieCallback(tie_init="avg")
    with pytest.raises(TypeError):
        untie.UntieCallback(untie_step=3)


@pytest.fixture
def no_accelerator(monkeypatch):
    """No Accelerator created yet and no `accelerate launch` environment: the engine comes from the arguments."""
    from accelerate.state import AcceleratorState, PartialState

    monkeypatch.setattr(AcceleratorState, "_shared_state", {})
    monkeypatch.setattr(PartialState, "_shared_state", {})
    for name in ("ACCELERATE_USE_FSDP", "FSDP_VERSION", "ACCELERATE_USE_DEEPSPEED"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(
    ("settings", "engine"),
    [
        ({}, None),
        ({"fsdp": True, "fsdp_config": {"version": 2}}, "FSDP2"),
        ({"fsdp": ["full_shard"], "fsdp_config": {"version": 1}}, "FSDP1"),
        ({"fsdp": True}, "FSDP2"),  # transformers' default FSDP version
        ({"deepspeed": "ds.json"}, "DEEPSPEED"),
    ],
)
def test_the_engine_is_read_from_the_arguments_before_accelerate_starts(no_accelerator, settings, engine):
    args = types.SimpleNamespace(**{"fsdp": None, "fsdp_config": None, "deepspeed": None, **settings})
    assert training_engine(args) == engine


def test_the_engine_follows_accelerate_launch_environment(no_accelerator, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "1")
    assert training_engine(None) == "FSDP1"


def test_the_engine_is_what_accelerate_will_run(make_args):
    # Once Trainer built its Accelerator (here on CPU, where fsdp arguments would train unsharded) the state decides.
    tf.Trainer(model=tiny_model("gpt2"), args=make_args(max_steps=1), train_dataset=ToyLMDataset())
    assert training_engine(types.SimpleNamespace(fsdp=True, fsdp_config={"version": 2}, deepspeed=None)) is None


@pytest.mark.parametrize(
    ("requested", "engine", "mode"),
    [
        ("auto", None, "live"),
        ("live", None, "live"),
        ("emulated", None, "emulated"),
        ("auto", "FSDP2", "emulated"),
        ("emulated", "FSDP2", "emulated"),
        ("auto", "DEEPSPEED", "emulated"),
        ("emulated", "DEEPSPEED", "emulated"),
    ],
)
def test_tying_mode_auto_picks_emulated_only_where_a_live_untie_cannot_work(requested, engine, mode):
    assert resolve_tying_mode(requested, engine) == mode


def test_live_tying_under_fsdp2_or_deepspeed_and_unsupported_engines_are_refused():
    with pytest.raises(RuntimeError, match="tying_mode='live' cannot work under FSDP2.*silently reverted"):
        resolve_tying_mode("live", "FSDP2")
    with pytest.raises(RuntimeError, match="tying_mode='live' cannot work under DEEPSPEED.*engine init"):
        resolve_tying_mode("live", "DEEPSPEED")
    for engine in ("FSDP1", "MEGATRON_LM", "XLA"):
        for requested in ("auto", "emulated"):
            with pytest.raises(RuntimeError, match=f"untie does not support {engine}"):
                resolve_tying_mode(requested, engine)
    with pytest.raises(RuntimeError, match="Use FSDP2"):
        resolve_tying_mode("auto", "FSDP1")


def test_values_not_measured_yet_are_absent_from_the_logs_not_nan(make_args):
    """While tied, a pair whose symbol has not occurred and the trigger before its first average are NaN in `history`
    (every measurement kept) and absent from Trainer's logs (what the console, TensorBoard and W&B get)."""
    from untie.testing import tiny_tokenizer

    callback = untie.UntieCallback(metrics_every=1, untie_at=None)
    trainer = tf.Trainer(
        model=tiny_model("gpt2"),
        args=make_args(max_steps=4, logging_steps=1, per_device_train_batch_size=1),
        train_dataset=ToyLMDataset(),
        processing_class=tiny_tokenizer(),
        callbacks=[callback],
    )
    trainer.train()
    assert any(math.isnan(value) for h in callback.history for value in h.values())  # something was unmeasured
    logged = [(key, value) for entry in trainer.state.log_history for key, value in entry.items() if "untie/" in key]
    assert logged and all(math.isfinite(value) for _, value in logged), logged
    assert all("untie/untie_step" not in entry for entry in trainer.state.log_history)  # never untied: absent


def test_a_plain_trainer_checkpoint_resumed_with_the_callback_saves_normally(make_args, tmp_path):
    """Adding the library on resume (the documented way to add it to a running job): Trainer's saved state has no
    entry for the callback, and transformers' first save used to fail with KeyError: 'UntieCallback'."""
    args = make_args(output_dir=str(tmp_path / "plain"), save_strategy="steps", save_steps=2, max_steps=2)
    tf.Trainer(model=tiny_model("gpt2"), args=args, train_dataset=ToyLMDataset()).train()
    args = make_args(output_dir=str(tmp_path / "plain"), save_strategy="steps", save_steps=2, max_steps=4)
    callback = untie.UntieCallback()
    trainer = tf.Trainer(model=tiny_model("gpt2"), args=args, train_dataset=ToyLMDataset(), callbacks=[callback])
    trainer.train(resume_from_checkpoint=str(tmp_path / "plain" / "checkpoint-2"))
    saved = json.loads((tmp_path / "plain" / "checkpoint-4" / "trainer_state.json").read_text())
    assert "UntieCallback" in saved["stateful_callbacks"]
    assert saved["stateful_callbacks"]["UntieCallback"]["attributes"]["untie_state"]["global_step"] == 4


def test_a_second_train_call_resuming_a_checkpoint_of_the_first_equals_it(tmp_path):
    """`trainer.train()` then `trainer.train(resume_from_checkpoint=...)` on the same Trainer: the second call attaches
    the model again with the checkpoint's structure (it failed: the tied checkpoint loaded into the model the first
    call had untied, and torch refused the optimizer state)."""
    callback = untie.UntieCallback(untie_at=6, untie_when=None)
    args = training_args(tmp_path, max_steps=8, save_strategy="steps", save_steps=4)
    trainer = tf.Trainer(model=tiny_model("llama"), args=args, train_dataset=ToyLMDataset(), callbacks=[callback])
    trainer.train()
    first = _losses(trainer)
    assert callback.untie_step == 6 and not untie.is_tied(trainer.model)
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    assert (callback.untie_step, callback.untie_reason) == (6, "deadline")
    assert _losses(trainer)[-4:] == pytest.approx(first[4:], abs=1e-5)


def test_an_optimizer_passed_to_trainer_is_kept_through_later_resumed_calls(tmp_path):
    """A later `train()` call resuming a checkpoint has Trainer build its optimizer again only where Trainer built it:
    one passed to `Trainer(optimizers=...)` is kept, also by the callback Trainer re-creates from a checkpoint."""
    model = tiny_model("llama")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    args = training_args(
        tmp_path, max_steps=8, save_strategy="steps", save_steps=4, restore_callback_states_from_checkpoint=True
    )
    trainer = tf.Trainer(
        model=model, args=args, train_dataset=ToyLMDataset(), optimizers=(optimizer, scheduler),
        callbacks=[untie.UntieCallback(untie_at=2, untie_when=None)],
    )  # fmt: skip
    trainer.train()
    for _ in range(2):
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
        assert getattr(trainer.optimizer, "optimizer", trainer.optimizer) is optimizer
