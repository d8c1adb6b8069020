"""The study's runs: each arm of a (cell, seed), the tied run first (it saves the checkpoints the branches start
from and measures the trigger without acting), then the arms untied from step 0, then the branches.

Every finished run is a `StudyRecord` JSON under ``<output_dir>/records`` (and copied to `records_dir`, the
committed folder), skipped by a rerun, so the study spreads over sittings. Every run saves a resume checkpoint every
`resume_every` steps and an interrupted run continues from it; a branch loads the tied run's checkpoint at its step
(weights, optimizer state, scheduler and what the tied run had measured), unties with `untie.untie_embeddings`
(the optimizer state the arm names) and continues: `tests/test_study.py` checks it against a live untie."""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from untie import UntieConfig, untie_embeddings
from untie.registry import Registry
from untie.structure.role_rates import RoleRates
from untie_recipes.tasks.decision_map.corpus import BLOCK, TokenizedCorpus
from untie_recipes.tasks.decision_map.training import (
    TrainingSetup,
    embedding_digest,
    evaluate,
    load_checkpoint,
    train_steps,
)
from untie_recipes.tasks.study.model import build_model, parameter_counts
from untie_recipes.tasks.study.protocol import CELLS, arm_spec, budget_steps, cooldown_start, half_budget, untie_step
from untie_recipes.tasks.study.provenance import repeat_refusal
from untie_recipes.tasks.study.training import (
    CurveRecorder,
    OutOfTime,
    Progress,
    RunSpec,
    StudyRecord,
    build_optimizer,
    curve_steps,
    curve_subset,
    out_of_time,
    study_order,
)
from untie_recipes.tasks.study.trigger import TriggerWatch

logger = logging.getLogger(__name__)


