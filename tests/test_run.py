"""`UntieRun`, the run object both adapters drive, on its own: a fake adapter (a plain loop calling the documented
phases: attach, start, then arm / measure / end_of_step per optimizer step) with no Trainer and no
accelerate. Covers prepare, arming and measuring, the trigger, the deadline, the untie, the saved state and its
restore, and the structure a resumed model must have."""

from __future__ import annotations

import json
import math

import pytest
import torch

import untie
from untie import UntieConfig, Untier
from untie.adapters.callback import TRAINER_CALLBACK
from untie.adapters.untier import CUSTOM_LOOP
from untie.checkpoints.saved_state import UntieStateError, weights_fingerprint
from untie.core.phases import RUN_TRANSITIONS
from untie.core.run import SAVED_ATTRIBUTES, Adapter, RunOrderError, UntieRun
from untie.decision.plan import SavedFacts
from untie.structure.surgery import is_tied, tie_embeddings, untie_embeddings
from untie.testing import TINY_MODELS, ToyLMDataset, tiny_model


class FakeAdapter:
    """The smallest adapter: one micro-batch per optimizer step, the calls in the order `untie.core.run` documents."""

    def __init__(self, config: UntieConfig, model=None, tying_mode: str = "live") -> None:
        self.model = model if model is not None else tiny_model("llama")
        if tying_mode == "emulated":
            config = config.replace(tying_mode="emulated")
        self.run = UntieRun(config, Adapter("FakeAdapter", "FakeAdapter(tokenizer=...)"))
        self.run.attach(self.model)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.data = ToyLMDataset(n=8)
        self.step = 0
        self.reasons: dict[int, str] = {}

    def begin(self, saved: dict | None = None, step: int = 0, max_steps: int = 20) -> None:
        self.step = step
        state = None
        if saved:  # a saved run's attributes, in the state layout both adapters save
            state = self.run.state_dict(step, weights=weights_fingerprint(self.model))
            state["attributes"].update(saved)
        self.run.start(self.optimizer, step, max_steps, state)

    def train(self, steps: int) -> list[float]:
        losses = []
        for _ in range(steps):
            step = self.step + 1
            self.run.arm(step)
            batch = self.data[step % len(self.data)]
            loss = self.model(input_ids=batch["input_ids"][None], labels=batch["labels"][None]).loss
            loss.backward()
            self.run.measure(step)
            self.optimizer.step()
            self.optimizer.zero_grad()
            reason = self.run.end_of_step(step)
            if reason:
                self.reasons[step] = reason
            self.step = step
            losses.append(loss.item())
        return losses


def _untied_from_its_config():
    make_config, model_class = TINY_MODELS["llama"]
    config = make_config()
    config.tie_word_embeddings = False
    torch.manual_seed(0)
    return model_class(config)


def test_prepare_ties_an_untied_model_only_when_asked_and_keeps_it_untied_with_untie_at_zero():
    untied = _untied_from_its_config()
    head = untied.get_output_embeddings().weight
    with pytest.warns(UserWarning, match="FakeAdapter: the model arrived untied .* trains untied"):
        adapter = FakeAdapter(UntieConfig(untie_when=None), model=untied)
    adapter.begin()  # the defaults never drop a trained matrix
    assert not is_tied(untied) and untied.get_output_embeddings().weight is head
    assert adapter.run.untied and adapter.run.untie_reason == "start"
    untied = _untied_from_its_config()
    assert not is_tied(untied)
    with pytest.warns(UserWarning, match="FakeAdapter: the model arrived untied; tying it"):
        FakeAdapter(UntieConfig(untie_when=None, tie_init="input"), model=untied)
    assert is_tied(untied)
    kept = _untied_from_its_config()
    adapter = FakeAdapter(UntieConfig(untie_at=0, untie_when=None), model=kept)
    adapter.begin()
    assert not is_tied(kept) and adapter.run.untied and adapter.run.untie_reason == "start"


def test_prepare_in_emulated_mode_gives_the_head_its_own_parameter():
    adapter = FakeAdapter(UntieConfig(untie_at=4, untie_when=None, metrics_every=0), tying_mode="emulated")
    head, embedding = adapter.model.get_output_embeddings().weight, adapter.model.get_input_embeddings().weight
    assert head is not embedding and torch.equal(head, embedding) and adapter.run.structure.emulation is not None
    adapter.begin()
    adapter.train(3)
    assert torch.equal(head, embedding)  # trained as tied
    adapter.train(1)
    assert adapter.reasons == {4: "deadline"} and adapter.run.structure.emulation is None


