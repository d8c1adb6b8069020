"""The default's drawn head is provisional (`untie.structure.head_start`): at the first forward it is kept only where
the model predicts no better with a copy of its embedding, so trained weights the embedding's statistics misread as
fresh are never drawn over (issue 67). Each case below drew a head over trained weights before the check existed."""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F
import transformers as tf
from conftest import trained_step_llama

from untie import UntieCallback, Untier
from untie.structure import head_start
from untie.structure.head_start import CHUNK, FLOOR, aligned_targets, judge
from untie.structure.policy import weights_evidence
from untie.structure.surgery import input_weight, is_tied, output_weight
from untie.testing import (
    STEP_VOCAB,
    first_step_at_lr_zero,
    loss_on,
    step_llama_config,
    step_task,
    tiny_model,
    train_on_step_task,
)

VOCAB = STEP_VOCAB
llama_config = step_llama_config
#: The policy that draws the head of every model built fresh. The step task's Llama holds 48% of its parameters in
#: the embedding, a share the default ("by-share") trains with a tied phase (no draw to judge); the check itself is
#: the same under the default's untied bands (`tests/test_share_default.py`).
DRAWS = "untie-at-start"


trained_llama = trained_step_llama  # a tied Llama trained on the step task (seed 0), trained once per setting


# -- the verdict itself ------------------------------------------------------------------------------------------------
def test_judge_keeps_a_draw_where_the_copy_is_another_draw_and_copies_where_it_predicts():
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2000, 16, generator=generator)
    drawn = 0.02 * torch.randn(VOCAB, 16, generator=generator)
    fresh_copy = 0.02 * torch.randn(VOCAB, 16, generator=generator)
    targets = torch.randint(VOCAB, (2000,), generator=generator)
    fresh = judge(hidden, targets, drawn, fresh_copy)
    assert fresh.start == "model" and abs(fresh.advantage) < fresh.bound
    # A copy that has learned a little: each target's row leans towards the hidden states that predict it.
    learned = fresh_copy.clone()
    learned.index_add_(0, targets, 0.02 * hidden)
    trained = judge(hidden, targets, drawn, learned)
    assert trained.start == "copy" and trained.advantage > max(FLOOR, trained.bound)
    assert "trained" in trained.detail and f"{trained.positions:,} positions" in trained.detail


def test_judge_copies_where_nothing_can_be_scored():
    empty = judge(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long), torch.zeros(5, 4), torch.zeros(5, 4))
    assert empty.start == "copy"


# -- the cases of issue 67 ---------------------------------------------------------------------------------------------
def _first_forward_with_untier(model: torch.nn.Module, batch: torch.Tensor) -> tuple[Untier, float]:
    return _first_forward_with_untier_started(Untier(model, max_steps=10, policy=DRAWS), model, batch)


def test_a_body_trained_against_a_frozen_tied_embedding_keeps_its_head_as_a_copy():
    trained = trained_llama(60, 3e-3, freeze_embedding=True)
    assert weights_evidence(trained).verdict == "drawn"  # the embedding alone reads as fresh: the case
    model = tf.LlamaForCausalLM(llama_config())
    model.load_state_dict(trained.state_dict())  # handed over by hand: nothing names a checkpoint
    batch = step_task(seed=1)
    before = loss_on(trained, batch)
    untier, first = _first_forward_with_untier(model, batch)
    assert not is_tied(model) and torch.equal(output_weight(model), input_weight(model))
    assert first == pytest.approx(before, abs=1e-5)  # the first step's loss is the trained model's
    assert untier.policy_choice.head_init == "copy"
    assert "at the first batch, the model predicts with its tied head better" in untier.plan
    assert untier.plan.startswith("untie: trains untied from step 0; the head starts as a copy")


def test_a_fresh_model_keeps_its_drawn_head():
    torch.manual_seed(3)
    model = tf.LlamaForCausalLM(llama_config())
    untier = Untier(model, max_steps=10, policy=DRAWS)
    drawn = output_weight(model).detach().clone()
    assert not torch.equal(drawn, input_weight(model))  # drawn at attach, as before
    untier_run, _ = _first_forward_with_untier_started(untier, model, step_task(seed=1))
    assert torch.equal(output_weight(model), drawn)
    assert untier_run.policy_choice.head_init == "model"
    assert "predicts no better with its tied head than with a drawn one" in untier_run.plan


