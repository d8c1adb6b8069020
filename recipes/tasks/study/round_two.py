"""Round two's tables and rule (docs/recipes/study.md, "Round two", issue 77), from the records.

Per cell, four arms paired by seed against U (`untied`, drawn head): U_k (`untied-emb<k>`, the k cell B's scale sweep
chose), T* (the branch at a fixed fraction with the lowest mean) and `tied`. The cell's choice is the lowest mean, but
U_k (it changes the user's optimizer) only where it beats the best of the other three by `OPTIMIZER_BAR`. The default
for a model built fresh is then a function of the embedding's share: each cell's choice holds to the midpoint between
its share and its neighbour's, and the nearest cell's beyond the outermost.

Records of different CPU kinds pair here (the amendment of 2026-11-29: cell B's round one ran on an AMD EPYC, its
scale arm on an Intel Xeon); the table names the kinds, and the float noise between them is measured where one
configuration ran on both (`cross_kind_noise`). Only records of one corpus build pair.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Sequence

from untie_recipes.tasks.study.finetune import ALL_FINETUNE_ARMS
from untie_recipes.tasks.study.protocol import CELLS, DEVELOPMENT_SEEDS, SCALED_ARM, arm_spec, scaled_arm
from untie_recipes.tasks.study.stats import t_interval
from untie_recipes.tasks.study.sweep import scale_choice
from untie_recipes.tasks.study.training import StudyRecord

#: The cells round two's rule reads: A (84%) and B (57%) from round one, C (about 25%) where users train.
ROUND_TWO_CELLS = ("A", "B", "C")
#: The cells whose choice includes the embedding-scale arm: B ran its sweep, C takes B's k. Cell A has no such arm.
SCALED_CELLS = ("B", "C")
#: How far below the best of the other arms U_k must end to be chosen (nat): it changes the user's optimizer.
OPTIMIZER_BAR = 0.01
#: A loaded tied model: the fine-tuning arms within this of the lowest mean target loss compete on the source loss.
TARGET_BAR = 0.01
#: Item 5's statement: the trigger "fires early" where it would fire within this fraction of the run.
EARLY_FIRE = 0.10
#: ... and the untie pays late where the cell's best tied-phase fraction (T*) is at least this.
LATE_UNTIE = 1 / 3


def _fixed_arms(cell: str) -> list[str]:
    """The cell's branches (every arm with a tied phase to a fraction of the run), round two's included: T* is the
    best of them, as the rule says "among the cell's branches"."""
    names = CELLS[cell].arms + CELLS[cell].round_two
    return [a for a in names if arm_spec(a).fraction is not None]


def _finite(rows: list[dict], key: str = "mean") -> list[dict]:
    """The rows whose `key` is a finite number: a diverged run's NaN never wins a `min`."""
    return [row for row in rows if isinstance(row.get(key), (int, float)) and math.isfinite(row[key])]


def choice_text(arm: str) -> str:
    """What choosing `arm` means for a user, in words."""
    spec = arm_spec(arm)
    if arm == "untied":
        return "untied from step 0, head drawn"
    if arm.startswith(SCALED_ARM):
        return f"untied from step 0, head drawn, the input embedding at {spec.embedding_scale:g}x the rate"
    if arm == "tied":
        return "stay tied"
    fraction = arm.split("@", 1)[1] if "@" in arm else f"{spec.fraction:.3g}"  # "2/3" as the arm names it
    return f"a tied phase to {fraction} of the run ({arm})"


def cross_kind_noise(records: Sequence[StudyRecord]) -> list[dict]:
    """Where one configuration ran on two CPU kinds: the untied sweep's run and the scale sweep's k = 1 run of the same
    cell, rate and seed (the same training). Their final losses' difference is the kinds' float noise."""
    plain = {(r.cell, r.lr, r.seed): r for r in records if r.kind == "sweep" and r.arm == "untied"}
    found = []
    for other in records:
        if other.kind != "sweep" or other.arm != scaled_arm(1.0):
            continue
        base = plain.get((other.cell, other.lr, other.seed))
        if base is None or base.machine.get("cpu") == other.machine.get("cpu"):
            continue
        found.append({"cell": other.cell, "lr": other.lr, "seed": other.seed, "cpus": [base.machine.get("cpu"),
                      other.machine.get("cpu")], "difference": other.final_validation_loss -
                      base.final_validation_loss})  # fmt: skip
    return found


