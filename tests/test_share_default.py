"""Policy "by-share" (issue 77, item 4): the study's default for a model built fresh, by its embedding's share, read
from the bands `scripts/docs_tables.py` writes into `untie/decision/share_bands.py` from the study's records."""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch
import transformers as tf

import untie
from untie.decision import settings as settings_module
from untie.decision import share_bands
from untie.decision.policy_rules import Freshness, PolicyReading, choose
from untie.decision.share_bands import parse_bands
from untie.errors import UntieValueError
from untie.testing import ToyLMDataset, tiny_model

HEADER = "| from | to | choice | untie_at | input embedding's rate | cells | status |\n|---|---|---|---|---|---|---|\n"


def _bands(*rows: str) -> str:
    return HEADER + "\n".join(rows)


COMPLETE = parse_bands(
    _bands(
        "| 0.000000 | 0.410000 | untie@1/3 | 0.333333 | 1x | C | complete |",
        "| 0.410000 | 0.700000 | tied | none | 1x | B | complete |",
        "| 0.700000 | 1.000000 | untied | 0 | 1x | A | complete |",
    )
)
FRESH = Freshness(True, "its embedding reads as a fresh draw")
TRAINED = Freshness(False, "its weights read as trained")


def _choose(share: float, freshness: Freshness = FRESH, bands=COMPLETE):
    reading = PolicyReading(share=share, parameters=1000, freshness=freshness)
    return choose("by-share", tied=True, peft=False, reading=reading, bands=bands)


def test_the_committed_bands_parse_and_the_default_moves_only_once_they_are_complete():
    committed = share_bands.SHARE_DEFAULT
    assert committed.bands, "the generated table holds at least the cells complete so far"
    assert committed.complete == (committed.status == "complete")
    assert settings_module.DEFAULT_POLICY == ("by-share" if committed.complete else "untie-at-start")
    assert committed.bands[0].low == 0.0 and committed.bands[-1].high == 1.0


@pytest.mark.parametrize(
    ("table", "problem"),
    [
        (_bands("| 0.0 | 0.5 | untied | 0 | 1x | A | complete |"), "do not cover 0 to 1"),
        (_bands("| 0.0 | 0.5 | untied | 0 | 1x | A | complete |", "| 0.6 | 1.0 | tied | none | 1x | B | complete |"),
         "without gaps"),
        (_bands("| 0.0 | 0.5 | untied | 0 | 1x | A | complete |", "| 0.5 | 1.0 | tied | none | 1x | B | pending |"),
         "disagree on the status"),
        (_bands("| 0.0 | 1.0 | untied | 0 | A | complete |"), "6 columns, not 7"),
    ],
)  # fmt: skip
def test_a_malformed_table_is_refused_by_what_is_wrong(table, problem):
    with pytest.raises(UntieValueError, match=problem):
        parse_bands(table)


def test_each_band_chooses_its_plan_for_a_model_built_fresh():
    low = _choose(0.25)
    assert (low.plan, low.untie_at, low.head_init) == ("tied phase", pytest.approx(1 / 3, abs=1e-6), "copy")
    assert "from 0.0% to 41.0% (cell C)" in low.reason and "untie@1/3" in low.reason
    stays = _choose(0.5)
    assert (stays.plan, stays.untie_at) == ("tied phase", None) and "stays tied" in stays.reason
    high = _choose(0.84)
    assert (high.plan, high.head_init) == ("untied from the start", "model")
    assert _choose(1.0).plan == "untied from the start"  # the top edge belongs to the last band


def test_a_loaded_model_unties_at_once_and_pending_bands_run_as_untie_at_start():
    loaded = _choose(0.25, TRAINED)
    assert (loaded.plan, loaded.head_init) == ("untied from the start", "copy")
    pending = parse_bands(_bands("| 0.000000 | 1.000000 | untied | 0 | 1x | A | pending: cell C has no choice yet |"))
    waiting = _choose(0.25, bands=pending)
    assert (waiting.plan, waiting.head_init) == ("untied from the start", "model")
    assert "pending: cell C has no choice yet" in waiting.reason


