"""The default's one decision (issue 59): a model counts as built fresh only on positive evidence or the user's word
(`UntieConfig.from_scratch`), so the default never draws a head over trained weights, however they arrived; a
config's name decides nothing; a schedule written out runs as written; the line at train begin says what the run
will do, in its own numbers."""

from __future__ import annotations

import functools
import logging
import math
import warnings

import pytest
import torch
import transformers as tf
from conftest import trained_step_llama
from script_modules import load_script

import untie
from untie.structure import policy
from untie.structure.role_rates import role_groups
from untie.testing import ToyLMDataset, step_task, tiny_model

CASES = load_script("scripts", "default_cases")  # the task and the trained states the script prints cases with
_StepTask, _config, _loss = CASES.StepTask, CASES.small_config, CASES.task_loss
_trained_state = functools.cache(CASES.trained_state)  # trained once per setting; load_state_dict copies it
VOCAB = CASES.VOCAB


@pytest.mark.parametrize(
    "steps, lr, zipf, resize",
    [(30, 3e-3, False, False), (300, 1e-3, False, False), (50, 1e-2, True, False), (300, 1e-3, True, True)],
    ids=["short-uniform", "long-uniform", "short-zipf-lr1e-2", "long-zipf-resized"],
)
def test_weights_loaded_by_hand_keep_their_trained_output_role_under_the_defaults(make_args, steps, lr, zipf, resize):
    model = tf.GPT2LMHeadModel(_config())  # built from its config, then loaded by hand: no name says "loaded"
    model.load_state_dict(_trained_state(steps, lr, zipf))
    if resize:
        model.resize_token_embeddings(VOCAB + 8)
    before = _loss(model, zipf)
    assert before < math.log(VOCAB) - 0.5  # trained: well below chance
    callback = untie.UntieCallback()
    args = make_args(max_steps=10, learning_rate=1e-6, per_device_train_batch_size=64)
    tf.Trainer(model=model, args=args, train_dataset=_StepTask(zipf), callbacks=[callback]).train()
    choice = callback.policy_choice
    assert choice.untied_from_start and choice.head_init == "copy" and "counts as trained" in choice.reason
    assert callback.untie_step == 0 and model.lm_head.weight is not model.transformer.wte.weight
    assert _loss(model, zipf) == pytest.approx(before, abs=0.01)  # the untie copied: nothing was drawn over it


def test_a_model_built_from_a_saved_config_counts_as_built_fresh_silently_and_a_loaded_one_warns(tmp_path, make_args):
    """run_clm.py --config_name (from_config: train mode) is the standard from-scratch route: silent (issue 78,
    item 7); an untrained checkpoint that from_pretrained loaded (eval mode) reads as drawn too: the warning names
    both."""
    tiny_model("gpt2").save_pretrained(tmp_path / "config")
    config = tf.AutoConfig.from_pretrained(tmp_path / "config")
    model = tf.AutoModelForCausalLM.from_config(config)
    assert model.name_or_path  # the config's name says "loaded", the weights say "drawn"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        untier = untie.Untier(model, max_steps=4)
    assert untier.policy_choice.untied_from_start and untier.policy_choice.head_init == "model"
    untier.close()
    loaded = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "config")
    with pytest.warns(UserWarning, match=r"config names .* but its embedding matches a fresh draw.*from_scratch="):
        untie.Untier(loaded, max_steps=4).close()
    model = tf.AutoModelForCausalLM.from_config(config)
    untier = untie.Untier(model, from_scratch=False, max_steps=4)  # the setting that settles it: a copy
    assert untier.policy_choice.untied_from_start and untier.policy_choice.head_init == "copy"
    assert torch.equal(model.lm_head.weight, model.get_input_embeddings().weight)
    untier.close()


