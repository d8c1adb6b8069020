"""The study's tables from its records: per cell (and per pool group: records of other corpus builds or machines are
never compared), the LR sweep, each arm's LR, mean and sd of the final validation loss over complete seeds, paired
differences against the better of tied and untied and against untied with 95% t-intervals, the tokens each arm needs
to reach untied's final loss, the tokens per embedding row, and where the trigger would have fired beside the best
fixed fraction, per seed; then the rule of docs/recipes/study.md applied to them (`verdict`)."""

from __future__ import annotations

import json
import logging
import statistics
from collections.abc import Sequence
from pathlib import Path

from untie_recipes.tasks.decision_map.corpus import BLOCK
from untie_recipes.tasks.study.finetune import ALL_FINETUNE_ARMS, FINETUNE_ARMS, FineTuneRecord
from untie_recipes.tasks.study.markdown import markdown, summary_markdown
from untie_recipes.tasks.study.protocol import CELLS, arm_spec
from untie_recipes.tasks.study.round_two import round_two, round_two_markdown
from untie_recipes.tasks.study.stats import pool_groups, t_interval, tokens_to_reach
from untie_recipes.tasks.study.sweep import PLAIN, summarize
from untie_recipes.tasks.study.training import StudyRecord
from untie_recipes.tasks.study.verdict import RULE_CELLS, verdict

logger = logging.getLogger(__name__)


def fixed_arms(cell: str) -> tuple[str, ...]:
    """The cell's branches at a fixed fraction with the optimizer state copied: "the best fixed fraction" is among
    these (round two's branches of a round-one cell are not: its tables stay round one's)."""
    return tuple(
        a for a in CELLS[cell].arms if arm_spec(a).fraction is not None and arm_spec(a).optimizer_state == "copy"
    )


def load_records(folder: Path) -> list[StudyRecord]:
    return [StudyRecord.load(path) for path in sorted(folder.glob("*.json"))]


def complete_seeds(cell: str, arms: dict[tuple[str, int], StudyRecord]) -> list[int]:
    """The seeds that have every arm of the cell (only they enter the paired comparisons)."""
    seeds = sorted({seed for _, seed in arms})
    return [s for s in seeds if all((arm, s) in arms for arm in CELLS[cell].arms)]


def _paired(arms, arm: str, reference: str, seeds: list[int]) -> dict:
    """`arm` minus `reference`, seed by seed (< 0: the arm ends lower), with its t-interval."""
    diffs = [arms[(arm, s)].final_validation_loss - arms[(reference, s)].final_validation_loss for s in seeds]
    return {"reference": reference, **t_interval(diffs), "per_seed": diffs}


def _tokens_to_untied(arms, arm: str, seeds: list[int], tokens_per_step: int) -> list[float | None]:
    """Per seed, the tokens `arm` needs to reach that seed's untied final loss on the curve's blocks."""
    out = []
    for seed in seeds:
        target = arms[("untied", seed)].curve_validation[-1]
        record = arms[(arm, seed)]
        out.append(tokens_to_reach(record.curve_steps, record.curve_validation, target, tokens_per_step))
    return out


def _trigger_rows(cell: str, arms, seeds: list[int], budget: int) -> list[dict]:
    """Per seed: where the tied run's trigger would have fired (and the default's untie of a loaded tied model,
    the trigger or the deadline), beside that seed's best fixed fraction."""
    rows = []
    for seed in seeds:
        trigger = arms[("tied", seed)].trigger or {}
        fired = trigger.get("first_would_fire_step")
        fixed = [a for a in fixed_arms(cell) if (a, seed) in arms]
        best = min(fixed, key=lambda a: arms[(a, seed)].final_validation_loss) if fixed else None
        rows.append({
            "seed": seed, "would_fire_step": fired, "would_fire_fraction": fired / budget if fired else None,
            "default_untie_step": trigger.get("default_untie_step"), "deadline_step": trigger.get("deadline_step"),
            "best_fixed": best, "best_fixed_step": arms[(best, seed)].untie_step if best else None,
        })  # fmt: skip
    return rows


