"""`untie.Untier`: the custom-loop API (plain PyTorch and accelerate), against Trainer and under DDP / resume."""

from __future__ import annotations

import copy
import json
import logging
import warnings

import pytest
import torch
import transformers as tf
from conftest import training_args
from launch import torchrun

import untie
from untie.structure.role_rates import role_groups
from untie.testing import ToyLMDataset, tiny_model

STEPS = 20


def _trigger_settings() -> dict:
    rule = untie.UntieWhen(signal="cosine", threshold=2.0, smoothing=0.5, warmup=0, patience=3)
    return dict(untie_at=None, untie_when=rule, metrics_every=2, pairs=[(3, 4)])


def _full_batch_loop(model, untier, data: ToyLMDataset, steps: int, first: int = 1) -> None:
    """One full batch per optimizer step, as Trainer takes it with per_device_train_batch_size=len(data)."""
    model.train()
    batch = {"input_ids": data.ids, "labels": data.ids.clone()}
    for _ in range(first, steps + 1):
        model(**batch).loss.backward()
        untier.optimizer.step()
        untier.optimizer.zero_grad()
        untier.step()


def test_trigger_fires_in_a_custom_loop_as_under_trainer_on_the_same_data(tmp_path):
    """Trainer's events and the custom loop's optimizer hook drive the same run logic at the same steps."""
    data = ToyLMDataset(n=8)
    trained = tiny_model("llama")  # no dropout: the two loops compute the same numbers
    callback = untie.UntieCallback(**_trigger_settings())
    args = training_args(
        tmp_path, max_steps=STEPS, per_device_train_batch_size=8, weight_decay=0.0, max_grad_norm=0.0,
        lr_scheduler_type="constant",
    )  # fmt: skip
    tf.Trainer(model=trained, args=args, train_dataset=data, callbacks=[callback]).train()

    model = tiny_model("llama")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.0)
    untier = untie.Untier(model, optimizer, max_steps=STEPS, **_trigger_settings())
    _full_batch_loop(model, untier, data, STEPS)

    assert (untier.untie_step, untier.untie_reason) == (callback.untie_step, callback.untie_reason) == (6, "trigger")
    assert untier.divergence.fired_step == callback.divergence.fired_step
    assert [h["step"] for h in untier.history] == [h["step"] for h in callback.history] == list(range(2, 21, 2))
    for ours, theirs in zip(untier.history, callback.history, strict=True):
        assert ours.keys() == theirs.keys()
        torch.testing.assert_close(
            torch.tensor([ours[k] for k in ours]), torch.tensor([theirs[k] for k in ours]), rtol=1e-4, atol=1e-5,
            equal_nan=True,
        )  # fmt: skip
    for ours, theirs in zip(model.parameters(), trained.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_plain_pytorch_resume_before_and_after_the_untie_equals_the_uninterrupted_run():
    """`state_dict()` saved with the model and optimizer; `load_state_dict` first gives the model its structure."""
    data = ToyLMDataset(n=8)

    def new_run():
        model = tiny_model("llama")
        optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.1)
        return model, untie.Untier(
            model, optimizer, max_steps=12, untie_when=None, untie_at=6, metrics_every=2, pairs=[(3, 4)]
        )

    model, untier = new_run()
    saved = {}
    model.train()
    batch = {"input_ids": data.ids, "labels": data.ids.clone()}
    for step in range(1, 13):
        model(**batch).loss.backward()
        untier.optimizer.step()
        untier.optimizer.zero_grad()
        untier.step()
        if step in (4, 9):  # before and after the untie at 6; the state goes through JSON, as a file would take it
            saved[step] = {
                "model": copy.deepcopy(model.state_dict()),  # keeps a tied head and embedding one tensor
                "optimizer": copy.deepcopy(untier.optimizer.state_dict()),
                "untie": json.loads(json.dumps(untier.state_dict())),
            }
    assert (untier.untie_step, untier.untie_reason) == (6, "deadline")
    for step, checkpoint in saved.items():
        resumed_model, resumed = new_run()
        resumed.load_state_dict(checkpoint["untie"])
        resumed_model.load_state_dict(checkpoint["model"])
        resumed.optimizer.load_state_dict(checkpoint["optimizer"])
        assert untie.is_tied(resumed_model) == (step < 6) and resumed.global_step == step
        _full_batch_loop(resumed_model, resumed, data, 12, first=step + 1)
        assert (resumed.untie_step, resumed.untie_reason) == (6, "deadline")
        assert [h["step"] for h in resumed.history] == [h["step"] for h in untier.history]
        for name, value in model.state_dict().items():
            torch.testing.assert_close(resumed_model.state_dict()[name], value, rtol=0, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def accelerate_runs(tmp_path_factory):
    """2 ranks (DDP on gloo), gradient accumulation 2, untie at step 4; resumed from save_state at 3 and at 6."""
    out = tmp_path_factory.mktemp("custom-loop")
    torchrun("custom_loop_run.py", out, "full")
    names = ("run", "resume-3", "resume-6")
    return {name: [torch.load(out / f"{name}-rank{r}.pt") for r in (0, 1)] for name in names}


@pytest.mark.distributed
def test_accelerate_ddp_loop_unties_mid_run_and_ranks_stay_bit_identical(accelerate_runs):
    rank0, rank1 = accelerate_runs["run"]
    assert rank0["distributed_type"] == "MULTI_CPU"
    assert rank0["untie_step"] == rank1["untie_step"] == 4 and rank0["global_step"] == 10  # accumulation: 10 steps
    assert not rank0["tied"] and not torch.equal(rank0["output"], rank0["input"])  # the head trained on its own
    for name, value in rank0["params"].items():
        assert torch.equal(value, rank1["params"][name]), name
    steps = [step for step, logs in rank0["logged"]]
    assert steps == [2, 4, 6, 8, 10] and rank0["logged"][1][1]["untie/untie_step"] == 4  # what step() returns to log
    for rank in (rank0, rank1):  # close() took every install off the DDP model, the optimizer and the Accelerator
        assert rank["leftovers"] == [] and all(rank["foreign_kept"].values()), (rank["leftovers"], rank["foreign_kept"])


@pytest.mark.distributed
@pytest.mark.parametrize("resumed", ["resume-3", "resume-6"])
def test_accelerate_resume_from_save_state_before_or_after_the_untie_equals_the_uninterrupted_run(
    accelerate_runs, resumed
):
    uninterrupted = accelerate_runs["run"][0]
    for rank in accelerate_runs[resumed]:
        assert (rank["untie_step"], rank["untie_reason"]) == (4, "deadline")
        assert rank["history"] == uninterrupted["history"]
        for name, value in uninterrupted["params"].items():
            torch.testing.assert_close(rank["params"][name], value, rtol=0, atol=1e-6, msg=name)


@pytest.mark.distributed
def test_without_the_head_gradient_sync_the_accelerate_loop_drifts_apart(tmp_path):
    """Negative control for the test above: what `untie_embeddings(...)` alone does under DDP."""
    torchrun("custom_loop_run.py", tmp_path, "nosync")
    rank0, rank1 = (torch.load(tmp_path / f"nosync-rank{r}.pt") for r in (0, 1))
    assert not torch.equal(rank0["output"], rank1["output"])


@pytest.mark.distributed
def test_plain_pytorch_ddp_loop_unties_mid_run_and_ranks_stay_bit_identical(tmp_path):
    """No accelerate: torch's DistributedDataParallel with no_sync accumulation; the Untier syncs the new head."""
    torchrun("custom_loop_run.py", tmp_path, "plain")
    rank0, rank1 = (torch.load(tmp_path / f"plain-rank{r}.pt") for r in (0, 1))
    assert rank0["untie_step"] == rank1["untie_step"] == 4 and not rank0["tied"]
    for rank in (rank0, rank1):  # close() took every install off (the head's gradient sync too)
        assert rank["leftovers"] == [] and all(rank["foreign_kept"].values()), (rank["leftovers"], rank["foreign_kept"])
    assert not torch.equal(rank0["output"], rank0["input"])
    for name, value in rank0["params"].items():
        assert torch.equal(value, rank1["params"][name]), name


def test_an_optimizer_built_before_the_structure_changes_is_refused_with_the_fix():
    model = tiny_model("gpt2")
    optimizer = torch.optim.AdamW(model.parameters())
    # Emulated tying gives the head its own parameter, which this optimizer was built without.
    with pytest.raises(RuntimeError, match=r"emulated tying.*Create the Untier before the optimizer"):
        untie.Untier(model, optimizer, untie_when=None, untie_at=4, tying_mode="emulated")


def test_a_fractional_untie_at_set_needs_max_steps():
    """A fraction you set needs the run's length; the default plan (untied from step 0) does not (test_early_errors)."""
    with pytest.raises(ValueError, match=r"untie_at=0\.3 is a fraction of the run: pass max_steps"):
        untie.Untier(tiny_model("gpt2"), untie_at=0.3)


def test_step_before_start_and_a_tied_checkpoint_into_an_untied_run_are_refused():
    model = tiny_model("gpt2")
    untier = untie.Untier(model, untie_when=None, untie_at=0)
    with pytest.raises(RuntimeError, match="start"):
        untier.step()
    untier.start(torch.optim.AdamW(model.parameters()))
    tied_state = untie.Untier(tiny_model("gpt2"), untie_when=None, untie_at=5).state_dict()
    with pytest.raises(ValueError, match="untied the model before it started"):
        untier.load_state_dict(tied_state)


def test_accelerate_load_state_without_the_untie_state_names_the_fix(tmp_path):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = tiny_model("gpt2")
    untier = untie.Untier(model, max_steps=10, accelerator=accelerator)
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = accelerator.prepare(model, optimizer)
    untier.start(optimizer)
    (tmp_path / "plain").mkdir()
    with pytest.raises(FileNotFoundError, match="untie_state.json"):
        accelerator.load_state(str(tmp_path / "plain"))
    untier.close()
    accelerator.free_memory()


def test_an_optimizer_from_accelerate_without_its_accelerator_is_refused_naming_the_fix():
    """An independent tester's case: the guide's accumulate loop with `accelerator=` left out untied after optimizer
    step 3 where untie_at=6 asked (every micro-batch counted), and save_state wrote no run state (a resume began again
    at step 0). The optimizer says it came from accelerate: refused before anything is installed."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = tiny_model("llama")
    prepared, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    fix = r"pass Untier\(model, optimizer, accelerator=accelerator"
    with pytest.raises(ValueError, match=fix):
        untie.Untier(prepared, optimizer, max_steps=12, untie_at=6, untie_when=None)
    assert untie.is_tied(model) and not model.get_input_embeddings()._forward_pre_hooks
    untier = untie.Untier(prepared, max_steps=12, untie_at=6, untie_when=None)
    with pytest.raises(ValueError, match="micro-batch"):
        untier.start(optimizer)
    untier.close()
    untier = untie.Untier(prepared, optimizer, max_steps=12, untie_at=6, untie_when=None, accelerator=accelerator)
    for _micro in range(12):
        with accelerator.accumulate(prepared):
            accelerator.backward(
                prepared(input_ids=torch.tensor([[1, 2, 3, 4]]), labels=torch.tensor([[1, 2, 3, 4]])).loss
            )
            optimizer.step()
            optimizer.zero_grad()
        untier.step()
    assert untier.global_step == 6 and untier.untie_step == 6  # optimizer steps, not micro-batches
    untier.close()
    accelerator.free_memory()


@pytest.mark.parametrize("per_node", [False, True], ids=["once", "save_on_each_node"])
def test_accelerate_save_state_writes_the_untie_state_where_the_model_goes(per_node, tmp_path, monkeypatch):
    """On a node's first process that is not the global main one (multi-node), the untie state is written only if
    accelerate writes the model there too (save_on_each_node): each node's checkpoint folder resumes on its own."""
    from accelerate import Accelerator, PartialState
    from accelerate.utils import ProjectConfiguration

    accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(save_on_each_node=per_node))
    model = tiny_model("gpt2")
    untier = untie.Untier(model, max_steps=10, untie_when=None, accelerator=accelerator)
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = accelerator.prepare(model, optimizer)
    untier.start(optimizer)
    monkeypatch.setattr(PartialState, "is_main_process", property(lambda self: False))  # node 1, local rank 0
    assert accelerator.is_local_main_process and not accelerator.is_main_process
    accelerator.save_state(str(tmp_path / "node1"))
    assert (tmp_path / "node1" / "untie_state.json").exists() == per_node
    assert any((tmp_path / "node1").glob("model*")) == per_node  # accelerate's own rule for the weights
    untier.close()
    accelerator.free_memory()