def test_measurements_happen_on_metrics_steps_only_and_feed_the_history():
    adapter = FakeAdapter(UntieConfig(untie_at=None, untie_when=None, metrics_every=3))
    adapter.begin()
    adapter.train(7)
    assert [h["step"] for h in adapter.run.measurements.history] == [3, 6]
    assert {"cosine", "cancellation", "norm_ratio"} <= set(adapter.run.measurements.history[0])
    assert adapter.run.take_latest()["untie/tied"] == 1.0


def test_the_deadline_unties_at_its_step_with_the_optimizer_state_copied():
    adapter = FakeAdapter(UntieConfig(untie_at=5, untie_when=None, metrics_every=0))
    adapter.begin()
    adapter.train(5)
    assert adapter.reasons == {5: "deadline"} and not is_tied(adapter.model)
    head = adapter.model.get_output_embeddings().weight
    embedding = adapter.model.get_input_embeddings().weight
    assert torch.equal(adapter.optimizer.state[head]["exp_avg"], adapter.optimizer.state[embedding]["exp_avg"])
    assert adapter.run.untie_step == 5 and adapter.run.untie_reason == "deadline"


def test_a_trigger_that_fires_unties_at_the_measurement_step_before_the_deadline():
    rule = {"signal": "cancellation", "threshold": -10.0, "smoothing": 0.0, "warmup": 0, "patience": 2}
    adapter = FakeAdapter(UntieConfig(untie_at=15, untie_when=rule, metrics_every=2))
    adapter.begin()
    adapter.train(6)
    assert adapter.reasons == {4: "trigger"}  # measurements at 2 and 4: the second in a row fires
    assert adapter.run.untie_reason == "trigger" and adapter.run.measurements.probe is None
    assert math.isfinite(next(h for h in adapter.run.measurements.history if h["step"] == 4)["trigger"])
    assert "knn_overlap" in adapter.run.measurements.history[-1]  # after the untie: the drift between the two spaces


def test_the_saved_state_restores_the_trigger_and_the_history_up_to_the_step():
    rule = {"signal": "cancellation", "threshold": -10.0, "smoothing": 0.0, "warmup": 0, "patience": 3}
    adapter = FakeAdapter(UntieConfig(untie_at=None, untie_when=rule, metrics_every=2))
    adapter.begin()
    adapter.train(4)
    saved = adapter.run.state_attributes()
    assert set(saved) == set(SAVED_ATTRIBUTES) and saved["trigger_state"]["streak"] == 2
    saved["history"].append({"step": 99})  # a later measurement (from a run that went on) is dropped on restore
    resumed = FakeAdapter(UntieConfig(untie_at=None, untie_when=rule, metrics_every=2))
    resumed.begin(saved, step=4)
    assert [h["step"] for h in resumed.run.measurements.history] == [2, 4]
    resumed.train(2)
    assert resumed.reasons == {6: "trigger"}  # the streak carried over: the third measurement fires


def test_the_one_state_format_round_trips_through_json_and_is_checked():
    rule = {"signal": "cancellation", "threshold": -10.0, "smoothing": 0.0, "warmup": 0, "patience": 3}
    adapter = FakeAdapter(UntieConfig(untie_at=None, untie_when=rule, metrics_every=2))
    adapter.begin()
    adapter.train(4)
    state = json.loads(json.dumps(adapter.run.state_dict(4)))  # what either adapter writes to disk
    assert (state["format"], state["adapter"], state["global_step"], state["weights"]) == (3, "FakeAdapter", 4, None)
    state["adapter"] = "UntieCallback"  # the Trainer adapter's state: it may leave out the weights' fingerprint
    resumed = FakeAdapter(UntieConfig(untie_at=None, untie_when=rule, metrics_every=2))
    resumed.run.load_state_dict(state, "the saved state")
    assert (
        resumed.run.measurements.history == adapter.run.measurements.history
        and resumed.run.divergence.state_dict() == adapter.run.divergence.state_dict()
    )
    with pytest.raises(UntieStateError, match="the saved state has untie state format 2"):
        resumed.run.load_state_dict({**state, "format": 2}, "the saved state")
    # Only a Trainer state may leave out the weights' fingerprint (Trainer saves a checkpoint folder as a whole).
    with pytest.raises(UntieStateError, match="'weights' is None"):
        resumed.run.load_state_dict({**state, "adapter": "Untier"}, "the saved state")


def test_a_resume_past_a_deadline_unties_at_the_resume_step():
    adapter = FakeAdapter(UntieConfig(untie_at=3, untie_when=None, metrics_every=0))
    adapter.begin({}, step=5)
    assert adapter.run.untied and adapter.run.untie_step == 5 and adapter.run.untie_reason == "deadline"


def test_a_state_that_says_untied_on_a_tied_model_is_refused():
    adapter = FakeAdapter(UntieConfig(untie_at=10, untie_when=None, metrics_every=0))
    with pytest.raises(RuntimeError, match="says the model was untied"):
        adapter.begin({"untied": True, "untie_step": 3, "untie_reason": "deadline"}, step=5)


