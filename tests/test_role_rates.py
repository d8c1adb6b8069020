"""Per-role learning rates (`UntieConfig.embedding_lr_scale`, `head_lr_scale`, `lr_scales_while_tied`): every route
the head takes, the scheduler followed exactly, resumes exact or refused with the fix, bad values one line."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
import transformers as tf
from accelerate import Accelerator
from conftest import assert_resumed_equals
from launch import torchrun

import untie
import untie.core.run
from untie.structure.role_rates import ROLE_KEY
from untie.structure.surgery import inner_optimizer
from untie.testing import ToyLMDataset, tiny_model

SCALES = dict(embedding_lr_scale=0.1, head_lr_scale=2.0)


class _StepRates:
    """The rates each optimizer step used (a step post-hook: after the follower, before the scheduler moves on)."""

    def __init__(self, optimizer) -> None:
        self.rows: list[dict] = []
        self.optimizer = inner_optimizer(optimizer)
        self.handle = self.optimizer.register_step_post_hook(self._record)

    def _record(self, optimizer, *_):
        groups = optimizer.param_groups
        row = {g[ROLE_KEY]: (float(g["lr"]), g["weight_decay"], len(g["params"])) for g in groups if ROLE_KEY in g}
        row[None] = (
            float(groups[0]["lr"]),
            groups[0]["weight_decay"],
            None,
        )  # the source: Trainer's (or the user's) first group
        self.rows.append(row)


class _Recorder(tf.TrainerCallback):
    def __init__(self) -> None:
        self.rates: _StepRates | None = None

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        self.rates = _StepRates(optimizer)


def _train(model, args, callback, optimizers=(None, None), resume=None):
    recorder = _Recorder()
    trainer = tf.Trainer(
        model=model, args=args, train_dataset=ToyLMDataset(), callbacks=[callback, recorder], optimizers=optimizers
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer, recorder.rates.rows


def _loop(model, optimizer, untier, data, steps: int, scheduler=None) -> None:
    """A plain loop: one full batch per optimizer step, the scheduler after the optimizer, `untier.step()` last."""
    for _ in range(steps):
        model(input_ids=data.ids, labels=data.ids).loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad()
        untier.step()


def _every_parameter_once(optimizer, model) -> None:
    """No parameter dropped or duplicated between groups."""
    held = [p for g in inner_optimizer(optimizer).param_groups for p in g["params"]]
    assert len(held) == len({id(p) for p in held})
    assert {id(p) for p in held} == {id(p) for p in model.parameters() if p.requires_grad}


@pytest.mark.parametrize("while_tied", [False, True])
def test_trainer_role_rates_are_scale_times_the_group_rate_at_every_step_of_warmup_and_decay(make_args, while_tied):
    """Trainer builds the optimizer and a warm-up + cosine schedule; a tied phase to step 5, then the split rates."""
    model = tiny_model("gpt2")
    args = make_args(warmup_steps=4, lr_scheduler_type="cosine")
    callback = untie.UntieCallback(untie_at=5, untie_when=None, lr_scales_while_tied=while_tied, **SCALES)
    trainer, rows = _train(model, args, callback)
    assert callback.untie_step == 5 and len(rows) == 12
    for step, row in enumerate(rows, 1):
        source_lr, source_decay, _ = row[None]
        assert row["input_embedding"][1] == row["head"][1] == source_decay == 0.1  # weight decay follows the source
        tied = step <= 5
        embedding = 0.1 if (not tied or while_tied) else 1.0
        head = (0.1 if while_tied else 1.0) if tied else 2.0
        assert row["input_embedding"][0] == embedding * source_lr, step
        if not tied:
            assert row["head"][0] == head * source_lr and row["head"][2] == 1, step
    assert 0 < rows[1][None][0] < rows[3][None][0] and rows[11][None][0] < rows[6][None][0]  # warm-up, then decay
    _every_parameter_once(trainer.optimizer, model)
    logged = [h for h in trainer.state.log_history if "untie/lr_input_embedding" in h]
    assert [h["untie/lr_input_embedding"] for h in logged[:12]] == [r["input_embedding"][0] for r in rows]
    assert "input embedding at 0.1x, head at 2x" in callback.run.plan


def test_a_zero_scale_freezes_the_role_after_the_untie(make_args):
    model = tiny_model("gpt2")
    callback = untie.UntieCallback(untie_at=4, untie_when=None, embedding_lr_scale=0.0)
    embedding_at_untie = {}

    class Snapshot(tf.TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step == 4:
                embedding_at_untie["w"] = model.get_input_embeddings().weight.detach().clone()

    trainer = tf.Trainer(model=model, args=make_args(), train_dataset=ToyLMDataset(), callbacks=[callback, Snapshot()])
    trainer.train()
    assert torch.equal(model.get_input_embeddings().weight, embedding_at_untie["w"])  # weight decay stopped too
    assert not torch.equal(model.get_output_embeddings().weight, embedding_at_untie["w"])


def test_scales_at_one_leave_the_optimizer_as_it_was(make_args):
    """`embedding_lr_scale=1` keeps the user's rate where the default ("by-share") would scale the embedding (a tiny
    GPT-2, 15% of its parameters in the embedding: the band that trains it at 16x): no group is added."""
    model = tiny_model("gpt2")
    trainer, _ = _train(model, make_args(max_steps=2), untie.UntieCallback(embedding_lr_scale=1.0))
    assert all(ROLE_KEY not in g for g in trainer.optimizer.param_groups) and len(trainer.optimizer.param_groups) == 2
    assert not any(k.startswith("untie/lr_") for h in trainer.state.log_history for k in h)


def test_an_optimizer_and_a_lambda_scheduler_passed_to_trainer_get_the_groups(make_args):
    """Trainer(optimizers=(optimizer, scheduler)): the scheduler was built before the split; it is extended."""
    model = tiny_model("gpt2")
    optimizer = torch.optim.AdamW(model.parameters(), lr=4e-3, weight_decay=0.05)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3) * 0.9**step)
    callback = untie.UntieCallback(**SCALES)  # the default: untied from step 0 (a fresh model, drawn head)
    trainer, rows = _train(model, make_args(max_steps=6), callback, optimizers=(optimizer, scheduler))
    assert trainer.optimizer.optimizer is optimizer if hasattr(trainer.optimizer, "optimizer") else True
    expected = [4e-3 * min(1.0, (step + 1) / 3) * 0.9**step for step in range(6)]
    for step, row in enumerate(rows):
        assert math.isclose(row[None][0], expected[step], rel_tol=1e-12)
        assert row["input_embedding"][0] == 0.1 * row[None][0] and row["head"][0] == 2.0 * row[None][0]
        assert row["input_embedding"][1] == row["head"][1] == 0.05
    _every_parameter_once(optimizer, model)


@pytest.mark.parametrize("when", ["built first", "built after"])
def test_untier_routes_with_a_scheduler_built_before_the_split(when):
    """Untier(model, optimizer, lr_scheduler=...) and Untier(model) -> optimizer -> start(optimizer, lr_scheduler)."""
    model = tiny_model("llama")
    data = ToyLMDataset(n=8)
    kwargs = dict(untie_at=3, untie_when=None, max_steps=8, **SCALES)
    if when == "built first":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = tf.get_linear_schedule_with_warmup(optimizer, 2, 8)
        untier = untie.Untier(model, optimizer, lr_scheduler=scheduler, **kwargs)
    else:
        untier = untie.Untier(model, **kwargs)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = tf.get_linear_schedule_with_warmup(optimizer, 2, 8)
        untier.start(optimizer, lr_scheduler=scheduler)
    rates = _StepRates(optimizer)
    _loop(model, optimizer, untier, data, 8, scheduler)
    assert untier.untie_step == 3
    for step, row in enumerate(rates.rows, 1):
        embedding, head = (1.0, None) if step <= 3 else (0.1, 2.0)
        assert row["input_embedding"][0] == embedding * row[None][0]
        if head is not None:
            assert row["head"][0] == head * row[None][0]
    _every_parameter_once(optimizer, model)


def test_a_scheduler_built_before_start_and_not_passed_is_refused_with_the_fix():
    model = tiny_model("gpt2")
    untier = untie.Untier(model, max_steps=8, **SCALES)
    optimizer = torch.optim.AdamW(model.parameters())
    torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    with pytest.raises(ValueError, match=r"lr_scheduler=scheduler"):
        untier.start(optimizer)


def test_trainer_resume_with_the_split_equals_the_uninterrupted_run(make_args, tmp_path):
    def run(resume=None):
        args = make_args(output_dir=str(tmp_path / "full"), save_strategy="steps", save_steps=4, warmup_steps=3)
        model = tiny_model("gpt2")
        callback = untie.UntieCallback(untie_at=6, untie_when=None, **SCALES)
        _train(model, args, callback, resume=resume)
        return model

    reference = {n: p.detach().clone() for n, p in run().named_parameters()}
    for ckpt in ("checkpoint-4", "checkpoint-8"):  # tied (the head group empty), untied
        assert_resumed_equals(run(resume=str(tmp_path / "full" / ckpt)), reference, ckpt, tolerance=0.0)


def test_a_checkpoint_saved_without_the_split_resumed_with_it_is_refused_with_the_fix(make_args, tmp_path):
    args = make_args(output_dir=str(tmp_path / "run"), save_strategy="steps", save_steps=4, max_steps=4)
    _train(tiny_model("gpt2"), args, untie.UntieCallback(untie_at=2, untie_when=None))
    more = make_args(output_dir=str(tmp_path / "run"), max_steps=8)
    with pytest.raises(ValueError, match=r"embedding_lr_scale at 1.*resume with embedding_lr_scale=1.0"):
        _train(tiny_model("gpt2"), more, untie.UntieCallback(untie_at=2, untie_when=None, embedding_lr_scale=0.1),
               resume=str(tmp_path / "run" / "checkpoint-4"))  # fmt: skip


@pytest.mark.parametrize("resumed_with", ["scales at 1", "nothing set"])
def test_a_checkpoint_saved_with_the_split_resumes_at_the_scales_given_else_the_checkpoints(
    make_args, tmp_path, resumed_with
):
    """Scales set back to 1 at the resume: the checkpoint's groups are kept, at 1x from the resume step. Scales not
    given at the resume: the checkpoint's continue (a resume continues its checkpoint's plan)."""
    args = make_args(output_dir=str(tmp_path / "run"), save_strategy="steps", save_steps=4, max_steps=4)
    _train(tiny_model("gpt2"), args, untie.UntieCallback(untie_at=2, untie_when=None, **SCALES))
    more = make_args(output_dir=str(tmp_path / "run"), max_steps=8)
    model = tiny_model("gpt2")
    at_one = {"embedding_lr_scale": 1.0, "head_lr_scale": 1.0} if resumed_with == "scales at 1" else {}
    trainer, rows = _train(model, more, untie.UntieCallback(untie_at=2, untie_when=None, **at_one),
                           resume=str(tmp_path / "run" / "checkpoint-4"))  # fmt: skip
    assert len(rows) == 4
    for row in rows:
        scales = (1.0, 1.0) if at_one else (SCALES["embedding_lr_scale"], SCALES["head_lr_scale"])
        assert row["input_embedding"][0] == pytest.approx(scales[0] * row[None][0])
        assert row["head"][0] == pytest.approx(scales[1] * row[None][0])
    _every_parameter_once(trainer.optimizer, model)


@pytest.mark.distributed
def test_accelerate_ddp_rates_and_save_state_resume_are_exact(tmp_path):
    """2 ranks on gloo: a warm-up + cosine LambdaLR built before start, untie at 4, resumed from steps 3 and 6."""
    torchrun("role_rates_run.py", tmp_path)
    runs = {
        name: [torch.load(tmp_path / f"{name}-rank{r}.pt") for r in (0, 1)] for name in ("run", "resume-3", "resume-6")
    }
    reference = runs["run"][0]
    assert reference["world_size"] == 2 and reference["untie_step"] == 4
    for step, (source, embedding, head) in reference["rates"].items():
        assert embedding == (0.25 if step > 4 else 1.0) * source and (step <= 4 or head == 2.0 * source), step
    for name, ranks in runs.items():
        for rank in ranks:
            for key, value in reference["params"].items():
                assert torch.equal(rank["params"][key], value), (name, key)
            assert all(rank["rates"][step] == reference["rates"][step] for step in rank["rates"]), name


def test_deepspeed_is_refused_at_attach_not_run_silently_at_1():
    run = untie.core.run.UntieRun(untie.UntieConfig(embedding_lr_scale=0.1))
    with pytest.raises(ValueError, match=r"DeepSpeed's engine owns the param groups.*leave them at 1.0"):
        run.attach(tiny_model("gpt2"), engine="DEEPSPEED")
    from untie.decision.decide import _engine_refusal  # the decision's own rule: scales at 1 pass, other engines too

    assert _engine_refusal(untie.UntieConfig(), "DEEPSPEED", "UntieCallback") is None
    assert _engine_refusal(untie.UntieConfig(embedding_lr_scale=0.1), "FSDP2", "UntieCallback") is None


@pytest.mark.parametrize("value", [-0.1, float("nan"), float("inf"), "0.1", True, None])
@pytest.mark.parametrize("name", ["embedding_lr_scale", "head_lr_scale"])
def test_a_bad_scale_is_one_line_naming_the_field(name, value):
    with pytest.raises(ValueError, match=rf"^{name}=.* must be a finite number >= 0") as error:
        untie.UntieConfig(**{name: value})
    assert "\n" not in str(error.value)


def test_the_command_line_and_json_take_the_scales(tmp_path):
    config, _ = untie.parse_command_line(
        (untie.UntieConfig, tf.TrainingArguments),
        ["--embedding_lr_scale", "0.1", "--head_lr_scale", "0", "--lr_scales_while_tied", "true", "--output_dir", "x"],
    )
    assert (config.embedding_lr_scale, config.head_lr_scale, config.lr_scales_while_tied) == (0.1, 0.0, True)
    assert untie.UntieConfig.from_json(config.to_json()) == config
    script = "import untie; untie.parse_command_line((untie.UntieConfig,), ['--head_lr_scale', 'fast'])"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 2 and "head_lr_scale" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_a_frozen_embedding_with_a_scale_is_refused_naming_it():
    model = tiny_model("gpt2")
    untie.untie_embeddings(model)
    model.get_input_embeddings().weight.requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    with pytest.raises(ValueError, match="input embedding is not in the optimizer"):
        untie.Untier(model, optimizer, max_steps=8, embedding_lr_scale=0.5)


def test_accelerate_single_process_save_and_load_state_exact(tmp_path):
    """Untier + accelerate save_state / load_state on one process: the resumed run equals the uninterrupted one."""

    def run(resume: str | None = None, save: str | None = None):
        torch.manual_seed(0)
        accelerator = Accelerator(cpu=True)
        model = tiny_model("llama")
        untier = untie.Untier(model, max_steps=8, accelerator=accelerator, untie_at=3, untie_when=None, **SCALES)
        optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.1)
        scheduler = tf.get_cosine_schedule_with_warmup(optimizer, 2, 8)
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
        untier.start(optimizer, lr_scheduler=scheduler)
        first = 1
        if resume:
            accelerator.load_state(resume)
            first = untier.global_step + 1
        data = ToyLMDataset(n=8)
        for step in range(first, 9):
            model(input_ids=data.ids, labels=data.ids).loss.backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            untier.step()
            if save and step == 5:
                accelerator.save_state(save)
        untier.close()
        return {n: p.detach().clone() for n, p in accelerator.unwrap_model(model).named_parameters()}

    reference = run(save=str(tmp_path / "state-5"))
    resumed = run(resume=str(tmp_path / "state-5"))
    assert max((resumed[n] - reference[n]).abs().max().item() for n in reference) == 0.0


def test_an_untier_state_saved_without_the_groups_resumed_with_them_is_refused_before_anything_loads():
    model = tiny_model("gpt2")
    untier = untie.Untier(model, torch.optim.AdamW(model.parameters()), untie_at=2, untie_when=None)
    saved = untier.state_dict()
    resumed_model = tiny_model("gpt2")
    resumed = untie.Untier(resumed_model, untie_at=2, untie_when=None, embedding_lr_scale=0.1)
    resumed.start(torch.optim.AdamW(resumed_model.parameters()))
    with pytest.raises(ValueError, match=r"saved with embedding_lr_scale at 1.*resume with embedding_lr_scale=1.0"):
        resumed.load_state_dict(saved)


def test_a_tensor_learning_rate_is_not_shared_between_the_groups():
    """A tensor `lr` (capturable / fused optimizers) is cloned into each role's group: writing the embedding's rate
    must not write the model's (an independent reviewer's case: the whole model's rate collapsed by 0.05 a step)."""
    model = tiny_model("llama")
    data = ToyLMDataset(n=8)
    untier = untie.Untier(model, max_steps=6, untie_at=2, untie_when=None, embedding_lr_scale=0.1, head_lr_scale=0.5)
    optimizer = torch.optim.Adam(model.parameters(), lr=torch.tensor(1e-3))
    untier.start(optimizer)
    rates = _StepRates(optimizer)
    _loop(model, optimizer, untier, data, 5)
    for step, row in enumerate(rates.rows, 1):
        assert float(row[None][0]) == pytest.approx(1e-3, rel=1e-6), step
        embedding, head = (1.0, 1.0) if step <= 2 else (0.1, 0.5)
        assert float(row["input_embedding"][0]) == pytest.approx(embedding * 1e-3, rel=1e-6), step
        assert step <= 2 or float(row["head"][0]) == pytest.approx(head * 1e-3, rel=1e-6), step