def _first_forward_with_untier_started(untier: Untier, model, batch) -> tuple[Untier, float]:
    """One step at lr 0 of a `model` the `untier` attached: the untier, and the first forward's loss."""
    return untier, first_step_at_lr_zero(untier, model, batch)


def _trainer(model, folder, steps: int = 1, lr: float = 0.0) -> tf.Trainer:
    data = [{"input_ids": row, "labels": row} for row in step_task(rows=16, seed=1)]
    args = tf.TrainingArguments(
        output_dir=folder, max_steps=steps, per_device_train_batch_size=16, learning_rate=lr, logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=0,
    )  # fmt: skip
    return tf.Trainer(model=model, args=args, train_dataset=data, callbacks=[UntieCallback(policy=DRAWS)])


def test_weights_loaded_after_the_trainer_is_built_keep_their_head(tmp_path, caplog):
    trained = trained_llama(200, 3e-3)
    batch = step_task(rows=16, seed=1)
    torch.manual_seed(7)
    trainer = _trainer(tf.LlamaForCausalLM(llama_config()), str(tmp_path))  # read as fresh at Trainer(...)
    trainer.model.load_state_dict(trained.state_dict())  # then the trained weights arrive
    with caplog.at_level(logging.WARNING, logger="untie"):
        trainer.train()
    model = trainer.model
    assert torch.equal(output_weight(model), input_weight(model))  # lr 0: the head is as the first step found it
    loss_at_step_1 = next(h["loss"] for h in trainer.state.log_history if "loss" in h)
    assert loss_at_step_1 == pytest.approx(loss_on(trained, batch), abs=1e-3)
    assert loss_at_step_1 < math.log(VOCAB) - 1  # trained, not a fresh head's chance level
    assert any("the head starts as a copy" in r.getMessage() for r in caplog.records)


def t5_config(initializer_factor: float = 1.0) -> tf.T5Config:
    return tf.T5Config(
        vocab_size=VOCAB, d_model=32, d_ff=64, d_kv=16, num_layers=1, num_decoder_layers=1, num_heads=2,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, dropout_rate=0.0,
        initializer_factor=initializer_factor,
    )  # fmt: skip


