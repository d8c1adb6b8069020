"""The runs of one (width, seed) of the map: auto (live default `untie.Untier`: where it unties tells which deadline
branches are needed), tied (saving the checkpoints the branches start from), untied, then the branches.

Each finished run is a `RunRecord` JSON under ``<output_dir>/records``; a rerun of the map skips those, so the map
can be spread over sittings. The tied and untied runs also save a resume checkpoint every `RESUME_EVERY` steps; an
interrupted auto run or branch restarts (from its start or its branch point)."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from untie import UntieConfig, Untier, untie_embeddings
from untie_recipes.tasks.decision_map.corpus import BLOCK, TokenizedCorpus
from untie_recipes.tasks.decision_map.training import (
    Recorder,
    RunRecord,
    TrainingSetup,
    build_model,
    build_optimizer,
    data_order,
    embedding_digest,
    fixed_untie_step,
    load_checkpoint,
    train_steps,
)

#: The arms a map can run (`--arms`): the tied run always runs (the branches start from its checkpoints).
MAP_ARMS = ("tied", "untied", "auto", "fixed")
#: Fractions of a budget at which the fixed arms untie (the issue's 10, 25, 50 and 75%).
FIXED_FRACTIONS = (0.1, 0.25, 0.5, 0.75)
#: The default deadline of `UntieCallback()` / `Untier()`: 30% of the run.
AUTO_DEADLINE = 0.3
RESUME_EVERY = 100

logger = logging.getLogger(__name__)

Progress = Callable[[int, float], None]


@dataclass
class MapContext:
    corpus: TokenizedCorpus
    budgets: tuple[int, ...]
    output_dir: Path
    untie: UntieConfig = field(default_factory=UntieConfig)
    """The auto arm's settings (`UntieConfig()`, the default, unless the command line changed some: ``--policy off``
    runs the tied-phase schedule); the branches untie with its optimizer state. The tied and untied runs do not
    untie and are shared by every value."""
    arms: tuple[str, ...] = MAP_ARMS
    """The arms to run (`MAP_ARMS`): dropping "fixed" skips the fixed branches, dropping "auto" the auto run and its
    deadline branches, dropping "untied" the untied run. The tied run always runs."""

    @property
    def optimizer_state(self) -> str:
        return self.untie.optimizer_state

    @property
    def label(self) -> str:
        """What tells this map's untying arms from the schedule's (`UntieConfig(policy="off")`, the default when the
        map's first records were made): "" for it, "+fresh" for another optimizer state, "+cfg<digest>" for other
        settings (the first 8 hex digits of the SHA-256 of the JSON of the settings that differ from it). The policy
        counts as the one the settings choose (`UntieConfig.chosen_policy`): `UntieConfig()` and
        ``--policy fresh-untied`` make the same runs and share their records."""
        label = "" if self.optimizer_state == "copy" else f"+{self.optimizer_state}"
        default = json.loads(json.dumps(UntieConfig(policy="off").values()))  # every setting, set or not
        settings = {**json.loads(json.dumps(self.untie.values())), "policy": self.untie.chosen_policy()[0]}
        changed = {k: v for k, v in settings.items() if k != "optimizer_state" and v != default[k]}
        if changed:  # only the settings that differ from the defaults: a setting added later keeps the labels
            digest = hashlib.sha256(json.dumps(changed, sort_keys=True).encode()).hexdigest()[:8]
            label += f"+cfg{digest}"
        return label

    def arm(self, base: str) -> str:
        """The record name of an arm that unties ("auto", "untie@N"), with this map's `label`."""
        return base + self.label

    def load_records(self, setup: TrainingSetup) -> dict[str, RunRecord]:
        """The finished records of one (width, seed) for this optimizer state, keyed by their arms' plain names."""
        records = {}
        for path in sorted((self.output_dir / "records").glob(f"{setup.name}-*.json")):
            name = path.stem[len(setup.name) + 1 :]
            base = name.split("+")[0]
            if name in ("tied", "untied") or (base not in ("tied", "untied") and name == self.arm(base)):
                records[base] = RunRecord.load(path)
        return records

    @property
    def max_budget(self) -> int:
        return max(self.budgets)

    def record_path(self, setup: TrainingSetup, arm: str) -> Path:
        return self.output_dir / "records" / f"{setup.name}-{arm}.json"

    def checkpoint_path(self, setup: TrainingSetup, kind: str, step: int | None = None) -> Path:
        name = f"{kind}-resume.pt" if step is None else f"{kind}-step{step}.pt"
        return self.output_dir / "checkpoints" / setup.name / name


def fixed_branch_stops(budgets: tuple[int, ...]) -> dict[int, int]:
    """Untie step -> the last budget any fixed arm that unties there is evaluated at (a branch runs that far)."""
    stops: dict[int, int] = {}
    for budget in budgets:
        for fraction in FIXED_FRACTIONS:
            step = fixed_untie_step(fraction, budget)
            stops[step] = max(stops.get(step, 0), budget)
    return stops


def deadline_steps(budgets: tuple[int, ...]) -> dict[int, int]:
    """Budget -> the default deadline's step for a run of that budget."""
    return {budget: fixed_untie_step(AUTO_DEADLINE, budget) for budget in budgets}


def steps_of_unit(ctx: MapContext) -> int:
    """Optimizer steps of one (width, seed) at most (for the progress line's total)."""
    branches = sum(stop - step for step, stop in branches_of(ctx, None).items())
    runs = 1 + ("untied" in ctx.arms) + ("auto" in ctx.arms)
    return runs * ctx.max_budget + branches


def _plain_run(ctx: MapContext, setup: TrainingSetup, arm: str, progress: Progress) -> RunRecord:
    """The tied or untied arm from step 0 to the largest budget, saving the tied branch points, and a resume
    checkpoint every `RESUME_EVERY` steps that an interrupted run continues from."""
    corpus = ctx.corpus
    model = build_model(setup, len(corpus.tokenizer), BLOCK, tied=arm == "tied")
    optimizer, scheduler = build_optimizer(model, setup)
    resume = ctx.checkpoint_path(setup, arm)
    points = set(branches_of(ctx, None)) if arm == "tied" else set()  # every branch the map's arms may start
    checkpoints = {step: [ctx.checkpoint_path(setup, arm, step)] for step in points}
    for step in range(RESUME_EVERY, ctx.max_budget, RESUME_EVERY):
        checkpoints.setdefault(step, []).append(resume)
    recorder = Recorder(model, optimizer, scheduler, corpus.validation, ctx.budgets, checkpoints, progress)
    start = 0
    if resume.exists():
        start, saved = load_checkpoint(resume, model, optimizer, scheduler)
        recorder.resume_from(saved)
        progress(start, float("nan"))
    order = data_order(len(corpus.train), setup.seed)
    train_steps(model, optimizer, scheduler, setup, corpus.train, order, start, ctx.max_budget, recorder)
    digests = {step: d for step, d in recorder.digests.items() if int(step) in points}
    return RunRecord(arm, setup.width, setup.seed, None, None, recorder.losses, recorder.tail, asdict(setup), digests)


def auto_run(ctx: MapContext, setup: TrainingSetup, progress: Progress) -> RunRecord:
    """`Untier` with the map's settings (by default `UntieConfig()`: the trigger with the tokenizer's pairs, the
    deadline at 30%) over the largest budget."""
    corpus = ctx.corpus
    model = build_model(setup, len(corpus.tokenizer), BLOCK, tied=True)
    untier = Untier(model, config=ctx.untie, max_steps=ctx.max_budget, tokenizer=corpus.tokenizer)
    optimizer, scheduler = build_optimizer(model, setup)
    untier.start(optimizer)
    recorder = Recorder(model, optimizer, scheduler, corpus.validation, ctx.budgets, {}, progress)
    recorder.hooks.append(lambda step: untier.step())
    order = data_order(len(corpus.train), setup.seed)
    train_steps(model, optimizer, scheduler, setup, corpus.train, order, 0, ctx.max_budget, recorder)
    untier.close()
    return RunRecord(ctx.arm("auto"), setup.width, setup.seed, untier.untie_step, untier.untie_reason, recorder.losses,
                     recorder.tail, asdict(setup))  # fmt: skip


def branch_run(
    ctx: MapContext, setup: TrainingSetup, untie_step: int, stop: int, progress: Progress, tied: RunRecord
) -> RunRecord:
    """The tied run's checkpoint at `untie_step`, untied there (with `ctx.optimizer_state`), trained to `stop`; the
    checkpoint must be the one the tied run (`tied`, its record) saved."""
    corpus = ctx.corpus
    model = build_model(setup, len(corpus.tokenizer), BLOCK, tied=True)
    optimizer, scheduler = build_optimizer(model, setup)
    path = ctx.checkpoint_path(setup, "tied", untie_step)
    load_checkpoint(path, model, optimizer, scheduler)
    expected = tied.checkpoint_digests.get(str(untie_step))
    if expected is None and tied.setup is not None:
        raise RuntimeError(f"The tied run's record for {setup.name} has no checkpoint at step {untie_step}.")
    if expected is not None and embedding_digest(model) != expected:
        raise RuntimeError(
            f"{path} is not the checkpoint the tied run of {setup.name} saved at step {untie_step} (its embedding "
            f"differs): a leftover of another run. Delete {path.parent} and {ctx.record_path(setup, 'tied')}, then "
            "run the map again (the tied run is redone with its checkpoints)."
        )
    untie_embeddings(model, optimizer, optimizer_state=ctx.optimizer_state)
    budgets = [b for b in ctx.budgets if untie_step < b <= stop]
    recorder = Recorder(model, optimizer, scheduler, corpus.validation, budgets, {}, progress)
    order = data_order(len(corpus.train), setup.seed)
    train_steps(model, optimizer, scheduler, setup, corpus.train, order, untie_step, stop, recorder)
    return RunRecord(ctx.arm(f"untie@{untie_step}"), setup.width, setup.seed, untie_step, "fixed", recorder.losses,
                     recorder.tail, asdict(setup))  # fmt: skip


def branches_of(ctx: MapContext, auto_step: int | None) -> dict[int, int]:
    """Untie step -> stop of every branch the cells read: the fixed arms, and the deadline of each budget whose auto
    arm has not untied by it (all deadlines while the auto run is not done: `auto_step` None)."""
    branches = dict(fixed_branch_stops(ctx.budgets)) if "fixed" in ctx.arms else {}
    if "auto" not in ctx.arms:
        return branches
    for budget, deadline in deadline_steps(ctx.budgets).items():
        if auto_step is None or auto_step > deadline:  # this budget's auto arm unties at its deadline
            branches[deadline] = max(branches.get(deadline, 0), budget)
    return branches


def run_unit(ctx: MapContext, setup: TrainingSetup, progress: Progress) -> dict[str, RunRecord]:
    """Every run of one (width, seed) that has no usable record yet; returns all its records.

    A record made with other settings is run again. The tied run is run again when a branch still to run has lost
    its checkpoint (they are deleted once every branch of the unit is recorded)."""

    def reusable(base: str) -> RunRecord | None:
        path = ctx.record_path(setup, base if base in ("tied", "untied") else ctx.arm(base))
        if not path.exists():
            return None
        record = RunRecord.load(path)
        if record.setup in (None, asdict(setup)):  # None: a record from before records kept their setup
            return record
        logger.warning("decision map: %s was made with other settings (%s); running it again.", path, record.setup)
        return None

    def run(base: str, make: Callable[[], RunRecord]) -> RunRecord:
        started = time.perf_counter()
        record = make()
        record.seconds = round(time.perf_counter() - started, 1)
        record.save(ctx.record_path(setup, base if base in ("tied", "untied") else ctx.arm(base)))
        return record

    auto = reusable("auto")
    if auto is None and "auto" in ctx.arms:  # first: where it unties tells which deadline branches the cells need
        auto = run("auto", lambda: auto_run(ctx, setup, progress))
    done = {step: reusable(f"untie@{step}") for step in branches_of(ctx, auto and auto.untie_step)}
    lost = [
        step
        for step, record in done.items()
        if record is None and not ctx.checkpoint_path(setup, "tied", step).exists()
    ]
    records = {"tied": reusable("tied")}
    if records["tied"] is None or lost:
        records["tied"] = run("tied", lambda: _plain_run(ctx, setup, "tied", progress))
    if "untied" in ctx.arms:
        records["untied"] = reusable("untied") or run("untied", lambda: _plain_run(ctx, setup, "untied", progress))
    if auto is not None:
        records["auto"] = auto
    for step, stop in sorted(branches_of(ctx, records["auto"].untie_step if "auto" in records else None).items()):
        arm = f"untie@{step}"
        make = lambda step=step, stop=stop: branch_run(ctx, setup, step, stop, progress, records["tied"])  # noqa: E731
        records[arm] = done.get(step) or reusable(arm) or run(arm, make)
    for path in ctx.checkpoint_path(setup, "tied", 0).parent.glob("*.p*"):
        path.unlink()  # every branch is recorded: the checkpoints are not needed any more
    return records