def test_a_sequential_scheduler_built_before_the_split_is_extended_once():
    """SequentialLR shares its first child's `_last_lr` list: extended once, it follows (a reviewer's case)."""
    model = tiny_model("llama")
    data = ToyLMDataset(n=8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=3)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=5)
    scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, cosine], milestones=[3])
    untier = untie.Untier(model, optimizer, lr_scheduler=scheduler, max_steps=8, untie_at=0, untie_when=None,
                          embedding_lr_scale=0.1)  # fmt: skip
    rates = _StepRates(optimizer)
    _loop(model, optimizer, untier, data, 8, scheduler)
    assert len({row[None][0] for row in rates.rows}) > 4  # warm-up then cosine
    assert all(row["input_embedding"][0] == 0.1 * row[None][0] for row in rates.rows)


def test_an_optimizer_that_computes_its_own_rate_is_refused_with_the_fix():
    """Adafactor(relative_step=True) has lr=None: nothing to scale; refused in one line, not a TypeError."""
    model = tiny_model("llama")
    optimizer = tf.optimization.Adafactor(model.parameters(), lr=None, relative_step=True, warmup_init=False)
    with pytest.raises(ValueError, match=r"computes its own step size .*relative_step=False"):
        untie.Untier(model, optimizer, max_steps=4, embedding_lr_scale=0.1)
