"""The learning-rate sweep: for each cell, tied and untied each at 3 values a factor of 2 apart, on one development
seed at half the budget (its cooldown is its own last 20%); each one's best is the lowest final validation loss. A
best at an edge of the values run extends the sweep by one value beyond that edge (`protocol.next_sweep_value`),
at most `max_extensions` times, and the summary says so."""

from __future__ import annotations

from dataclasses import dataclass

from untie_recipes.tasks.study.protocol import (
    CELLS,
    SCALE_FACTOR,
    SCALE_SWEEP,
    best_value,
    half_budget,
    next_sweep_value,
    scaled_arm,
)
from untie_recipes.tasks.study.runs import StudyContext, run_or_reuse
from untie_recipes.tasks.study.stats import pool_key
from untie_recipes.tasks.study.training import Progress, RunSpec, StudyRecord

PLAIN = ("tied", "untied")


@dataclass
class SweepSummary:
    """One arm's sweep: final loss per value, the best, the values added beyond the first three, and whether the best
    still sits at an edge."""

    arm: str
    losses: dict[float, float]
    best: float
    extended: list[float]
    at_edge: bool
    missing: int = 0
    """Values of the first three not recorded yet (a sweep in progress)."""

    def note(self) -> str:
        if self.missing:
            return f"in progress: {self.missing} of the first {len(self.losses) + self.missing} values to run"
        parts = []
        if self.extended:
            parts.append("extended to " + ", ".join(f"{v:g}" for v in self.extended) + " (best at an edge)")
        if self.at_edge:
            parts.append("the best still sits at an edge")
        return "; ".join(parts) or "best inside the values"


def summarize(cell: str, arm: str, records: list[StudyRecord]) -> SweepSummary:
    """The sweep of `arm` in `cell` from its records (the recipe decides from it, the report shows it)."""
    losses = {r.lr: r.final_validation_loss for r in records if r.cell == cell and r.arm == arm and r.kind == "sweep"}
    first = set(CELLS[cell].sweep_values())
    best = best_value(losses)
    extended = sorted(lr for lr in losses if not any(abs(lr - v) <= 1e-12 * v for v in first))
    missing = sum(not any(abs(lr - v) <= 1e-12 * v for lr in losses) for v in first)
    return SweepSummary(arm, losses, best, extended, next_sweep_value(losses) is not None, missing)


def sweep_spec(ctx: StudyContext, cell: str, arm: str, lr: float, seed: int, budget: int) -> RunSpec:
    return RunSpec(cell, arm, ctx.setup(cell, seed, lr), half_budget(budget), kind="sweep")


def run_sweep(ctx: StudyContext, cell: str, seed: int, budget: int, progress: Progress, max_extensions: int = 1,
              on_extend=None, arms: tuple[str, ...] = PLAIN) -> dict[str, SweepSummary]:  # fmt: skip
    """Run (or reuse) the sweep of each plain arm in `arms` (both by default: a process given one splits the cell with
    another); returns their summaries. `on_extend(steps)`: called before an extension runs, with its steps (the
    progress line's total grows)."""
    out = {}
    for arm in arms:
        records = [run_or_reuse(ctx, sweep_spec(ctx, cell, arm, lr, seed, budget), progress)
                   for lr in CELLS[cell].sweep_values()]  # fmt: skip
        for _ in range(max_extensions):
            value = next_sweep_value({r.lr: r.final_validation_loss for r in records})
            if value is None:
                break
            spec = sweep_spec(ctx, cell, arm, value, seed, budget)
            if on_extend is not None:
                on_extend(spec.budget)
            records.append(run_or_reuse(ctx, spec, progress))
        out[arm] = summarize(cell, arm, records)
    return out


def run_scale_sweep(ctx: StudyContext, cell: str, seed: int, budget: int, lr: float, progress: Progress,
                    max_extensions: int = 1, on_extend=None) -> dict[float, float]:  # fmt: skip
    """Round two's embedding-scale sweep (docs/recipes/study.md, "Round two"): the arm untied from step 0 with the
    input embedding at k x the untied rate `lr`, for k in `SCALE_SWEEP` (k = 1 trains as the untied arm, run again
    under its own name so that every k runs on one machine), on one seed at half the budget; a best at an edge
    extends by `SCALE_FACTOR`, at most `max_extensions` times. Returns the final loss per k."""

    def run(scale: float) -> float:
        spec = sweep_spec(ctx, cell, scaled_arm(scale), lr, seed, budget)
        return run_or_reuse(ctx, spec, progress).final_validation_loss

    losses = {scale: run(scale) for scale in SCALE_SWEEP}
    for _ in range(max_extensions):
        value = next_sweep_value(losses, SCALE_FACTOR)
        if value is None:
            break
        if on_extend is not None:
            on_extend(half_budget(budget))
        losses[value] = run(value)
    return losses


#: The cell whose embedding-scale sweep chooses k for the other round-two cells (docs/recipes/study.md, "Round two").
SCALE_CELL = "B"


def scale_choice(records: list[StudyRecord], max_extensions: int = 1) -> float | None:
    """The k cell B's finished embedding-scale sweep chose (lowest final loss over k = 1, 4, 16 and the extension its
    edge asked for), from its records; None while the sweep is not complete, or where its records come from machines
    whose numbers are not compared (`stats.pool_key`: another CPU kind, kernel path, corpus or torch)."""
    if not any(r.cell == SCALE_CELL and r.arm == "untied" and r.kind == "sweep" for r in records):
        return None
    lr = summarize(SCALE_CELL, "untied", records).best
    found = {r.arm: r for r in records
             if r.cell == SCALE_CELL and r.kind == "sweep" and abs(r.lr - lr) <= 1e-12 * lr}  # fmt: skip
    chosen: list[StudyRecord] = []
    losses: dict[float, float] = {}

    def take(scale: float) -> bool:
        record = found.get(scaled_arm(scale))
        if record is not None:
            chosen.append(record)
            losses[scale] = record.final_validation_loss
        return record is not None

    if not all(take(scale) for scale in SCALE_SWEEP):
        return None
    for _ in range(max_extensions):
        value = next_sweep_value(losses, SCALE_FACTOR)
        if value is None:
            break
        if not take(value):
            return None
    if len({pool_key(r) for r in chosen}) > 1:
        return None
    return best_value(losses)