def _arms_and_seeds(cell: str, records: Sequence[StudyRecord]) -> tuple[dict, list[str], list[int]]:
    """The cell's arm records of U's corpus build, the arms the table reads and the seeds that have all of them."""
    mine = [r for r in records if r.cell == cell and r.kind == "arm" and r.seed in DEVELOPMENT_SEEDS]
    builds = Counter(r.corpus_digest for r in mine if r.arm == "untied")  # the build most of U's seeds ran on
    digest = builds.most_common(1)[0][0] if builds else None
    arms = {(r.arm, r.seed): r for r in mine if r.corpus_digest == digest}
    seeds = sorted({s for a, s in arms if a == "untied"})
    later = CELLS[cell].round_two  # round two's branches of a round-one cell (cell B's untie@0.9): they enter once
    # every development seed has them, so a part of them never turns a complete cell pending (nor the default)
    fixed = [a for a in _fixed_arms(cell) if a not in later or all((a, s) in arms for s in DEVELOPMENT_SEEDS)]
    wanted = ["untied", "tied", *fixed]
    if cell in SCALED_CELLS:
        k = scale_choice(list(records))
        wanted.append(scaled_arm(k) if k is not None else f"{SCALED_ARM}?")
    complete = [s for s in seeds if all((a, s) in arms for a in wanted)]
    return arms, wanted, complete


def round_two_table(cell: str, records: Sequence[StudyRecord]) -> dict:
    """One cell's round-two table: its embedding share, the complete seeds, U_k, T* and tied against U (paired, 95%
    t-intervals), the CPU kinds its records ran on, and its choice ("pending" before `DEVELOPMENT_SEEDS` are
    complete)."""
    arms, wanted, seeds = _arms_and_seeds(cell, records)
    table: dict = {"cell": cell, "seeds": seeds, "choice": None, "arms": {}}
    waiting = {a: sum((a, s) in arms for s in DEVELOPMENT_SEEDS) for a in CELLS[cell].round_two if a not in wanted}
    table["waiting"] = {a: n for a, n in waiting.items() if n}  # a late branch part-run: said, not yet read
    anyone = next((r for (a, _), r in arms.items() if a == "untied"), None)
    if anyone is not None:
        table["embedding_share"] = anyone.embedding_params / anyone.params
    needed = len(DEVELOPMENT_SEEDS)
    if len(seeds) < needed:
        missing = sorted({a for a in wanted for s in DEVELOPMENT_SEEDS if (a, s) not in arms})
        table["why"] = f"pending: {len(seeds)} of {needed} seeds complete (missing runs of {', '.join(missing)})"
        return table
    means = {a: statistics.fmean(arms[(a, s)].final_validation_loss for s in seeds) for a in wanted}
    fixed = [a for a in wanted if arm_spec(a).fraction is not None and math.isfinite(means[a])]
    best_fixed = min(fixed, key=lambda a: means[a]) if fixed else None
    table["diverged"] = sorted(a for a in wanted if not math.isfinite(means[a]))
    scaled = next((a for a in wanted if a.startswith(SCALED_ARM)), None)
    for role, arm in (("U", "untied"), ("U_k", scaled), ("T*", best_fixed), ("tied", "tied")):
        if arm is None:
            continue
        diffs = [arms[(arm, s)].final_validation_loss - arms[("untied", s)].final_validation_loss for s in seeds]
        cpus = sorted({arms[(arm, s)].machine.get("cpu") for s in seeds})
        table["arms"][role] = {"arm": arm, "mean": means[arm], "vs_untied": t_interval(diffs), "cpus": cpus}
    table.update(cell_choice(table["arms"]))
    return table


def cell_choice(rows: dict) -> dict:
    """The rule: the lowest mean among U, T* and tied; U_k instead where its mean is at least `OPTIMIZER_BAR` below
    theirs (otherwise it is an option, with its measured effect)."""
    others = _finite([rows[r] for r in ("U", "T*", "tied") if r in rows])
    if not others:
        return {"choice": None, "why": "no choice: every arm without the scale diverged"}
    best = min(others, key=lambda row: row["mean"])
    scaled = rows.get("U_k")
    if scaled is not None and not _finite([scaled]):
        return {"choice": best["arm"], "why": f"the lowest mean; {scaled['arm']} diverged"}
    if scaled is None:
        return {"choice": best["arm"], "why": "the lowest mean; this cell has no embedding-scale arm"}
    margin = best["mean"] - scaled["mean"]
    if margin >= OPTIMIZER_BAR:
        return {
            "choice": scaled["arm"],
            "margin": margin,
            "why": f"{margin:.4f} nat below the best arm without it ({best['arm']}), at least {OPTIMIZER_BAR}",
        }
    return {"choice": best["arm"], "margin": margin,
            "why": f"the lowest mean without the scale; {scaled['arm']} ends {abs(margin):.4f} nat "
                   f"{'below' if margin > 0 else 'above'} it, short of {OPTIMIZER_BAR} below: an option"}  # fmt: skip