def _tied_state_at_step_4():
    """A tied-phase state (weights, optimizer, untie state) saved at step 4 of a run set to untie at 8 of 10."""
    data = ToyLMDataset(n=8)
    model = tiny_model("llama")
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    untier = untie.Untier(model, optimizer, max_steps=10, untie_at=8, untie_when=None)
    _full_batch_loop(model, untier, data, 4)
    assert untie.is_tied(model)
    saved = {
        "model": copy.deepcopy(model.state_dict()),
        "optimizer": copy.deepcopy(optimizer.state_dict()),
        "untie": json.loads(json.dumps(untier.state_dict())),
    }
    return (
        {"input_ids": data.ids, "labels": data.ids.clone()},
        saved,
        sum(len(g["params"]) for g in optimizer.param_groups),
    )


def test_a_default_untier_resuming_a_tied_state_continues_its_plan_without_the_head_it_drew():
    """A tied-phase state saved under `untie_at=8` of 10, resumed at step 4 by a default `Untier`: the head the default
    drew at `Untier()` is dropped (issue 67: the state loads into the tied structure it was saved from), and the run
    continues the checkpoint's schedule, which the user left unset here (issue 78: it used to untie at the default's
    deadline, 30% of 10, a plan neither run asked for)."""
    batch, saved, tied_count = _tied_state_at_step_4()

    resumed_model = tiny_model("llama")
    # The defaults: a fresh model (23% of its parameters in the embedding), untied from step 0 (drawn), the input
    # embedding at 16x in a param group of its own; the checkpoint has neither, so both are undone before it loads.
    resumed = untie.Untier(resumed_model, max_steps=10)
    resumed_optimizer = torch.optim.AdamW(resumed_model.parameters(), lr=5e-3)
    resumed.start(resumed_optimizer)
    with pytest.warns(UserWarning) as said:
        resumed.load_state_dict(saved["untie"])
    said = " ".join(str(w.message) for w in said)
    assert "the head the default made at Untier() for a fresh start (drawn or copied, never trained) is dropped" in said
    assert "changed settings" not in said
    resumed_model.load_state_dict(saved["model"])
    assert not role_groups(resumed_optimizer) and resumed.run.rates.scales["input_embedding"] == 1.0
    resumed_optimizer.load_state_dict(saved["optimizer"])  # refused by torch before: 17 parameters against 16
    assert (resumed.config.untie_at, resumed.config.untie_when) == (8, None)
    for step in range(5, 9):
        resumed_model(**batch).loss.backward()
        resumed_optimizer.step()
        resumed_optimizer.zero_grad()
        resumed.step()
        assert untie.is_tied(resumed_model) == (step < 8)
    assert (resumed.untie_step, resumed.untie_reason) == (8, "deadline")
    assert sum(len(group["params"]) for group in resumed_optimizer.param_groups) == tied_count + 1