def test_a_lightly_trained_t5_from_pretrained_keeps_its_head(tmp_path):
    torch.manual_seed(0)
    t5 = tf.T5ForConditionalGeneration(t5_config())
    data = step_task(rows=64, length=12)
    optimizer = torch.optim.AdamW(t5.parameters(), lr=3e-3)
    for step in range(20):
        batch = data[(step * 16) % 64 :][:16]
        t5(input_ids=batch, labels=(batch * 7 + 3) % VOCAB).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    t5.save_pretrained(tmp_path / "t5")
    model = tf.T5ForConditionalGeneration.from_pretrained(tmp_path / "t5")
    probe = step_task(rows=16, length=12, seed=1)
    targets = (probe * 7 + 3) % VOCAB
    with torch.no_grad():
        before = float(model(input_ids=probe, labels=targets).loss)
    untier = Untier(model, max_steps=10, from_scratch=None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    untier.start(optimizer)
    first = float(model(input_ids=probe, labels=targets).loss)
    untier.step()
    if untier.policy_choice.untied_from_start:  # read as fresh by its embedding: the first batch decides
        assert untier.policy_choice.head_init == "copy"
    assert first == pytest.approx(before, abs=1e-4)


def test_a_resumed_run_keeps_its_checkpoints_head(tmp_path):
    """The check never judges a resumed run's head: it comes from the checkpoint, trained."""
    torch.manual_seed(3)
    model = tf.LlamaForCausalLM(llama_config())
    untier = Untier(model, max_steps=10, policy=DRAWS)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    untier.start(optimizer)
    batch = step_task(seed=1)
    for _ in range(3):
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        untier.step()
    state, weights = untier.state_dict(), {k: v.clone() for k, v in model.state_dict().items()}
    optim_state = optimizer.state_dict()

    torch.manual_seed(3)
    resumed = tf.LlamaForCausalLM(llama_config())
    again = Untier(resumed, max_steps=10, policy=DRAWS)
    optimizer = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    again.start(optimizer)
    resumed.load_state_dict(weights)
    optimizer.load_state_dict(optim_state)
    again.load_state_dict(state)
    assert again.run.structure.first_batch is None
    resumed(input_ids=batch, labels=batch)
    assert torch.equal(output_weight(resumed), weights["lm_head.weight"])


# -- settings the plan does not use are named; your word settles the head's start --------------------------------------
def test_from_scratch_with_untie_at_zero_draws_the_head_as_the_docs_say():
    trained = trained_llama(200, 3e-3)
    Untier(trained, max_steps=10, from_scratch=True, untie_at=0, untie_when=None)
    assert not is_tied(trained) and not torch.equal(output_weight(trained), input_weight(trained))


def test_from_scratch_under_a_set_schedule_is_named_as_unused():
    torch.manual_seed(3)
    with pytest.warns(UserWarning, match=r"from_scratch=True changes nothing here: the schedule is set"):
        Untier(tf.LlamaForCausalLM(llama_config()), max_steps=10, from_scratch=True, untie_at=5)


def test_head_init_model_on_a_trained_model_is_named_as_unused_or_drawn_over_as_said():
    with pytest.warns(UserWarning, match=r"head_init='model' draws a head untied before the first step; this run"):
        untier = Untier(trained_llama(200, 3e-3), max_steps=10, head_init="model", policy="fresh-untied")
    assert untier.policy_choice.plan == "as set"
    untier.close()
    trained = trained_llama(200, 3e-3)
    with pytest.warns(UserWarning, match=r"head_init='model' draws the head over a model that counts as trained"):
        untier = Untier(trained, max_steps=10, head_init="model")  # the default unties at once: drawn, as asked
    assert untier.policy_choice.untied_from_start and not torch.equal(output_weight(trained), input_weight(trained))


def test_tie_init_ties_a_checkpoint_this_library_untied(tmp_path):
    """The README: a model that arrives untied stays untied under the defaults; tie_init="mean" ties it first. That held
    for any untied model but one this library had untied (its config marker was read first, and tie_init ignored)."""
    import untie

    model = trained_llama(200, 3e-3)
    untie.untie_embeddings(model)
    with torch.no_grad():
        output_weight(model).add_(0.01)  # the head trained apart
    model.save_pretrained(tmp_path / "untied")
    reloaded = tf.LlamaForCausalLM.from_pretrained(tmp_path / "untied")
    mean = (input_weight(reloaded) + output_weight(reloaded)).detach() / 2
    Untier(reloaded, max_steps=10, tie_init="mean")
    assert is_tied(reloaded) and torch.allclose(input_weight(reloaded), mean)


def test_a_fresh_model_under_trainer_is_not_told_of_a_trigger_rule_it_never_runs(tmp_path, caplog):
    torch.manual_seed(3)
    with caplog.at_level(logging.WARNING, logger="untie"):
        trainer = _trainer(tf.LlamaForCausalLM(llama_config()), str(tmp_path))
        trainer.train()
    assert trainer.callback_handler.callbacks[0].untie_step == 0
    assert not [r for r in caplog.records if "pair-free rule" in r.getMessage()]


# -- an independent tester's cases (issue 67 review) -------------------------------------------------------------------
@pytest.mark.parametrize("bf16", [False, True])
def test_weights_loaded_after_the_trainer_under_autocast_train_the_first_step_on_their_head(tmp_path, bf16):
    """Under bf16 autocast the check's cast of the drawn head was cached for the rest of the first forward, so the
    first step trained on the drawn head although the verdict copied the embedding."""
    trained = trained_llama(200, 3e-3)
    batch = step_task(rows=16, seed=1)
    torch.manual_seed(7)
    trainer = _trainer(tf.LlamaForCausalLM(llama_config()), str(tmp_path))
    trainer.args.bf16 = bf16
    trainer.model.load_state_dict(trained.state_dict())
    trainer.train()
    loss_at_step_1 = next(h["loss"] for h in trainer.state.log_history if "loss" in h)
    assert loss_at_step_1 == pytest.approx(loss_on(trained, batch), abs=0.05 if bf16 else 1e-3)


def granite_config() -> tf.GraniteConfig:
    return tf.GraniteConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=True, logits_scaling=8.0,
    )  # fmt: skip