def share_bands(tables: dict[str, dict]) -> dict:
    """The default for a model built fresh by the embedding's share, from the cells' choices: each holds to the midpoint
    with its neighbour, the outermost to 0% and 100%; neighbours with one choice merge. Pending until every cell of
    `ROUND_TWO_CELLS` has a choice (the amendment of 2026-11-29: the library's default moves once, on all of them)."""
    chosen = sorted(((t["embedding_share"], c, t["choice"]) for c, t in tables.items() if t.get("choice")),
                    key=lambda item: item[0])  # fmt: skip
    bands: list[dict] = []
    for index, (share, cell, choice) in enumerate(chosen):
        low = 0.0 if index == 0 else (chosen[index - 1][0] + share) / 2
        if bands and bands[-1]["choice"] == choice:
            bands[-1]["cells"].append(cell)
            continue
        if bands:
            bands[-1]["to"] = low
        bands.append({"from": low, "to": 1.0, "choice": choice, "cells": [cell]})
    missing = [c for c in ROUND_TWO_CELLS if not (tables.get(c) or {}).get("choice")]
    many = len(missing) > 1
    status = "complete"
    if missing:
        status = f"pending: cell{'s' * many} {', '.join(missing)} {'have' if many else 'has'} no choice yet"
    return {"bands": bands, "status": status}


def loaded_choice(table: dict) -> dict:
    """The loaded-model half of round two's rule, on one cell's fine-tuning table: among the arms whose mean target loss
    is within `TARGET_BAR` of the lowest, the one with the lowest mean source loss (the least forgotten); each arm's
    standing beside it. "pending" before `DEVELOPMENT_SEEDS` are complete."""
    seeds, needed = table.get("seeds", []), len(DEVELOPMENT_SEEDS)
    if len(seeds) < needed:
        return {"choice": None, "why": f"pending: {len(seeds)} of {needed} seeds complete", "standing": {}}
    missing = [a for a in ALL_FINETUNE_ARMS if a not in table["arms"]]
    if missing:
        return {"choice": None, "standing": {}, "why": f"pending: {', '.join(missing)} not run on the complete seeds"}
    arms = {a: row for a, row in table["arms"].items() if _finite([row["target"]]) and _finite([row["source"]])}
    if not arms:
        return {"choice": None, "why": "no choice: every arm diverged", "standing": {}}
    lowest = min(row["target"]["mean"] for row in arms.values())
    near = [a for a, row in arms.items() if row["target"]["mean"] <= lowest + TARGET_BAR]
    choice = min(near, key=lambda a: arms[a]["source"]["mean"])
    standing = {arm: "diverged" for arm in table["arms"] if arm not in arms}
    for arm, row in arms.items():
        above = row["target"]["mean"] - lowest
        chosen = (
            "chosen: the least forgotten of these" if len(near) > 1 else f"chosen: the only one within {TARGET_BAR}"
        )
        standing[arm] = (chosen if arm == choice else
                         f"target within {TARGET_BAR}, forgets more" if arm in near else
                         f"target {above:.3f} above the lowest")  # fmt: skip
    return {"choice": choice, "why": f"the lowest mean source loss among the arms within {TARGET_BAR} nat of the "
            "lowest mean target loss", "standing": standing}  # fmt: skip