def test_an_untier_resuming_a_tied_state_past_a_deadline_set_anew_unties_at_the_first_forward():
    """Issue 67: a tied-phase state saved under `untie_at=8` of 10, resumed at step 4 under `untie_at=0.3` (step 3,
    passed): the run used to untie inside `start`, so the head joined the optimizer before the user loaded the saved
    optimizer state, and torch refused it. The untie now waits for the first forward: the state loads into the tied
    structure it was saved from, and the step then trains untied."""
    batch, saved, tied_count = _tied_state_at_step_4()

    resumed_model = tiny_model("llama")
    resumed = untie.Untier(resumed_model, max_steps=10, untie_at=0.3)  # untie_when unset: the checkpoint's None
    resumed_optimizer = torch.optim.AdamW(resumed_model.parameters(), lr=5e-3)
    resumed.start(resumed_optimizer)
    with pytest.warns(UserWarning) as said:
        resumed.load_state_dict(saved["untie"])
    said = " ".join(str(w.message) for w in said)
    assert "resumed at step 4 with changed settings (untie_at: 8 -> 0.3); " in said
    assert "To keep the checkpoint's plan, pass untie_at=8 (the checkpoint's), or leave it unset" in said
    resumed_model.load_state_dict(saved["model"])
    resumed_optimizer.load_state_dict(saved["optimizer"])
    assert untie.is_tied(resumed_model) and resumed.run.pending_untie == 4
    loss = resumed_model(**batch).loss  # the untie, before the first forward
    assert not untie.is_tied(resumed_model) and (resumed.untie_step, resumed.untie_reason) == (4, "deadline")
    embedding, head = resumed_model.get_input_embeddings().weight, resumed_model.get_output_embeddings().weight
    assert torch.equal(head, embedding) and head is not embedding
    loss.backward()
    resumed_optimizer.step()
    resumed.step()  # the loaded weights are checked: the head is the checkpoint's shared matrix
    assert sum(len(group["params"]) for group in resumed_optimizer.param_groups) == tied_count + 1
    assert resumed.plan.startswith("untie: resumed at step 4: the checkpoint's run was tied and its deadline")
    assert "continues its tied phase" not in resumed.plan and "trains untied from step 4" not in resumed.plan