def test_an_untied_model_at_resume_keeps_the_saved_untie_step_and_reason():
    adapter = FakeAdapter(UntieConfig(untie_at=10, untie_when=None, metrics_every=0))
    untie_embeddings(adapter.model)
    adapter.begin({"untied": True, "untie_step": 3, "untie_reason": "trigger"}, step=5)
    assert (adapter.run.untie_step, adapter.run.untie_reason) == (3, "trigger")


@pytest.mark.parametrize(
    ("config_mode", "run_mode", "head_stored", "outcome"),
    [
        ("live", "live", True, "refused: emulated checkpoint, live asked"),
        ("auto", "live", True, "emulated"),
        ("auto", "emulated", False, "refused: live checkpoint, emulating run"),
        ("auto", "live", False, "live"),
    ],
)
def test_the_saved_tying_implementation_decides_the_resumed_structure(config_mode, run_mode, head_stored, outcome):
    adapter = FakeAdapter(UntieConfig(untie_at=10, untie_when=None, tying_mode=config_mode), tying_mode=run_mode)
    if outcome.startswith("refused"):
        with pytest.raises(ValueError, match="tied phase with"):
            adapter.run.expect_checkpoint(SavedFacts("checkpoint-5", untied=False, head_stored=head_stored))
        return
    adapter.run.expect_checkpoint(SavedFacts("checkpoint-5", untied=False, head_stored=head_stored))
    assert (adapter.run.structure.emulation is not None) == (outcome == "emulated")
    assert is_tied(adapter.model) == (outcome == "live")


def test_warnings_point_at_the_line_the_user_wrote_from_either_adapter():
    untied = _untied_from_its_config()
    with pytest.warns(UserWarning, match="arrived untied") as through_run:
        FakeAdapter(UntieConfig(untie_when=None), model=untied)  # UntieRun.prepare, two frames down
    assert through_run[0].filename == __file__
    model = tiny_model("llama")
    untier = Untier(model, max_steps=4, metrics_every=50, untie_when="cancellation")
    optimizer = torch.optim.AdamW(model.parameters())
    untier.start(optimizer)
    model(input_ids=torch.tensor([[3, 4, 5]]), labels=torch.tensor([[3, 4, 5]])).loss.backward()
    with pytest.warns(UserWarning, match="metrics_every=50 leaves the divergence trigger") as through_untier:
        optimizer.step()  # torch's step -> Untier's pre-step hook -> UntieRun.announce -> _warn_short_run
    assert through_untier[0].filename == __file__
    with pytest.warns(UserWarning, match="already tied") as direct:
        tie_embeddings(model)
    assert direct[0].filename == __file__


def test_a_warning_under_trainer_points_at_the_trainer_the_user_built(tmp_path):
    import transformers as tf

    from untie import UntieCallback

    args = tf.TrainingArguments(output_dir=str(tmp_path), max_steps=2, report_to=[], use_cpu=True)
    with pytest.warns(UserWarning, match="UntieCallback: the model arrived untied") as caught:
        tf.Trainer(model=_untied_from_its_config(), args=args, train_dataset=ToyLMDataset(n=4),
                   callbacks=[UntieCallback(untie_when=None)])  # fmt: skip
    assert caught[0].filename == __file__