def cell_table(cell: str, records: list[StudyRecord]) -> dict:
    """One cell's table from one pool group's records."""
    arms = {(r.arm, r.seed): r for r in records if r.cell == cell and r.kind == "arm"}
    seeds = complete_seeds(cell, arms)
    sweep = {
        a: summarize(cell, a, records)
        for a in PLAIN
        if any(r.kind == "sweep" and r.arm == a and r.cell == cell for r in records)
    }
    table: dict = {"cell": cell, "seeds": seeds, "seeds_recorded": sorted({s for _, s in arms}),
                   "sweep": {a: {"losses": {f"{lr:g}": v for lr, v in sorted(s.losses.items())}, "best": s.best,
                                 "note": s.note()} for a, s in sweep.items()}, "arms": {}}  # fmt: skip
    _costs(table, cell, records)
    any_record = next(iter(arms.values()), None)
    if any_record is None:
        return table
    budget = any_record.budget_steps
    tokens_per_step = any_record.setup["batch_size"] * BLOCK
    table.update(budget_steps=budget, tokens=any_record.tokens, params=any_record.params,
                 embedding_share=any_record.embedding_params / any_record.params,
                 tokens_per_embedding_row=any_record.tokens_per_embedding_row, epochs=any_record.epochs,
                 batch=f"{any_record.setup['batch_size']} x {BLOCK}")  # fmt: skip
    if len(seeds) == 0:
        return table
    means = {a: statistics.fmean(arms[(a, s)].final_validation_loss for s in seeds) for a in CELLS[cell].arms}
    reference = min(("tied", "untied"), key=lambda a: means[a])
    table["reference"] = reference
    for arm in CELLS[cell].arms:
        finals = [arms[(arm, s)].final_validation_loss for s in seeds]
        table["arms"][arm] = {
            "lr": arms[(arm, seeds[0])].lr, "untie_step": arms[(arm, seeds[0])].untie_step, "per_seed": finals,
            "mean": means[arm], "sd": statistics.stdev(finals) if len(finals) > 1 else None,
            "vs_reference": _paired(arms, arm, reference, seeds), "vs_untied": _paired(arms, arm, "untied", seeds),
            "tokens_to_untied_final": _tokens_to_untied(arms, arm, seeds, tokens_per_step),
        }  # fmt: skip
    table["trigger"] = _trigger_rows(cell, arms, seeds, budget)
    return table


def _costs(table: dict, cell: str, records: list[StudyRecord]) -> None:
    """The cell's cost: core-hours (CPU seconds of the runs' processes) and wall hours, over every recorded run of
    round one; round two's runs (issue 77) apart, in `round_two_core_hours`."""
    mine = [r for r in records if r.cell == cell and r.arm in CELLS[cell].arms]
    table["core_hours"] = sum(r.cpu_seconds for r in mine) / 3600
    table["wall_hours"] = sum(r.wall_seconds for r in mine) / 3600
    later = [r for r in records if r.cell == cell and r.arm not in CELLS[cell].arms]
    if later:
        table["round_two_core_hours"] = sum(r.cpu_seconds for r in later) / 3600


def finetune_table(records: Sequence[FineTuneRecord]) -> dict:
    """The fine-tuning table from one pool group's records: per arm, the target and source losses after fine-tuning
    (mean, sd, per seed) and their paired differences against staying tied, over the seeds that have every arm."""
    arms = {(r.arm, r.seed): r for r in records}
    seeds = sorted(s for s in {seed for _, seed in arms} if all((a, s) in arms for a in FINETUNE_ARMS))
    cells = sorted({r.cell for r in records})
    if len(cells) > 1:  # (one corpus build per fine-tuned cell: a pool group holds one)
        raise ValueError(f"fine-tuning records of cells {cells} in one pool group: one corpus serves one cell.")
    table: dict = {"cell": cells[0] if cells else None, "seeds": seeds, "seeds_recorded": sorted({s for _, s in arms}),
                   "arms": {}, "core_hours": sum(r.cpu_seconds for r in records) / 3600}  # fmt: skip
    if not seeds:
        return table
    first = arms[("stay-tied", seeds[0])]
    table.update(steps=first.steps, batch_size=first.batch_size, lr=first.lr,
                 before={s: {"target": arms[("stay-tied", s)].target_before,
                             "source": arms[("stay-tied", s)].source_before} for s in seeds})  # fmt: skip
    later = [a for a in ALL_FINETUNE_ARMS if a not in FINETUNE_ARMS and all((a, s) in arms for s in seeds)]
    for arm in (*FINETUNE_ARMS, *later):  # round two's arms where every complete seed has them
        rows = [arms[(arm, s)] for s in seeds]
        row: dict = {"untie_steps": [r.untie_step for r in rows], "untie_reasons": [r.untie_reason for r in rows]}
        for loss in ("target", "source"):
            values = [getattr(r, f"{loss}_loss") for r in rows]
            tied = [getattr(arms[("stay-tied", s)], f"{loss}_loss") for s in seeds]
            row[loss] = {"per_seed": values, "mean": statistics.fmean(values),
                         "sd": statistics.stdev(values) if len(values) > 1 else None,
                         "vs_stay_tied": t_interval([v - t for v, t in zip(values, tied, strict=True)])}  # fmt: skip
        table["arms"][arm] = row
    return table


def loaded_group(records: Sequence[FineTuneRecord]) -> dict:
    """The fine-tuning table round two's loaded-model rule reads for one cell: fine-tuning never pairs CPU kinds, so
    of the cell's pool groups the one with the most seeds that have all six arms; then the most seeds with round
    one's four; then the most records; then the first by kind. Its kind is named (`cpu`, `kernel_path`). A kind's
    choice only moves forward as its seeds complete: a seed stopped between arms adds nothing until it is whole."""
    groups = pool_groups(records)

    def seeds_with(group: list[FineTuneRecord], arms: tuple[str, ...]) -> int:
        have = {(r.arm, r.seed) for r in group}
        return sum(all((a, s) in have for a in arms) for s in {r.seed for r in group})

    def rank(item: tuple[tuple, list[FineTuneRecord]]) -> tuple:
        key, group = item  # a seed cut short between its arms counts for neither kind of complete seed it lacks
        return (-seeds_with(group, ALL_FINETUNE_ARMS), -seeds_with(group, FINETUNE_ARMS), -len(group), str(key))

    key, group = min(groups.items(), key=rank)
    if len(groups) > 1:
        logger.info(
            "study: cell %s's fine-tuning records form %d pool groups (CPU kinds); round two reads %s, %s.",
            group[0].cell,
            len(groups),
            group[0].machine.get("cpu"),
            group[0].machine.get("kernel_path"),
        )
    return {**finetune_table(group), "cpu": group[0].machine.get("cpu"),
            "kernel_path": group[0].machine.get("kernel_path"), "groups": len(groups)}  # fmt: skip