@dataclass
class StudyContext:
    """What every run of one job shares."""

    corpus: TokenizedCorpus
    output_dir: Path
    machine: dict
    corpus_digest: str
    batch_size: int = 8
    warmup: int = 100
    curve_points: int = 20
    curve_blocks: int = 512
    resume_every: int = 250
    records_dir: Path | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    stop_at: float | None = None
    """A `training.CLOCK()` value after which a run saves its resume checkpoint and stops (`OutOfTime`)."""
    trigger_config: UntieConfig | None = field(default_factory=UntieConfig)
    """The trigger the tied run measures (the default, `UntieConfig()`); None measures nothing."""
    subfolder: str = ""
    """Where under the records, the committed records and the checkpoints this context's runs live: "" for the study's
    own, ``kinds/<kind>`` for a CPU kind's own fine-tuning (`--finetune_here`), whose tied runs repeat names."""

    def __post_init__(self) -> None:
        self.curve_validation = curve_subset(self.corpus.validation, self.curve_blocks)

    @property
    def vocab(self) -> int:
        return len(self.corpus.tokenizer)

    def setup(self, cell: str, seed: int, lr: float) -> TrainingSetup:
        shape = CELLS[cell]
        heads = max(1, shape.width // 32)
        return TrainingSetup(width=shape.width, layers=shape.layers, heads=heads, seed=seed,
                             batch_size=self.batch_size, learning_rate=lr, warmup=self.warmup)  # fmt: skip

    @property
    def records_folder(self) -> Path:
        """This context's records under the output folder."""
        return self.output_dir / "records" / self.subfolder

    @property
    def committed_folder(self) -> Path | None:
        """Where this context's finished records are copied (None: nowhere)."""
        return self.records_dir / self.subfolder if self.records_dir is not None else None

    def commit(self, path: Path, under: str = "") -> None:
        """Copy the finished record `path` to the committed folder (``under`` it), whole or not at all: a copy cut
        short (a call's time out) is a ``.partial`` file, never a record."""
        if self.committed_folder is None:
            return
        folder = self.committed_folder / under
        folder.mkdir(parents=True, exist_ok=True)
        partial = folder / f"{path.name}.partial"
        shutil.copyfile(path, partial)
        partial.replace(folder / path.name)

    def record_path(self, spec: RunSpec) -> Path:
        return self.records_folder / f"{spec.name}.json"

    def checkpoint_path(self, spec: RunSpec, kind: str) -> Path:
        return self.output_dir / "checkpoints" / self.subfolder / spec.name / f"{kind}.pt"

    def tied_of(self, spec: RunSpec) -> RunSpec:
        return RunSpec(spec.cell, "tied", spec.setup, spec.budget, spec.kind)


def _start(ctx: StudyContext, spec: RunSpec, tied: StudyRecord | None):
    """The run's model, optimizer and scheduler at its starting step, and what was measured up to it: step 0, or
    the tied run's checkpoint at the branch step, untied there."""
    arm = spec.spec
    eos = ctx.corpus.tokenizer.eos_token_id or 0
    head = arm.head if arm.fraction is None else None
    model = build_model(spec.setup.width, spec.setup.layers, spec.setup.seed, ctx.vocab, BLOCK, head, eos)
    model.to(ctx.device)
    optimizer, scheduler = build_optimizer(model, spec.setup, spec.budget)
    if arm.embedding_scale != 1.0:  # round two: the input embedding at k x the rate, through the library's groups
        rates = RoleRates({"input_embedding": arm.embedding_scale, "head": 1.0}, False, "study")
        rates.split(optimizer, model, Registry("study: per-role rates"), scheduler)
    step = spec.branch_step
    if step is None:
        return model, optimizer, scheduler, 0, {}
    path = ctx.checkpoint_path(ctx.tied_of(spec), f"step{step}")
    _, measured = load_checkpoint(path, model, optimizer, scheduler)
    expected = tied.checkpoint_digests.get(str(step)) if tied else None
    if expected is None or embedding_digest(model) != expected:
        raise RuntimeError(f"{path} is not the checkpoint the tied run {ctx.tied_of(spec).name} saved at step {step}.")
    untie_embeddings(model, optimizer, optimizer_state=arm.optimizer_state)
    measured.pop("watch", None)
    return model, optimizer, scheduler, step, measured


def _checkpoints(ctx: StudyContext, spec: RunSpec) -> dict[int, list[Path]]:
    """Step -> the checkpoints saved there: every `resume_every` steps the resume one; for the study's tied run, the
    branch points of its cell's arms and the final step (kept: the fine-tuning starts from it)."""
    points: dict[int, list[Path]] = {}
    for step in range(ctx.resume_every, spec.budget, ctx.resume_every):
        points.setdefault(step, []).append(ctx.checkpoint_path(spec, "resume"))
    if spec.arm == "tied" and spec.kind == "arm":
        for step in branch_steps(spec.cell, spec.budget):
            points.setdefault(step, []).append(ctx.checkpoint_path(spec, f"step{step}"))
        points.setdefault(spec.budget, []).append(ctx.checkpoint_path(spec, "final"))
    return points


def arm_branch_steps(cell: str, budget: int) -> dict[str, int]:
    """Arm -> the tied run's step it branches from, for the cell's branches."""
    fractions = {arm: arm_spec(arm).fraction for arm in CELLS[cell].arms + CELLS[cell].round_two}
    return {arm: untie_step(fraction, budget) for arm, fraction in fractions.items() if fraction}


def branch_steps(cell: str, budget: int) -> list[int]:
    """The tied run's steps that the cell's branches start from."""
    return sorted(set(arm_branch_steps(cell, budget).values()))


def cell_plan(cell: str, vocab: int, batch_size: int) -> dict:
    """A cell's sizes: parameters, embedding share, budget (steps, tokens, tokens per embedding row), the sweep's
    values and steps, the branch steps, and the optimizer steps of one seed's arms."""
    shape = CELLS[cell]
    params, embedding = parameter_counts(shape.width, shape.layers, vocab, BLOCK)
    budget = budget_steps(shape.tokens_per_parameter, params, batch_size, BLOCK)
    branches = arm_branch_steps(cell, budget)
    return {
        "cell": cell, "shape": f"{shape.width}x{shape.layers}", "params": params, "embedding_share": embedding / params,
        "tokens_per_parameter": shape.tokens_per_parameter, "budget_steps": budget, "batch": f"{batch_size} x {BLOCK}",
        "tokens": budget * batch_size * BLOCK, "tokens_per_embedding_row": budget * batch_size * BLOCK / vocab,
        "cooldown_start": cooldown_start(budget), "sweep_lrs": list(shape.sweep_values()),
        "sweep_budget_steps": half_budget(budget), "sweep_steps": 2 * len(shape.sweep_values()) * half_budget(budget),
        "arms": list(shape.arms), "branch_steps": branches,
        "steps_per_seed": sum(budget - branches.get(arm, 0) for arm in shape.arms),
    }  # fmt: skip


def train_run(ctx: StudyContext, spec: RunSpec, progress: Progress, tied: StudyRecord | None = None) -> StudyRecord:
    """Train one run to its budget (from its resume checkpoint if there is one) and return its record."""
    model, optimizer, scheduler, start, measured = _start(ctx, spec, tied)
    resume = ctx.checkpoint_path(spec, "resume")
    steps = curve_steps(spec.budget, ctx.curve_points)
    recorder = CurveRecorder(model, optimizer, scheduler, ctx.curve_validation, steps, _checkpoints(ctx, spec),
                             progress, resume, ctx.stop_at)  # fmt: skip
    if spec.arm == "tied" and spec.kind == "arm" and ctx.trigger_config is not None:
        recorder.watch = TriggerWatch(model, optimizer, ctx.corpus.tokenizer, spec.budget, config=ctx.trigger_config)
        recorder.hooks.append(lambda step: recorder.watch.arm(step + 1))
    recorder.resume_from(measured, seconds=False)
    first = start
    if resume.exists():
        start, measured = load_checkpoint(resume, model, optimizer, scheduler)
        recorder.resume_from(measured)
        if recorder.watch is not None:
            recorder.watch.arm(start + 1)
    progress(start - first, float("nan"))
    order = study_order(len(ctx.corpus.train), spec.setup.seed, spec.budget * spec.setup.batch_size)
    train_steps(model, optimizer, scheduler, spec.setup, ctx.corpus.train, order, start, spec.budget, recorder)
    final = evaluate(model, ctx.corpus.validation)
    if recorder.watch is not None:
        recorder.watch.remove()
    return _record(ctx, spec, recorder, final, first)


def _record(ctx: StudyContext, spec: RunSpec, recorder: CurveRecorder, final: float, first: int) -> StudyRecord:
    arm, steps = spec.spec, sorted(int(s) for s in recorder.losses)
    params, embedding = parameter_counts(spec.setup.width, spec.setup.layers, ctx.vocab, BLOCK)
    tokens = spec.budget * spec.setup.batch_size * BLOCK
    branch_points = {str(s) for s in branch_steps(spec.cell, spec.budget)} if spec.arm == "tied" else set()
    return StudyRecord(
        name=spec.name, cell=spec.cell, arm=spec.arm, kind=spec.kind, seed=spec.setup.seed,
        lr=spec.setup.learning_rate, budget_steps=spec.budget, untie_step=spec.branch_step,
        head=arm.head, optimizer_state=arm.optimizer_state, curve_steps=steps,
        curve_validation=[recorder.losses[str(s)] for s in steps], curve_train=[recorder.train[str(s)] for s in steps],
        final_validation_loss=final, train_loss_tail=recorder.tail, steps_run=spec.budget - first, tokens=tokens,
        wall_seconds=round(recorder.seconds, 1), cpu_seconds=round(recorder.cpu_seconds, 1), setup=asdict(spec.setup),
        params=params, embedding_params=embedding,
        tokens_per_embedding_row=tokens / ctx.vocab, machine=dict(ctx.machine), corpus_digest=ctx.corpus_digest,
        trigger=recorder.watch.summary() if recorder.watch is not None else None,
        checkpoint_digests={s: d for s, d in recorder.digests.items() if s in branch_points},
        epochs=spec.budget * spec.setup.batch_size / len(ctx.corpus.train),
    )  # fmt: skip


def finished(ctx: StudyContext, spec: RunSpec) -> StudyRecord | None:
    """The run's record if it was made with this spec's setup and budget, on this corpus; None otherwise."""
    path = ctx.record_path(spec)
    if not path.exists():
        return None
    record = StudyRecord.load(path)
    if record.setup == asdict(spec.setup) and record.budget_steps == spec.budget:
        if record.corpus_digest == ctx.corpus_digest:
            return record
    logger.warning("study: %s was made with other settings or another corpus; running it again.", path)
    return None


def run_or_reuse(ctx: StudyContext, spec: RunSpec, progress: Progress, tied: StudyRecord | None = None) -> StudyRecord:
    """The run's record: reused if finished, else trained, saved (and copied to `records_dir`), its resume
    checkpoint deleted."""
    record = finished(ctx, spec)
    if record is not None:
        progress(spec.budget - (spec.branch_step or 0), float("nan"))
        return record
    if out_of_time(ctx.stop_at):
        raise OutOfTime(0)
    started = time.perf_counter()
    record = train_run(ctx, spec, progress, tied)
    logger.info("study: %s done in %.0f s (final validation loss %.4f)", spec.name, time.perf_counter() - started,
                record.final_validation_loss)  # fmt: skip
    path = ctx.record_path(spec)
    record.save(path)
    ctx.commit(path)
    ctx.checkpoint_path(spec, "resume").unlink(missing_ok=True)
    return record


def seed_specs(
    ctx: StudyContext, cell: str, seed: int, lrs: dict[str, float], budget: int, extra: tuple[str, ...] = ()
) -> list[RunSpec]:
    """The runs of (cell, seed) whose swept rate `lrs` holds (`Arm.plain`: "tied" for the tied run and its branches,
    "untied" for the arms untied from step 0), the tied run first, each at that rate; `extra`: arms beyond the cell's
    (round two's `untied-emb<k>`, once its sweep has chosen k)."""
    arms = list(CELLS[cell].arms) + list(extra)
    return [RunSpec(cell, arm, ctx.setup(cell, seed, lrs[arm_spec(arm).plain]), budget)
            for arm in arms if arm_spec(arm).plain in lrs]  # fmt: skip


def retrain_tied(ctx: StudyContext, spec: RunSpec, progress: Progress) -> None:
    """Train a recorded tied run again for its final checkpoint (the fine-tuning's start, lost with a machine),
    leaving its record as it is; its resume and branch checkpoints are deleted after it, and its CPU time logged."""
    started = time.process_time()
    train_run(ctx, spec, progress)
    ctx.checkpoint_path(spec, "resume").unlink(missing_ok=True)
    for path in ctx.checkpoint_path(spec, "step").parent.glob("step*.pt"):
        path.unlink()
    logger.info("study: %s trained again for its final checkpoint in %.0f CPU s", spec.name,
                time.process_time() - started)  # fmt: skip


def _tied_again(ctx: StudyContext, spec: RunSpec, kept: StudyRecord, progress: Progress) -> StudyRecord:
    """The tied run trained again for branch checkpoints it no longer has (lost with a machine, or a branch added
    later: round two's `untie@0.9`); its committed record stays as it is, and the run must repeat its final loss
    exactly (one thread, the same CPU kind), or the branches would start from another run."""
    refusal = repeat_refusal(kept.machine, ctx.machine, spec.name)
    if refusal is not None:
        raise RuntimeError(f"study: {spec.name}'s branch checkpoints are gone, and {refusal}")
    logger.warning("study: %s's branch checkpoints are gone; training it again for them (its record is kept).",
                   spec.name)  # fmt: skip
    again = train_run(ctx, spec, progress)
    ctx.checkpoint_path(spec, "resume").unlink(missing_ok=True)
    if again.final_validation_loss != kept.final_validation_loss:
        raise RuntimeError(
            f"study: {spec.name} trained again ended at {again.final_validation_loss!r}, its record at "
            f"{kept.final_validation_loss!r}: another CPU kind or torch build; run its branches where it was recorded."
        )
    return again


def run_seed(
    ctx: StudyContext,
    cell: str,
    seed: int,
    lrs: dict[str, float],
    budget: int,
    progress: Progress,
    extra: tuple[str, ...] = (),
):
    """Every arm of (cell, seed) whose swept rate `lrs` holds: tied, the arms untied from step 0, the branches;
    returns their records. Given only the untied rate, only the arms untied from step 0 run (another process runs
    the tied run and its branches). The tied run is run again when a branch still to run has lost its checkpoint;
    the branch checkpoints are deleted once every branch is recorded (the final one is kept)."""
    specs = seed_specs(ctx, cell, seed, lrs, budget, extra)
    if "tied" not in lrs:
        return {spec.arm: run_or_reuse(ctx, spec, progress) for spec in specs}
    tied_spec = next(s for s in specs if s.arm == "tied")
    lost = [s for s in specs if s.branch_step is not None and finished(ctx, s) is None
            and not ctx.checkpoint_path(tied_spec, f"step{s.branch_step}").exists()]  # fmt: skip
    recorded = finished(ctx, tied_spec) is not None
    records = {"tied": run_or_reuse(ctx, tied_spec, progress)}
    branches_from = records["tied"]
    if lost and recorded:
        branches_from = _tied_again(ctx, tied_spec, records["tied"], progress)
    for spec in specs:
        if spec.arm != "tied":
            records[spec.arm] = run_or_reuse(ctx, spec, progress, branches_from)
    for path in ctx.checkpoint_path(tied_spec, "step").parent.glob("step*.pt"):
        path.unlink()
    return records