def test_the_user_says_from_scratch_for_weights_the_run_cannot_read(monkeypatch):
    monkeypatch.setattr(policy, "is_sharded", lambda tensor: True)  # an FSDP2 shard
    model = tiny_model("gpt2")
    assert policy.choose_plan("fresh-untied", model, tied=True, peft=False).plan == "as set"
    chosen = policy.choose_plan("fresh-untied", model, tied=True, peft=False, from_scratch=True)
    assert chosen.untied_from_start and chosen.head_init == "model"
    with pytest.raises(ValueError, match="from_scratch='yes': pass True"):
        untie.UntieConfig(from_scratch="yes")
    parser = tf.HfArgumentParser((untie.UntieConfig,))
    assert parser.parse_args_into_dataclasses(["--from_scratch", "true"])[0].from_scratch is True
    assert parser.parse_args_into_dataclasses([])[0].from_scratch is None


def test_trained_weights_said_from_scratch_are_drawn_over_with_a_warning():
    model = tf.GPT2LMHeadModel(_config())
    model.load_state_dict(_trained_state(300, 1e-3, False))
    with pytest.warns(UserWarning, match="from_scratch=True, but its embedding does not match"):
        untier = untie.Untier(model, from_scratch=True, max_steps=4)
    assert untier.policy_choice.untied_from_start
    untier.close()


@pytest.mark.parametrize("written", [{"untie_at": 0.3}, {"untie_when": "divergence"}, {"untie_at": 0.3,
                                     "untie_when": "divergence"}])  # fmt: skip
def test_the_default_schedule_written_out_gives_a_fresh_model_its_tied_phase(make_args, caplog, written):
    model = tiny_model("gpt2")
    callback = untie.UntieCallback(**written)
    with caplog.at_level(logging.WARNING, logger="untie"):
        tf.Trainer(model=model, args=make_args(max_steps=10), train_dataset=ToyLMDataset(), callbacks=[callback])
        callback.run.close()
    trainer = tf.Trainer(model=tiny_model("gpt2"), args=make_args(max_steps=10), callbacks=[untie.UntieCallback(
        metrics_every=10, pairs="none")])  # fmt: skip
    (measuring,) = [c for c in trainer.callback_handler.callbacks if isinstance(c, untie.UntieCallback)]
    assert measuring.policy_choice.untied_from_start  # measurement knobs do not switch the plan
    assert callback.policy_choice.plan == "as set" and untie.is_tied(model)
    assert "it runs as set" in callback.policy_choice.reason


def test_the_line_at_train_begin_says_the_untie_step_in_the_runs_own_numbers(make_args, caplog):
    model = tiny_model("gpt2")
    callback = untie.UntieCallback(untie_at=0.3, untie_when=None)
    with caplog.at_level(logging.INFO, logger="untie"):  # a schedule set by hand: noted, not warned
        tf.Trainer(
            model=model, args=make_args(max_steps=10), train_dataset=ToyLMDataset(), callbacks=[callback]
        ).train()
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("untie: ")]
    assert said[0] == (
        "untie: trains tied; unties at step 3 (untie_at=0.3 of 10); the head starts as a copy of the embedding, "
        "because the schedule is set (untie_at=0.3, untie_when=None): it runs as set"
    )
    assert callback.run.plan == said[0] and callback.untie_step == 3


def _loaded_llama() -> tf.PreTrainedModel:
    return trained_step_llama(50, 1e-2)


def _in_optimizer(optimizer: torch.optim.Optimizer, parameter: torch.Tensor) -> bool:
    return any(p is parameter for group in optimizer.param_groups for p in group["params"])


def test_an_optimizer_built_first_gets_the_head_the_default_unties_at_once():
    """`Untier(model, optimizer)`: the optimizer was built for the tied model; the default unties a loaded model at
    once, and the copied head joins that optimizer and trains on its own."""
    model = _loaded_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    untier = untie.Untier(model, optimizer, max_steps=4)
    head, embedding = model.lm_head.weight, model.get_input_embeddings().weight
    assert head is not embedding and torch.equal(head, embedding) and _in_optimizer(optimizer, head)
    at_attach = head.detach().clone()
    batch = step_task()[:16]
    for _ in range(2):
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        untier.step()
    assert (untier.untie_step, untier.untie_reason) == (0, "start") and not torch.equal(head, at_attach)
    untier.close()