def test_a_model_that_scales_the_heads_output_is_judged_at_its_own_scale():
    """Granite divides the head's logits by 8 before the loss: scored raw, a trained tied head read as far worse than
    a drawn one, and the draw was kept over trained weights."""
    torch.manual_seed(0)
    trained = train_on_step_task(tf.GraniteForCausalLM(granite_config()), 60, 3e-3, freeze_embedding=True)
    assert weights_evidence(trained).verdict == "drawn"  # the embedding and the norms untouched: only the function
    model = tf.GraniteForCausalLM(granite_config())
    model.load_state_dict(trained.state_dict())
    batch = step_task(seed=1)
    untier, first = _first_forward_with_untier(model, batch)
    assert untier.policy_choice.head_init == "copy" and first == pytest.approx(loss_on(trained, batch), abs=1e-5)


def test_the_draw_keeps_the_output_modules_bias():
    model = tiny_model("bert")
    head = model.get_output_embeddings()
    with torch.no_grad():
        head.bias.fill_(0.25)  # a trained bias: the draw is of the weight alone
    Untier(model, max_steps=10, from_scratch=True, untie_at=0, untie_when=None)
    assert not is_tied(model) and torch.equal(head.bias, torch.full_like(head.bias, 0.25))


def test_trainers_evaluation_on_start_reports_the_head_the_run_trains(tmp_path):
    """Issue 78, item 2: a body trained against its frozen tied embedding reads as fresh, so the default draws a head;
    Trainer's `eval_on_start` evaluation is judged as the first batch, so step 0 reports the trained model's loss
    (the head a copy), not the provisional draw's."""
    trained = trained_llama(60, 3e-3, freeze_embedding=True)
    model = tf.LlamaForCausalLM(llama_config())
    model.load_state_dict(trained.state_dict())
    held_out = step_task(rows=16, seed=2)
    trainer = _trainer(model, str(tmp_path))
    trainer.eval_dataset = [{"input_ids": row, "labels": row} for row in held_out]
    trainer.args.eval_on_start = True
    trainer.args.per_device_eval_batch_size = 16
    trainer.train()
    at_start = next(h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h)
    assert at_start == pytest.approx(loss_on(trained, held_out), abs=1e-4)
    assert torch.equal(output_weight(trainer.model), input_weight(trainer.model))  # lr 0: the copy the check made


def test_an_evaluation_on_start_without_labels_leaves_the_verdict_to_the_first_training_batch(tmp_path):
    """The evaluation on start is judged only where it can tell: with no labelled position in it, a fresh model's
    drawn head is not turned into a copy there; the first training batch judges it, and keeps the draw."""
    torch.manual_seed(3)
    trainer = _trainer(tf.LlamaForCausalLM(llama_config()), str(tmp_path))
    unlabelled = [{"input_ids": row, "labels": torch.full_like(row, -100)} for row in step_task(rows=16, seed=2)]
    trainer.eval_dataset = unlabelled
    trainer.args.eval_on_start = True
    trainer.args.per_device_eval_batch_size = 16
    trainer.train()
    assert not torch.equal(output_weight(trainer.model), input_weight(trainer.model))  # lr 0: the draw kept
    callback = next(c for c in trainer.callback_handler.callbacks if isinstance(c, UntieCallback))
    assert "predicts no better with its tied head than with a drawn one" in callback.plan


def test_forwards_without_gradients_are_not_judged_and_padding_is_not_evidence():
    """Evaluation or generation before training passes untouched (no verdict, no collective); the first forward that
    trains is judged, on the positions that can tell (padding and repeated tokens left out)."""
    torch.manual_seed(5)
    model = tf.LlamaForCausalLM(llama_config())
    model.config.pad_token_id = 0
    untier = Untier(model, max_steps=10, policy=DRAWS)
    drawn = output_weight(model).detach().clone()
    ids = step_task(rows=16, seed=1)
    ids[:, 12:] = 0  # right padding: pad -> pad repeats a fresh tied model "predicts"
    mask = (ids != 0).long()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    assert untier.run.structure.first_batch is not None and torch.equal(output_weight(model), drawn)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    untier.start(optimizer)
    model(input_ids=ids, attention_mask=mask).logits.sum().backward()  # no labels: the input ids, padding left out
    assert untier.run.structure.first_batch is None and untier.policy_choice.head_init == "model"
    assert torch.equal(output_weight(model), drawn)