def test_untier_start_and_resume_are_separate_and_the_run_announces_itself_once():
    """`start` begins a fresh run without a word; a checkpoint loaded before the first step begins the resumed run in
    its place; what the run has to say is said once, at its first optimizer step, about the resumed run."""
    import warnings

    def short_untier(model):
        return Untier(model, max_steps=40, metrics_every=50, untie_when="cancellation", untie_at=None)

    saving_model = tiny_model("llama")
    saved = short_untier(saving_model)
    saved.start(torch.optim.AdamW(saving_model.parameters()))
    saved.global_step = 12  # a checkpoint of step 12 (its weights are the model's: nothing trained yet)
    state = json.loads(json.dumps(saved.state_dict()))

    model = tiny_model("llama")
    model.load_state_dict(saving_model.state_dict())
    optimizer = torch.optim.AdamW(model.parameters())
    untier = short_untier(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        untier.start(optimizer)  # silent: a resume may follow
        untier.load_state_dict(state)
    assert untier.global_step == 12
    model(input_ids=torch.tensor([[3, 4, 5]]), labels=torch.tensor([[3, 4, 5]])).loss.backward()
    with pytest.warns(UserWarning, match="leaves the divergence trigger") as caught:
        optimizer.step()
        untier.step()
        optimizer.step()
        untier.step()
    assert len([w for w in caught if "leaves the divergence trigger" in str(w.message)]) == 1
    assert untier.global_step == 14


def test_the_phases_are_enforced_in_one_place_and_a_call_out_of_order_names_the_order():
    """attach, then start, then the steps: a step before start, a start after a step, or an attach mid-run raise
    RunOrderError (an UntieError and a RuntimeError); a run may start again before its first step (a resume)."""
    run = UntieRun(UntieConfig(untie_at=4, untie_when=None, metrics_every=2))
    with pytest.raises(RunOrderError, match=r"start\(\) in phase 'new'.*attach \(before the optimizer\), start"):
        run.start(None, 0, 8)
    model = tiny_model("llama")
    run.attach(model)
    with pytest.raises(RunOrderError, match=r"end_of_step\(\) in phase 'attached'"):
        run.end_of_step(1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run.start(optimizer, 0, 8)
    run.start(optimizer, 0, 8)  # again before the first step: a custom loop resuming in place
    run.arm(1)
    run.end_of_step(1)
    with pytest.raises(RunOrderError, match="has taken steps; it cannot start again"):
        run.start(optimizer, 1, 8)
    with pytest.raises(RunOrderError, match=r"attach\(\) in phase 'stepping'"):
        run.attach(model)
    assert isinstance(RunOrderError("x"), untie.UntieError) and issubclass(RunOrderError, RuntimeError)
    run_calls = {"attach", "hold", "settle", "adopt", "expect", "expect_checkpoint", "start", "arm", "measure"}
    assert set(RUN_TRANSITIONS) == run_calls | {"end_of_step", "close"}
    adapters_calls = {"UntieCallback.on_train_begin", "Untier.start", "Untier.step", "Untier.load_state_dict"}
    assert set(TRAINER_CALLBACK.transitions) | set(CUSTOM_LOOP.transitions) == adapters_calls
    run.close()
    with pytest.raises(RunOrderError, match=r"arm\(\) in phase 'closed'"):
        run.arm(2)


def test_a_checkpoint_expected_before_attach_and_an_untie_held_back_are_phases_of_the_table():
    """Two sub-states are phases, checked like the others: "expecting" (a checkpoint's structure known before a
    model is attached: `attach` applies it) and "unsettled" (attached, the default's untie before the first step held
    back until `settle` knows the checkpoint; `start` before it is out of order)."""
    run = UntieRun(UntieConfig())
    run.expect_checkpoint(SavedFacts("checkpoint-9", untied=True))
    assert (run.phase, run.saved.where) == ("expecting", "checkpoint-9")
    model = tiny_model("gpt2")
    run.attach(model)
    assert (run.phase, run.saved.untied, is_tied(model)) == ("attached", True, False)  # the checkpoint's structure
    with pytest.raises(RunOrderError, match=r"settle\(\) in phase 'attached'"):
        run.settle(None)

    fresh = tiny_model("gpt2")
    held = UntieRun(UntieConfig())
    held.attach(fresh, settle_later=True)
    assert (held.phase, is_tied(fresh)) == ("unsettled", True)  # nothing drawn before the checkpoint is known
    with pytest.raises(RunOrderError, match=r"start\(\) in phase 'unsettled'"):
        held.start(torch.optim.AdamW(fresh.parameters(), lr=1e-3), 0, 8)
    held.settle(None)  # a fresh start: the default trains this fresh model untied from step 0
    assert (held.phase, is_tied(fresh), held.deadline.untie_at) == ("attached", False, 0)
    held.close()
    assert held.phase == "closed"


def test_the_custom_loops_calls_are_checked_in_the_same_table():
    """`Untier`'s order (start once, steps after it, a state loaded after start and before the first step) is the
    run's table (`untie.core.phases`), the rows `Untier` adds,, raising the same `RunOrderError` naming the order."""
    model = tiny_model("gpt2")
    untier = untie.Untier(model, max_steps=4, untie_at=2, untie_when=None)
    with pytest.raises(RunOrderError, match=r"Untier.step\(\) in phase 'attached'.*untier.start\(optimizer\) once"):
        untier.step()
    with pytest.raises(RunOrderError, match=r"Untier.load_state_dict\(\) in phase 'attached'"):
        untier.load_state_dict({})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    untier.start(optimizer)
    with pytest.raises(RunOrderError, match=r"Untier.start\(\) in phase 'started'"):
        untier.start(optimizer)
    state = untier.state_dict()
    batch = untie.testing.ToyLMDataset()[0]
    model(input_ids=batch["input_ids"][None], labels=batch["labels"][None]).loss.backward()
    optimizer.step()
    untier.step()
    with pytest.raises(RunOrderError, match=r"Untier.load_state_dict\(\) in phase 'stepping'"):
        untier.load_state_dict(state)
    untier.close()
    with pytest.raises(RunOrderError, match=r"Untier.step\(\) in phase 'closed'"):
        untier.step()