@pytest.fixture
def by_share_default(monkeypatch):
    """The library as it will be once the bands are complete: one band, a tied phase to 2/3, the default policy."""
    bands = parse_bands(_bands("| 0.000000 | 1.000000 | untie@2/3 | 0.666667 | 1x | B | complete |"))
    monkeypatch.setattr(share_bands, "SHARE_DEFAULT", bands)
    monkeypatch.setattr(settings_module, "DEFAULT_POLICY", "by-share")


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("from_scratch", [None, False])
def test_the_default_by_share_runs_its_tied_phase_and_a_plain_resume_continues_it_exactly(
    by_share_default, make_args, tmp_path, caplog, from_scratch
):
    """A model built fresh in a tied-phase band trains tied to 2/3 of the run (step 8 of 12) with no trigger; resumed
    from a tied checkpoint with its schedule unset, the checkpoint's plan continues: the same untie step and the same
    parameters as the uninterrupted run. `from_scratch=False` at the resume makes its weights count as trained, where
    the policy alone would untie at once."""
    folder = tmp_path / "full"
    args = make_args(output_dir=str(folder), max_steps=12, save_strategy="steps", save_steps=4)
    model, callback = tiny_model("gpt2"), untie.UntieCallback()
    with caplog.at_level("INFO", logger="untie"):
        tf.Trainer(model=model, args=args, train_dataset=ToyLMDataset(), callbacks=[callback]).train()
    assert (callback.untie_step, callback.untie_reason) == (8, "deadline")
    assert callback.run.rule is None  # no trigger
    assert any("the study's default by embedding share" in r.getMessage() for r in caplog.records)
    reference = _params(model)

    resumed, again = tiny_model("gpt2"), untie.UntieCallback(from_scratch=from_scratch)
    args = make_args(output_dir=str(folder), max_steps=12, save_strategy="no")
    trainer = tf.Trainer(model=resumed, args=args, train_dataset=ToyLMDataset(), callbacks=[again])
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        trainer.train(resume_from_checkpoint=str(folder / "checkpoint-4"))
    assert (again.untie_step, again.untie_reason) == (8, "deadline")
    assert "the tied phase its policy chose, so it continues it" in again.run.choice.reason
    assert not again.config.was_set("untie_at")  # continued from the run state's policy, not written as a setting
    assert not [w for w in said if "changes nothing" in str(w.message) or "changed settings" in str(w.message)]
    worst = max((p.detach() - reference[n]).abs().max().item() for n, p in resumed.named_parameters())
    assert worst == 0


def test_a_tied_phase_to_a_fraction_in_a_loop_of_unknown_length_is_refused_naming_the_fixes(by_share_default):
    model = tiny_model("gpt2")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(UntieValueError, match=r"length is unknown\. Pass max_steps.*policy='untie-at-start'"):
        untie.Untier(model, optimizer)
    model = tiny_model("gpt2")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    untier = untie.Untier(model, optimizer, max_steps=9)  # given the length, it plans the tied phase
    assert untier.run.deadline.step == 6


def test_untie_inspect_says_a_bands_plan_in_the_runs_words():
    from untie.decision.lines import default_plan_text

    assert default_plan_text(_choose(0.25), tied=True) == (
        "trains tied; unties at untie_at=0.333333; the head starts as a copy of the embedding"
    )
    assert default_plan_text(_choose(0.5), tied=True).startswith("trains tied; stays tied (untie_at=None")
    assert default_plan_text(_choose(0.84), tied=True).startswith("trains untied from step 0; the head is drawn")


SCALED = parse_bands(_bands("| 0.000000 | 1.000000 | untied-emb16 | 0 | 16x | C | complete |"))


def test_a_scaled_band_trains_the_embedding_at_its_scale_unless_the_user_gave_one_or_the_engine_owns_the_groups():
    from untie.decision.decide import Facts, Settings, decide
    from untie.decision.plan import ModelFacts

    choice = _choose(0.25, bands=SCALED)
    assert (choice.plan, choice.embedding_lr_scale) == ("untied from the start", 16.0)
    assert "the input embedding at 16x the learning rate (embedding_lr_scale" in choice.reason
    reading = PolicyReading(share=0.25, parameters=1000, freshness=FRESH)
    facts = Facts(ModelFacts("tied"), tied=True, reading=reading)

    def scale(config, **fact_overrides):
        decision = decide(dataclasses.replace(facts, **fact_overrides), Settings(config, "UntieCallback"))
        said = [text for text, _ in decision.warnings]
        return decision.embedding_lr_scale, said + (
            ["under DeepSpeed"] if "DeepSpeed" in decision.choice.reason else []
        )

    import untie.decision.share_bands as bands_module

    original = bands_module.SHARE_DEFAULT
    bands_module.SHARE_DEFAULT = SCALED
    try:
        assert scale(untie.UntieConfig(policy="by-share")) == (16.0, [])
        assert scale(untie.UntieConfig(policy="by-share", embedding_lr_scale=1.0)) == (1.0, [])  # given: the user's
        loaded = PolicyReading(share=0.25, parameters=1000, freshness=TRAINED)
        assert scale(untie.UntieConfig(policy="by-share"), reading=loaded) == (1.0, [])  # a loaded model: no scale
        blocked = "DeepSpeed's engine owns the optimizer's param groups"
        under_deepspeed, said = scale(untie.UntieConfig(policy="by-share"), scale_blocked_by=blocked)
        assert under_deepspeed == 1.0 and said == ["under DeepSpeed"]  # the plan's reason says so; no warning
    finally:
        bands_module.SHARE_DEFAULT = original