def trigger_timing(records: Sequence[StudyRecord], tables: dict[str, dict]) -> dict:
    """Item 5: where the default trigger would have fired in each development seed's tied run of each cell (it
    measures without acting), beside the cell's T*. The statement holds once every cell is complete, every tied run
    would fire within `EARLY_FIRE` of its run, and every cell's T* unties at `LATE_UNTIE` of the run or later: the
    trigger then detects a divergence present from the start, and does not time the untie."""
    rows, early, late, complete = [], True, True, True
    for cell in ROUND_TWO_CELLS:
        tied = sorted((r for r in records if r.cell == cell and r.kind == "arm" and r.arm == "tied"
                       and r.seed in DEVELOPMENT_SEEDS), key=lambda r: r.seed)  # fmt: skip
        fired = [((r.trigger or {}).get("first_would_fire_step"), r.budget_steps, r.seed) for r in tied]
        fractions = [step / budget if step else None for step, budget, _ in fired]
        early = early and all(f is not None and f < EARLY_FIRE for f in fractions)
        best = (tables.get(cell) or {}).get("arms", {}).get("T*")
        fraction = arm_spec(best["arm"]).fraction if best else None
        complete = complete and bool((tables.get(cell) or {}).get("choice")) and fraction is not None
        late = late and (fraction is None or fraction >= LATE_UNTIE)
        rows.append({"cell": cell, "fired": [{"seed": seed, "step": step, "budget": budget}
                                             for step, budget, seed in fired],
                     "t_star": best["arm"] if best else None, "t_star_fraction": fraction})  # fmt: skip
    if not complete:
        verdict = "pending: not every cell is complete"
    elif early and late:
        verdict = "holds"
    else:
        verdict = "does not hold"
    return {"cells": rows, "verdict": verdict}


def round_two(records: Sequence[StudyRecord], finetune: dict[str, dict] | None = None) -> dict:
    """Every round-two cell's table, the share bands, the measured float noise between CPU kinds, and the loaded-model
    rule on each fine-tuned cell's table (`finetune`: cell -> `report.finetune_table`)."""
    tables = {c: round_two_table(c, records) for c in ROUND_TWO_CELLS}
    loaded = {cell: {**table, **loaded_choice(table)} for cell, table in (finetune or {}).items()}
    return {"cells": tables, "share_default": share_bands(tables), "cross_kind": cross_kind_noise(records),
            "loaded": loaded, "trigger": trigger_timing(records, tables)}  # fmt: skip


def _difference(row: dict | None) -> str:
    if row is None:
        return "-"
    paired = row["vs_untied"]
    if paired.get("low") is None:
        return f"{row['arm']}: {paired['mean']:+.3f}"
    return f"{row['arm']}: {paired['mean']:+.3f} [{paired['low']:+.3f}, {paired['high']:+.3f}]"