def test_the_untie_due_at_a_resume_survives_an_evaluation_first_and_says_no_trigger_notice(caplog):
    """The untie waiting for the first forward, where that forward is an evaluation under `torch.inference_mode()`:
    the head is a normal parameter that trains (it was an inference tensor, and the next step failed). No trigger runs
    after it, so the pair-free rule's notice is not said."""
    batch, saved, _ = _tied_state_at_step_4()
    model = tiny_model("llama")
    untier = untie.Untier(model, max_steps=10, untie_at=0.3)  # a deadline set anew, passed at the resume
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    untier.start(optimizer)
    with pytest.warns(UserWarning, match="changed settings"):
        untier.load_state_dict(saved["untie"])
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    with caplog.at_level(logging.INFO, logger="untie"), torch.inference_mode():
        model(**batch)
    assert (untier.untie_step, untier.untie_reason) == (4, "deadline")
    assert not model.get_output_embeddings().weight.is_inference()
    model(**batch).loss.backward()
    optimizer.step()
    untier.step()
    assert model.get_output_embeddings().weight.grad is not None
    assert not any("pair-free rule" in record.getMessage() for record in caplog.records)


def test_the_plan_line_names_the_rule_in_force_not_its_signal():
    """Issue 78: a tied phase under the evidence rule (the default with pairs) said "divergence trigger (gap)", the
    signal the gap rule reads too; the line names the rule, and an unnamed rule by its signal and threshold."""
    from untie.testing import tiny_tokenizer

    lines = {}
    for name, untie_when in (("default", "divergence"), ("gap", "gap"), ("own", untie.UntieWhen("gap", 2.0))):
        model = tiny_model("gpt2")
        untier = untie.Untier(model, max_steps=10, untie_at=0.3, untie_when=untie_when, tokenizer=tiny_tokenizer())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        untier.start(optimizer)
        model(**ToyLMDataset(n=2)[:]).loss.backward()  # the run says its plan when its first step begins
        optimizer.step()
        untier.step()
        lines[name] = untier.plan
        untier.close()
    assert "unties when the divergence trigger (evidence) fires, at step 3" in lines["default"], lines["default"]
    assert "divergence trigger (gap) fires" in lines["gap"], lines["gap"]
    assert "divergence trigger (gap past 2) fires" in lines["own"], lines["own"]