@pytest.mark.parametrize("from_scratch", [None, False])
def test_the_scaled_default_trains_the_embedding_at_16x_and_a_resume_continues_it_exactly(
    monkeypatch, make_args, tmp_path, from_scratch
):
    """The default in a scaled band: untied from step 0, the input embedding at 16x the learning rate (its own param
    group); a resume with nothing set continues at 16x (the checkpoint's settings record the scale), parameters equal
    to the uninterrupted run's."""
    monkeypatch.setattr(share_bands, "SHARE_DEFAULT", SCALED)
    monkeypatch.setattr(settings_module, "DEFAULT_POLICY", "by-share")
    folder = tmp_path / "full"
    args = make_args(
        output_dir=str(folder), max_steps=8, save_strategy="steps", save_steps=4, lr_scheduler_type="constant"
    )
    model, callback = tiny_model("gpt2"), untie.UntieCallback()
    tf.Trainer(model=model, args=args, train_dataset=ToyLMDataset(), callbacks=[callback]).train()
    assert callback.untie_step == 0
    assert callback.run.rates.current()["untie/lr_input_embedding"] == pytest.approx(16 * args.learning_rate)
    reference = _params(model)

    resumed, again = tiny_model("gpt2"), untie.UntieCallback(from_scratch=from_scratch)
    args = make_args(output_dir=str(folder), max_steps=8, save_strategy="no", lr_scheduler_type="constant")
    trainer = tf.Trainer(model=resumed, args=args, train_dataset=ToyLMDataset(), callbacks=[again])
    trainer.train(resume_from_checkpoint=str(folder / "checkpoint-4"))
    assert again.run.rates.current()["untie/lr_input_embedding"] == pytest.approx(16 * args.learning_rate)
    worst = max((p.detach() - reference[n]).abs().max().item() for n, p in resumed.named_parameters())
    assert worst == 0


def test_untie_inspect_says_the_runs_own_decision_for_a_saved_fresh_model(by_share_default, tmp_path):
    """Issue 79, item 3: `untie inspect` decides through `decide`, so under the by-share default it names the band's
    tied phase for a model saved fresh, in the words a run's line would use."""
    from untie.checkpoints import inspection

    tiny_model("gpt2").save_pretrained(tmp_path)
    report = inspection.describe(tmp_path)["policy"]
    assert report["default"] == "trains tied; unties at untie_at=0.666667; the head starts as a copy of the embedding"
    assert "the study's default by embedding share" in report["because"]


@pytest.mark.parametrize("from_scratch", [None, False])
def test_a_schedule_given_beside_policy_by_share_is_named_as_unused_and_its_resume_is_exact(
    by_share_default, make_args, tmp_path, from_scratch
):
    """`policy="by-share"` set with `untie_at` given: the policy's tied phase runs (to 2/3: step 8 of 12) and a
    warning names the setting it ignores, as for "untie-at-start"; the same config resumed continues it exactly,
    with no warning of changed settings."""
    folder = tmp_path / "full"
    args = make_args(output_dir=str(folder), max_steps=12, save_strategy="steps", save_steps=4)
    model, callback = tiny_model("gpt2"), untie.UntieCallback(policy="by-share", untie_at=10)
    with pytest.warns(UserWarning, match=r"untie_at=10 changes nothing here: policy='by-share' runs its own tied"):
        tf.Trainer(model=model, args=args, train_dataset=ToyLMDataset(), callbacks=[callback]).train()
    assert callback.untie_step == 8
    reference = _params(model)
    resumed, again = tiny_model("gpt2"), untie.UntieCallback(policy="by-share", untie_at=10, from_scratch=from_scratch)
    args = make_args(output_dir=str(folder), max_steps=12, save_strategy="no")
    trainer = tf.Trainer(model=resumed, args=args, train_dataset=ToyLMDataset(), callbacks=[again])
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        trainer.train(resume_from_checkpoint=str(folder / "checkpoint-4"))
    assert again.untie_step == 8
    assert not [w for w in said if "changed settings" in str(w.message)]
    assert max((p.detach() - reference[n]).abs().max().item() for n, p in resumed.named_parameters()) == 0