def write_report(output_dir: Path, records: list[StudyRecord], finetune: Sequence[FineTuneRecord] = (),
                 kinds: Sequence[FineTuneRecord] = ()) -> dict:  # fmt: skip
    """`results.json` and `results.md` under `output_dir`: one table per (pool group, cell), the fine-tuning table of
    the group (the study's own fine-tuning, `finetune`), and the verdict; round two's loaded-model table reads those
    and the CPU kinds' own fine-tuning (`kinds`, `--finetune_here`), which no pretraining group's table takes in."""
    groups = []
    tuned = pool_groups(finetune)
    pooled = pool_groups(records)
    for key in sorted(set(tuned) - set(pooled), key=str):
        logger.warning("study: %d fine-tuning record(s) of %s match no pretraining records: not in the groups' "
                       "tables (round two's loaded-model table reads them).", len(tuned[key]), key)  # fmt: skip
    # The largest group first: the one-screen summary's tables (docs/recipes/when-it-pays.md) are its.
    for key, group in sorted(pooled.items(), key=lambda kv: (-len(kv[1]), str(kv[0]))):
        cells = {c: cell_table(c, group) for c in CELLS if any(r.cell == c for r in group)}
        table = finetune_table(tuned.get(key, []))
        machine = group[0].machine
        groups.append({"corpus_digest": key[0], "cpu": machine.get("cpu"), "kernel_path": machine.get("kernel_path"),
                       "device": machine.get("device"), "torch": machine.get("torch"), "runs": len(group),
                       "cells": cells, "finetune": table, "verdict": verdict(cells, table)})  # fmt: skip
    every = [*finetune, *kinds]
    by_cell = {cell: loaded_group([r for r in every if r.cell == cell]) for cell in sorted({r.cell for r in every})}
    results = {"groups": groups, "round_two": round_two(records, by_cell)}
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (output_dir / "results.md").write_text(markdown(results))
    (output_dir / "summary.md").write_text(summary_markdown([summary(g) for g in groups], groups))
    (output_dir / "round-two.md").write_text(round_two_markdown(results["round_two"]))
    if len(groups) > 1:
        logger.warning(
            "study: the records form %d pool groups (other corpus builds or machines); the summary's first "
            "tables are the largest group's, the others follow under their own headings.",
            len(groups),
        )
    return results


#: The one-screen summary's rows: (choice, the pretraining arm, the fine-tuning arm); None: not an arm there.
SUMMARY_ROWS = (
    ("stay tied", "tied", "stay-tied"),
    ("untie at once, head drawn", "untied", None),
    ("untie at once, head a copy", "copy0", "untie-now"),
    ("a tied phase to 1/3", "untie@1/3", None),
    ("a tied phase to 1/2", None, "untie@1/2"),
    ("a tied phase to 2/3", "untie@2/3", None),
    ("a tied phase to 2/3, the head's optimizer state fresh", "untie@2/3-fresh", None),
    ("a tied phase to 0.8 (the cooldown's start)", "untie@0.8", None),
    ("a tied phase to 0.95", "untie@0.95", None),
    ("the former default on a loaded tied model (the trigger, or the deadline at 30%)", None, "default"),
)


def summary(group: dict) -> dict:
    """One pool group's answer on one screen: per choice, its paired difference in final validation loss against
    untied-from-step-0 (drawn head) in each pretraining cell, and against staying tied in fine-tuning (target and
    source loss), over the complete seeds (those with every arm) of each; the columns name them."""
    columns: dict[str, dict] = {}
    cells = dict(group["cells"])
    if set(cells) & set(RULE_CELLS):  # the cells the rule reads are shown, run or not
        cells = {c: cells.get(c, {}) for c in sorted(set(cells) | set(RULE_CELLS))}
    for cell, table in cells.items():
        columns[cell] = {"seeds": table.get("seeds", []), "differences": {}}
        for arm in CELLS[cell].arms:
            if arm in table.get("arms", {}):
                columns[cell]["differences"][arm] = table["arms"][arm]["vs_untied"]
    finetune = group.get("finetune") or {}
    for loss in ("target", "source"):
        columns[f"finetune-{loss}"] = {"seeds": finetune.get("seeds", []), "differences": {
            arm: row[loss]["vs_stay_tied"] for arm, row in finetune.get("arms", {}).items()}}  # fmt: skip
    return {"columns": columns, "rows": [list(row) for row in SUMMARY_ROWS], "verdict": group["verdict"]}