def round_two_markdown(result: dict) -> str:
    """`round-two.md`: the cells' table (each arm minus U, paired, 95% t; the choice and why), the measured noise
    between CPU kinds, and the default by embedding share."""
    lines = ["# The study's round two: where the tie pays as the embedding's share falls", "",
             "Written by `python recipes/study.py --report_only`.", "",
             "| cell | embedding share | seeds | U_k vs U | T* vs U | tied vs U | CPU kinds | the cell's choice |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for cell, table in result["cells"].items():
        share = f"{table['embedding_share']:.1%}" if "embedding_share" in table else "-"
        seeds = ", ".join(map(str, table["seeds"])) or "none"
        rows = table["arms"]
        cpus = "; ".join(f"{role}: {', '.join(row['cpus'])}" for role, row in rows.items())
        choice = f"{choice_text(table['choice'])} ({table['why']})" if table["choice"] else table["why"]
        for arm, count in table.get("waiting", {}).items():
            choice += f"; {arm} enters T* once all {len(DEVELOPMENT_SEEDS)} seeds have it ({count} so far)"
        lines.append(f"| {cell} | {share} | {seeds} | {_difference(rows.get('U_k'))} | {_difference(rows.get('T*'))} "
                     f"| {_difference(rows.get('tied'))} | {cpus or '-'} | {choice} |")  # fmt: skip
    lines += [
        "",
        "The same training on two CPU kinds (the float noise between them):",
        "",
        "| cell | the training | CPU kinds | final loss, the second minus the first |",
        "|---|---|---|---|",
    ]
    for noise in result["cross_kind"]:
        lines.append(f"| {noise['cell']} | untied at LR {noise['lr']:g}, seed {noise['seed']}, half the budget | "
                     f"{noise['cpus'][0]}; {noise['cpus'][1]} | {noise['difference']:+.4f} |")  # fmt: skip
    if not result["cross_kind"]:
        lines.append("| - | none measured | - | - |")
    share = result["share_default"]
    lines += ["", f"The default for a model built fresh, by the embedding's share ({share['status']}):", "",
              "| embedding share | the rule's choice | from cells |", "|---|---|---|"]  # fmt: skip
    for band in share["bands"]:
        lines.append(f"| {band['from']:.1%} to {band['to']:.1%} | {choice_text(band['choice'])} | "
                     f"{', '.join(band['cells'])} |")  # fmt: skip
    lines += ["", *_loaded_lines(result.get("loaded") or {}), "", *library_bands_lines(share)]
    if "trigger" in result:
        lines += ["", *trigger_lines(result["trigger"])]
    return "\n".join(lines) + "\n"


def _fired_text(fired: dict) -> str:
    if not fired["step"]:
        return f"{fired['seed']}: never"
    return f"{fired['seed']}: step {fired['step']:,} of {fired['budget']:,} ({fired['step'] / fired['budget']:.1%})"


def trigger_lines(timing: dict) -> list[str]:
    """Item 5's table: per cell, where the default trigger would have fired in each tied run, the cell's T*, and the
    statement's verdict (a last row)."""
    lines = ["Where the default trigger would have fired (the tied runs measure it without acting), beside T*:", "",
             "| cell | would fire at (seed: step of the run) | T* |", "|---|---|---|"]  # fmt: skip
    for row in timing["cells"]:
        fired = "; ".join(_fired_text(f) for f in row["fired"])
        t_star = f"{row['t_star']} ({row['t_star_fraction']:.3g} of the run)" if row["t_star"] else "pending"
        lines.append(f"| {row['cell']} | {fired or 'none yet'} | {t_star} |")
    lines.append(f"| every cell | fires within {EARLY_FIRE:.0%} of the run, T* at {LATE_UNTIE:.3g} or later | "
                 f"{timing['verdict']} |")  # fmt: skip
    return lines


def band_schedule(arm: str) -> tuple[str, float]:
    """What the library does for a band whose choice is `arm`: its `untie_at` ("0": untied from step 0, a fraction:
    a tied phase to it, "none": stays tied) and the input embedding's rate scale."""
    spec = arm_spec(arm)
    if arm == "tied":
        return "none", 1.0
    if spec.fraction is not None:
        return f"{spec.fraction:.6f}", 1.0
    return "0", spec.embedding_scale


def library_bands_lines(share: dict) -> list[str]:
    """The bands as the library reads them (`untie.decision.share_bands.BANDS_TABLE`, written there by
    `scripts/docs_tables.py --write library-share-bands`): each band's edges, the arm, its schedule and the rule's
    status (the library's default follows them only once it reads "complete")."""
    lines = ["The default by share as the library reads it (untie/decision/share_bands.py):", "",
             "| from | to | choice | untie_at | input embedding's rate | cells | status |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for band in share["bands"]:
        untie_at, scale = band_schedule(band["choice"])
        lines.append(f"| {band['from']:.6f} | {band['to']:.6f} | {band['choice']} | {untie_at} | {scale:g}x | "
                     f"{', '.join(band['cells'])} | {share['status']} |")  # fmt: skip
    return lines


def _loaded_lines(loaded: dict) -> list[str]:
    """The loaded-model table: per fine-tuned cell and arm, the target and source losses against staying tied and
    where the arm stands under the rule."""
    lines = ["A loaded tied model: fine-tuning each cell's tied checkpoints on the target (each arm minus stay-tied, "
             "paired, 95% t):", "", "| cell (seeds; CPU kind) | arm | target loss | vs stay-tied | source loss | "
             "vs stay-tied | under the rule |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for cell, table in sorted(loaded.items()):
        seeds = ", ".join(map(str, table["seeds"])) or "none"
        if table.get("cpu"):  # fine-tuning never pairs CPU kinds: the kind whose tied checkpoints these are
            seeds += f"; {table['cpu']}, {table.get('kernel_path')}"
        if not table["arms"]:
            lines.append(f"| {cell} ({seeds}) | - | - | - | - | - | {table['why']} |")
        for arm, row in table["arms"].items():
            target, source = row["target"], row["source"]
            tied = arm == "stay-tied"
            lines.append(f"| {cell} ({seeds}) | {arm} | {target['mean']:.4f} | {_paired(target['vs_stay_tied'], tied)} "
                         f"| {source['mean']:.4f} | {_paired(source['vs_stay_tied'], tied)} | "
                         f"{table['standing'].get(arm, table['why'])} |")  # fmt: skip
    if not loaded:
        lines.append("| - | none fine-tuned | - | - | - | - | - |")
    return lines


def _paired(interval: dict, reference: bool = False) -> str:
    if reference:
        return "reference"
    if interval.get("low") is None:
        return "-" if interval.get("mean") is None else f"{interval['mean']:+.3f}"
    return f"{interval['mean']:+.3f} [{interval['low']:+.3f}, {interval['high']:+.3f}]"