def test_a_refused_run_length_leaves_nothing_on_the_optimizer(by_share_default):
    model = tiny_model("gpt2")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(UntieValueError, match="length is unknown"):
        untie.Untier(model, optimizer)
    assert not optimizer._optimizer_step_pre_hooks  # the refusal came before the run installed its step hook
    untie.Untier(model, optimizer, max_steps=9)  # the same model and optimizer, given the length


def test_a_drawn_head_the_first_batch_replaces_by_a_copy_trains_at_the_users_rate():
    """The first batch says the weights are trained: as for a loaded model, the band's scale does not apply."""
    from untie.decision.decide import Facts, Settings, decide
    from untie.decision.plan import ModelFacts

    reading = PolicyReading(share=0.25, parameters=1000, freshness=FRESH)
    facts = Facts(ModelFacts("tied"), tied=True, reading=reading, first_batch=("copy", "a copy predicts better"))
    import untie.decision.share_bands as bands_module

    original, bands_module.SHARE_DEFAULT = bands_module.SHARE_DEFAULT, SCALED
    try:
        decision = decide(facts, Settings(untie.UntieConfig(policy="by-share"), "UntieCallback"))
    finally:
        bands_module.SHARE_DEFAULT = original
    assert (decision.head_init, decision.embedding_lr_scale) == ("copy", 1.0)


def test_a_resume_of_a_run_whose_first_batch_kept_the_copy_keeps_the_users_rate(monkeypatch, tmp_path):
    """Weights that arrive trained after the Trainer is built: the first batch keeps the head a copy and the rate the
    user's (1x, not the band's 16x). A resume judges no first batch and its fresh model reads as a draw: the
    checkpoint's settings say 1x, so it continues at 1x, exactly."""
    from test_head_start import llama_config, trained_llama

    from untie.testing import step_task

    monkeypatch.setattr(share_bands, "SHARE_DEFAULT", SCALED)
    monkeypatch.setattr(settings_module, "DEFAULT_POLICY", "by-share")
    trained = trained_llama(200, 3e-3)
    rows = [{"input_ids": row, "labels": row} for row in step_task(rows=64, seed=1)]

    def trainer(folder, save: bool):
        args = tf.TrainingArguments(
            output_dir=str(folder), max_steps=6, per_device_train_batch_size=8, learning_rate=1e-3,
            lr_scheduler_type="constant", logging_steps=1, save_strategy="steps" if save else "no", save_steps=2,
            report_to=[], use_cpu=True, disable_tqdm=True, seed=0,
        )  # fmt: skip
        torch.manual_seed(7)
        callback = untie.UntieCallback()
        return tf.Trainer(model=tf.LlamaForCausalLM(llama_config()), args=args, train_dataset=rows,
                          callbacks=[callback]), callback  # fmt: skip

    first, callback = trainer(tmp_path / "full", save=True)
    first.model.load_state_dict(trained.state_dict())  # the trained weights arrive after the Trainer is built
    first.train()
    assert (callback.run.decision.head_init, callback.run.decision.embedding_lr_scale) == ("copy", 1.0)
    reference = _params(first.model)
    again, resumed = trainer(tmp_path / "again", save=False)
    again.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"))
    assert resumed.run.decision.embedding_lr_scale == 1.0
    assert max((p.detach() - reference[n]).abs().max().item() for n, p in again.model.named_parameters()) == 0