def test_a_state_saved_at_step_0_keeps_the_check_for_the_draw_it_holds():
    torch.manual_seed(3)
    model = tf.LlamaForCausalLM(llama_config())
    untier = Untier(model, max_steps=10, policy=DRAWS)
    untier.start(torch.optim.AdamW(model.parameters(), lr=0.0))
    state, weights = untier.state_dict(), {k: v.clone() for k, v in model.state_dict().items()}

    torch.manual_seed(3)
    resumed = tf.LlamaForCausalLM(llama_config())
    again = Untier(resumed, max_steps=10, policy=DRAWS)
    again.start(torch.optim.AdamW(resumed.parameters(), lr=0.0))
    resumed.load_state_dict(weights)
    again.load_state_dict(state)
    assert again.run.structure.first_batch is not None  # the draw saved at step 0 was never judged: it still will be


def test_weights_loaded_after_untier_and_before_the_first_step_are_kept_and_said():
    """The user attaches a fresh model (the default draws its head), then loads trained tied weights into it before
    the first step: the loaded matrix fills the head too. The run keeps it, and its line says so (it said the head
    was drawn)."""
    trained = trained_llama(60, 3e-3)
    batch = step_task(rows=16, seed=1)
    torch.manual_seed(7)
    model = tf.LlamaForCausalLM(llama_config())
    untier = Untier(model, max_steps=10, policy=DRAWS)
    assert not torch.equal(output_weight(model), input_weight(model))  # drawn at attach
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    untier.start(optimizer)
    model.load_state_dict(trained.state_dict())
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    optimizer.step()
    untier.step()
    assert float(loss) == pytest.approx(loss_on(trained, batch), abs=1e-5)
    assert untier.policy_choice.head_init == "copy"
    assert untier.plan.startswith("untie: trains untied from step 0; the head starts as a copy")
    assert "weights loaded after the run was attached replaced the draw" in untier.plan


# -- what the check costs and what it scores (issue 78, items 4 and 8) ------------------------------------------------
def test_the_check_scores_at_most_half_the_positions_the_head_runs_on():
    """A training step runs the head forward and backward over every position; the check runs two heads forward over
    at most half of them, so it costs less than the step at any vocabulary."""
    model = tf.LlamaForCausalLM(llama_config())
    ids = step_task(rows=4, length=24, seed=1)
    hidden = torch.randn(4, 24, 32)
    found = aligned_targets(model, hidden, (), {"input_ids": ids, "labels": ids})
    assert found is not None and 0 < found[1].numel() <= 4 * 24 // 2