@pytest.mark.parametrize("trained", [True, False], ids=["loaded", "fresh"])
def test_trainer_given_its_optimizer_trains_the_head_the_default_unties(make_args, trained):
    """`Trainer(optimizers=(optimizer, None))`: the head untied before the first step (a copy of a loaded model's
    embedding, or a fresh model's draw) joins the optimizer the user built, so it trains; a fresh model in the share
    default's lowest band (23% of its parameters in the embedding) also gets its input embedding's 16x group there."""
    if trained:
        model, data = _loaded_llama(), [{"input_ids": row, "labels": row} for row in step_task()]
    else:
        model, data = tiny_model("llama"), ToyLMDataset()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    callback = untie.UntieCallback()
    trainer = tf.Trainer(
        model=model,
        args=make_args(max_steps=3, per_device_train_batch_size=8),
        train_dataset=data,
        callbacks=[callback],
        optimizers=(optimizer, None),
    )
    trainer.train()
    head, embedding = model.lm_head.weight, model.get_input_embeddings().weight
    assert callback.untie_step == 0 and callback.run.decision.head_init == ("copy" if trained else "model")
    assert head is not embedding and _in_optimizer(optimizer, head) and len(optimizer.state[head]) > 0  # it stepped
    assert not torch.equal(head, embedding)
    assert role_groups(optimizer) == (() if trained else ("input_embedding",))


def test_a_policy_set_with_a_tied_phase_asked_for_names_the_schedule_it_ignores():
    config = untie.UntieConfig(policy="untie-at-start", untie_at=0.5)
    with pytest.warns(UserWarning, match=r"untie_at=0.5 changes nothing here: policy='untie-at-start' trains this"):
        untier = untie.Untier(_loaded_llama(), config=config, max_steps=4)
    assert untier.policy_choice.untied_from_start
    untier.close()
    baseline = untie.UntieConfig(policy="untie-at-start", untie_at=None, untie_when=None)  # a tied baseline, ignored
    with pytest.warns(UserWarning, match=r"untie_at=None changes nothing here"):
        untie.Untier(_loaded_llama(), config=baseline, max_steps=4).close()
    exact = untie.UntieConfig(policy="untie-at-start", untie_at=0, untie_when=None)  # what the policy does: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        untie.Untier(_loaded_llama(), config=exact, max_steps=4).close()


def test_trainer_given_its_optimizer_resumes_an_untied_checkpoint_with_the_head_in_it(make_args, tmp_path):
    """A checkpoint saved after the untie, resumed by a Trainer given its own optimizer (the head joins that optimizer
    before its state loads), with a tied phase set (the model then arrives tied at the resume) and with the default."""
    rows = [{"input_ids": row, "labels": row} for row in step_task()]
    for name, settings in (("set", {"untie_at": 2, "untie_when": None}), ("default", {})):
        out = str(tmp_path / name)
        args = make_args(
            output_dir=out, max_steps=4, save_strategy="steps", save_steps=4, per_device_train_batch_size=8
        )
        model = _loaded_llama()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        callbacks = [untie.UntieCallback(**settings)]
        tf.Trainer(
            model=model, args=args, train_dataset=rows, callbacks=callbacks, optimizers=(optimizer, None)
        ).train()
        resumed = _loaded_llama()
        optimizer = torch.optim.AdamW(resumed.parameters(), lr=1e-3)
        args = make_args(output_dir=out, max_steps=6, save_strategy="no", per_device_train_batch_size=8)
        callback = untie.UntieCallback(**settings)
        trainer = tf.Trainer(
            model=resumed, args=args, train_dataset=rows, callbacks=[callback], optimizers=(optimizer, None)
        )
        trainer.train(resume_from_checkpoint=f"{out}/checkpoint-4")
        head = resumed.lm_head.weight
        assert head is not resumed.get_input_embeddings().weight and _in_optimizer(optimizer, head), name
        assert len(optimizer.state[head]) > 0, name