def test_a_scaled_band_never_refuses_a_frozen_embedding_or_a_checkpoint_written_without_the_scale(
    monkeypatch, make_args, tmp_path
):
    """A scale the policy chose yields where it cannot apply: a frozen input embedding (the user's rate; the plan's
    reason says why), and a resume of a checkpoint written without the scale (its layout: 1x), where a scale the user
    gave would be refused."""
    monkeypatch.setattr(share_bands, "SHARE_DEFAULT", SCALED)
    monkeypatch.setattr(settings_module, "DEFAULT_POLICY", "by-share")
    frozen = tiny_model("gpt2")
    frozen.get_input_embeddings().weight.requires_grad_(False)
    callback = untie.UntieCallback()
    tf.Trainer(model=frozen, args=make_args(max_steps=2), train_dataset=ToyLMDataset(), callbacks=[callback]).train()
    assert callback.run.decision.embedding_lr_scale == 1.0
    assert "trains at your rate, not the band's 16x: the input embedding is frozen" in callback.run.choice.reason

    folder = tmp_path / "plain"
    args = make_args(output_dir=str(folder), max_steps=4, save_strategy="steps", save_steps=2)
    plain = untie.UntieCallback(policy="untie-at-start")  # a checkpoint with no embedding group of its own
    tf.Trainer(model=tiny_model("gpt2"), args=args, train_dataset=ToyLMDataset(), callbacks=[plain]).train()
    again = untie.UntieCallback()  # the scaled default at the resume
    args = make_args(output_dir=str(folder), max_steps=4, save_strategy="no")
    trainer = tf.Trainer(model=tiny_model("gpt2"), args=args, train_dataset=ToyLMDataset(), callbacks=[again])
    trainer.train(resume_from_checkpoint=str(folder / "checkpoint-2"))
    assert again.run.decision.embedding_lr_scale == 1.0


def test_a_loop_resuming_a_checkpoint_without_the_scale_withdraws_the_group_its_start_made(monkeypatch):
    """A custom loop resumes the documented way: `Untier()`, `start(optimizer, lr_scheduler)` (the scaled default
    gives the input embedding a 16x group, and the scheduler an entry for it), then the checkpoint, written by a run
    at the user's rate. The group and the scheduler's entry are withdrawn before its optimizer state loads (it used
    to be refused), and the resumed run continues the uninterrupted one exactly."""
    monkeypatch.setattr(share_bands, "SHARE_DEFAULT", SCALED)
    monkeypatch.setattr(settings_module, "DEFAULT_POLICY", "by-share")
    from untie.structure.role_rates import role_groups

    batches = [ToyLMDataset()[i]["input_ids"].unsqueeze(0).repeat(4, 1) for i in range(6)]

    def loop(untier, model, optimizer, scheduler, steps):
        for step in steps:
            model(input_ids=batches[step], labels=batches[step]).loss.backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            untier.step()

    def built(**settings):
        model = tiny_model("llama")
        untier = untie.Untier(model, max_steps=6, **settings)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.8**step)
        untier.start(optimizer, lr_scheduler=scheduler)
        return untier, model, optimizer, scheduler

    untier, model, optimizer, scheduler = built(embedding_lr_scale=1.0)  # the checkpoint's run: the user's rate
    loop(untier, model, optimizer, scheduler, range(3))
    saved = copy.deepcopy((untier.state_dict(), _params(model), optimizer.state_dict(), scheduler.state_dict()))
    loop(untier, model, optimizer, scheduler, range(3, 6))
    reference = _params(model)

    again, resumed, optimizer, scheduler = built()  # the default: a fresh start's 16x group, until the checkpoint
    assert role_groups(optimizer) == ("input_embedding",) and len(scheduler.base_lrs) == len(optimizer.param_groups)
    again.load_state_dict(saved[0])
    assert role_groups(optimizer) == () and len(scheduler.base_lrs) == len(optimizer.param_groups)
    resumed.load_state_dict(saved[1], strict=False)
    optimizer.load_state_dict(saved[2])
    scheduler.load_state_dict(saved[3])
    loop(again, resumed, optimizer, scheduler, range(3, 6))
    assert max((p.detach() - reference[n]).abs().max().item() for n, p in resumed.named_parameters()) == 0