def test_an_optimizer_state_loaded_before_the_runs_is_refused_naming_the_order():
    """A tester's case: `optimizer.load_state_dict` before `untier.load_state_dict`, into the groups the default set
    up for a fresh start, raised torch's "different number of parameter groups". Now the refusal names the order, and
    the documented order still resumes."""

    def train(untier, model, optimizer, steps):
        for _ in range(steps):
            model(**ToyLMDataset(n=2)[:]).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            untier.step()

    saved = tiny_model("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = untie.Untier(saved, max_steps=10, policy="off", untie_at=5, untie_when=None)
        optimizer = torch.optim.AdamW(saved.parameters(), lr=1e-3)
        first.start(optimizer)
        train(first, saved, optimizer, 2)
        state, weights, optimizer_state = first.state_dict(), saved.state_dict(), optimizer.state_dict()
        first.close()

        for order in ("optimizer first", "run state first"):
            model = tiny_model("llama", seed=1)
            untier = untie.Untier(model, max_steps=10)
            resumed = torch.optim.AdamW(model.parameters(), lr=1e-3)
            untier.start(resumed)
            if order == "optimizer first":
                with pytest.raises(untie.RunOrderError, match=r"loaded before the run.s: .* untier.load_state_dict"):
                    resumed.load_state_dict(optimizer_state)
            else:
                untier.load_state_dict(state)
                model.load_state_dict(weights)
                resumed.load_state_dict(optimizer_state)
                train(untier, model, resumed, 1)
                assert untier.global_step == 3 and untie.is_tied(model)
            untier.close()


def test_an_optimizer_state_that_fits_the_sizes_but_not_the_roles_is_refused_at_the_runs_load():
    """A reviewer's case: the checkpoint's groups [11, 1] hold the head apart (head_lr_scale), the default's fresh
    start [11, 1] the input embedding: loaded first, the state fits by size, maps the moments onto the wrong
    parameters, and the first step crashed on a shape. The run's load now refuses it, naming the order."""
    saved = tiny_model("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = untie.Untier(saved, max_steps=10, policy="off", untie_at=2, untie_when=None, head_lr_scale=0.5)
        optimizer = torch.optim.AdamW(saved.parameters(), lr=1e-3)
        first.start(optimizer)
        for _ in range(3):
            saved(**ToyLMDataset(n=2)[:]).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            first.step()
        state, optimizer_state = first.state_dict(), optimizer.state_dict()
        first.close()
        model = tiny_model("llama", seed=1)
        untier = untie.Untier(model, max_steps=10)
        resumed = torch.optim.AdamW(model.parameters(), lr=1e-3)
        untier.start(resumed)
        assert [len(g["params"]) for g in resumed.param_groups] == [len(g["params"]) for g in optimizer.param_groups]
        resumed.load_state_dict(optimizer_state)  # fits by size: torch takes it
        with pytest.raises(untie.RunOrderError, match=r"already holds state, and the head.s group holds another"):
            untier.load_state_dict(state)
        untier.close()