def test_the_temperature_sweep_holds_one_temperatures_logits_at_a_time():
    """The sweep over `TEMPERATURES` once held every temperature's logits of a chunk at once (13 x 128 x V floats:
    218 MB at V = 32,768); it now holds the positions' logits and one temperature's."""
    vocab, width = 32768, 8
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(CHUNK, width, generator=generator)
    targets = torch.randint(vocab, (CHUNK,), generator=generator)
    heads = [0.02 * torch.randn(vocab, width, generator=generator) for _ in range(2)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profile:
        judge(hidden, targets, *heads)
    largest = max(event.self_cpu_memory_usage for event in profile.events())
    assert largest <= 2 * CHUNK * vocab * 4  # the positions' float32 logits (and one temporary of their size)


def test_every_position_is_scored_and_the_temperature_is_chosen_on_those_the_budget_holds(monkeypatch):
    """Positions beyond what `LOGIT_BUDGET` holds at once are scored too (a chunk at a time): capping them to the
    budget left 128 positions at V = 262,144, too few to see a lightly trained head."""
    vocab, count = 300, 500
    monkeypatch.setattr(head_start, "LOGIT_BUDGET", vocab * 64)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(count, 8, generator=generator)
    targets = torch.randint(vocab, (count,), generator=generator)
    head = 0.5 * torch.randn(vocab, 8, generator=generator)
    losses = head_start._losses(hidden, targets, head, None)
    sweep = head_start._spaced(count, 64, hidden.device)
    logits = hidden[sweep] @ head.T
    means = [float(F.cross_entropy(t * logits, targets[sweep])) for t in head_start.TEMPERATURES]
    best = head_start.TEMPERATURES[min(range(len(means)), key=means.__getitem__)]
    assert losses.shape == (count,)
    assert torch.allclose(
        losses, F.cross_entropy(best * hidden @ head.T, targets, reduction="none").double(), atol=1e-5
    )
    assert judge(hidden, targets, head, 0.5 * torch.randn(vocab, 8, generator=generator)).positions == count


def test_on_few_positions_the_bound_reads_students_t_and_a_logit_of_minus_infinity_needs_no_full_sweep(monkeypatch):
    """Three positions' standard error is itself a guess: 3 of them at 3 standard errors made fresh models of a 1 x 4
    batch copies (2 in 30, an independent tester); the bound reads Student's t (19.2 errors at 3 positions)."""
    assert head_start._sigmas(2) == pytest.approx(19.21, abs=0.01)
    assert head_start._sigmas(1000) == pytest.approx(head_start.SIGMAS, abs=0.01)
    assert all(head_start._sigmas(v) > head_start._sigmas(v + 1) for v in range(1, 60))
    differences = torch.tensor([0.30, 0.28, 0.35], dtype=torch.float64)  # the copy ahead by 0.31 on 3 positions
    error = float(differences.std()) / math.sqrt(3)
    assert 0.31 > head_start.SIGMAS * error and 0.31 < head_start._sigmas(2) * error
    calls = []
    original = head_start._loss_and_slope
    monkeypatch.setattr(head_start, "_loss_and_slope", lambda *a: calls.append(1) or original(*a))
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(0))
    logits[:, 7] = -math.inf  # a token the head never predicts (a masked one)
    picked = logits[:, 3]
    head_start._best_scale(logits, picked)
    assert len(calls) <= 5  # a probability of 0 times a logit of -inf added NaN, and forced all 13 temperatures


def test_the_check_holds_its_logits_in_float32_whatever_the_default_dtype():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        indices = head_start._spaced(5000, 4096, torch.device("cpu"))
        generator = torch.Generator().manual_seed(0)
        hidden = torch.randn(40, 8, generator=generator, dtype=torch.float32)
        heads = [0.02 * torch.randn(300, 8, generator=generator, dtype=torch.float32) for _ in range(2)]
        verdict = judge(hidden, torch.randint(300, (40,), generator=generator), *heads)
    finally:
        torch.set_default_dtype(previous)
    assert indices.unique().numel() == 4096 and indices[0] == 0 and indices[-1] == 4999
    assert verdict.start == "model" and verdict.positions == 40


def test_a_decoders_positions_are_masked_by_the_decoders_mask_not_the_encoders():
    model = tf.T5ForConditionalGeneration(t5_config())
    labels = torch.tensor([[7, 8, 9, 11]])
    hidden = torch.randn(1, 4, 32)
    kwargs = {"input_ids": torch.tensor([[3, 4, 5, 6]]), "attention_mask": torch.tensor([[1, 1, 0, 0]])}
    found = aligned_targets(model, hidden, (), {**kwargs, "labels": labels})
    assert found is not None and found[1].numel() == 2  # half of 4 positions, none masked by the encoder's mask
    decoder_mask = torch.tensor([[1, 0, 0, 0]])
    found = aligned_targets(model, hidden, (), {**kwargs, "labels": labels, "decoder_attention_mask": decoder_mask})
    assert found is not None and found[1].tolist() == [7]


def test_a_decoders_position_that_repeats_the_label_before_it_is_not_evidence():
    """A fresh tied encoder-decoder predicts the token its decoder position reads (the label before it) as a fresh
    causal LM predicts its input token: those positions are left out, as they are for a causal LM."""
    model = tf.T5ForConditionalGeneration(t5_config())
    labels = torch.tensor([[5, 5, 6, 7, 7, 7, 8, 9], [-100] * 8])
    hidden = torch.randn(2, 8, 32)
    found = aligned_targets(model, hidden, (), {"input_ids": torch.tensor([[3, 4], [3, 4]]), "labels": labels})
    assert found is not None
    assert found[1].tolist() == [5, 6, 7, 8, 9]  # the first reads the start token; 5 -> 5 and 7 -> 7 are out