def test_a_checkpoint_of_policy_off_resumed_by_the_plain_default_continues_its_schedule(
    by_share_default, make_args, tmp_path
):
    """A tied-phase checkpoint written under `policy="off"` (its schedule left unset: tied, the trigger, the deadline at
    30%) and resumed by a plain `UntieCallback()`: the checkpoint's policy continues, not the band's tied phase to 2/3
    (which untied 4 steps later and ended 0.004 away from the uninterrupted run, a tester found)."""
    folder = tmp_path / "off"
    args = make_args(output_dir=str(folder), max_steps=12, save_strategy="steps", save_steps=2)
    model, callback = tiny_model("gpt2"), untie.UntieCallback(policy="off")
    tf.Trainer(model=model, args=args, train_dataset=ToyLMDataset(), callbacks=[callback]).train()
    assert (callback.untie_step, callback.untie_reason) == (4, "deadline")  # 30% of 12, the trigger never fired
    reference = _params(model)
    resumed, again = tiny_model("gpt2"), untie.UntieCallback()
    args = make_args(output_dir=str(folder), max_steps=12, save_strategy="no")
    trainer = tf.Trainer(model=resumed, args=args, train_dataset=ToyLMDataset(), callbacks=[again])
    trainer.train(resume_from_checkpoint=str(folder / "checkpoint-2"))
    assert again.config.policy == "off" and (again.untie_step, again.untie_reason) == (4, "deadline")
    assert max((p.detach() - reference[n]).abs().max().item() for n, p in resumed.named_parameters()) == 0


def test_the_plan_says_the_scale_the_run_trains_with_not_the_bands(monkeypatch, make_args, caplog):
    """A user's `embedding_lr_scale` wins over the band's 16x, and the line says the user's (it used to say both)."""
    monkeypatch.setattr(share_bands, "SHARE_DEFAULT", SCALED)
    monkeypatch.setattr(settings_module, "DEFAULT_POLICY", "by-share")
    for scale in (1.0, 4.0):
        callback = untie.UntieCallback(embedding_lr_scale=scale)
        with caplog.at_level("WARNING", logger="untie"):
            tf.Trainer(model=tiny_model("gpt2"), args=make_args(max_steps=2), train_dataset=ToyLMDataset(),
                       callbacks=[callback]).train()  # fmt: skip
        line = callback.plan
        assert "16x" not in line and f"the input embedding trains at your embedding_lr_scale={scale:g}" in line, line
        caplog.clear()


def test_an_optimizer_that_computes_its_own_step_size_takes_no_scale_the_policy_chose(monkeypatch, make_args):
    """Adafactor with `relative_step=True` (and Trainer's `AdafactorSchedule`) computes its own rate, which no group's
    `lr` sets: the band's 16x used to be announced and logged but never applied. The policy's scale now yields, and
    the line says why; a scale the user gives is refused, naming the fix."""
    from transformers.optimization import Adafactor, AdafactorSchedule

    monkeypatch.setattr(share_bands, "SHARE_DEFAULT", SCALED)
    monkeypatch.setattr(settings_module, "DEFAULT_POLICY", "by-share")

    def trainer(callback):
        model = tiny_model("gpt2")
        optimizer = Adafactor(model.parameters(), relative_step=True, warmup_init=True, lr=None)
        return tf.Trainer(model=model, args=make_args(max_steps=2), train_dataset=ToyLMDataset(),
                          callbacks=[callback], optimizers=(optimizer, AdafactorSchedule(optimizer)))  # fmt: skip

    callback = untie.UntieCallback()
    trained = trainer(callback)
    trained.train()
    assert len(trained.optimizer.param_groups) == 1 and callback.run.decision.embedding_lr_scale == 1.0
    assert "not the band's 16x: the optimizer computes its own step size" in callback.plan
    with pytest.raises(UntieValueError, match=r"computes its own step size .* set embedding_lr_scale=1.0"):
        trainer(untie.UntieCallback(embedding_lr_scale=16.0)).train()


def test_a_frozen_tied_embedding_unties_after_a_tied_phase_into_a_frozen_copy_without_a_crash(make_args):
    """A tied phase on a frozen embedding (the default's middle band, or a schedule set) used to stop the run at the
    untie step: the frozen matrix is in no optimizer, and the head could not join it. The head is a frozen copy now,
    and the run says so."""
    model = tiny_model("gpt2")
    model.get_input_embeddings().weight.requires_grad_(False)
    callback = untie.UntieCallback(untie_at=0.5, untie_when=None)
    with pytest.warns(UserWarning, match="the tied embedding is frozen"):
        tf.Trainer(model=model, args=make_args(max_steps=6), train_dataset=ToyLMDataset(), callbacks=[callback]).train()
    assert callback.untie_step == 3 and not untie.is_tied(model) and not model.lm_head.weight.requires_grad
    assert torch.equal(model.lm_head.weight, model.get_input_embeddings().weight)
