"""The rule of docs/recipes/study.md ("The rule"), written before any development arm ran, applied to the cells'
tables: what the default does for a fresh model, whether a copy at step 0 is an acceptable fallback, and (from the
fine-tuning table) what it does for a loaded tied model."""

from __future__ import annotations

import math

from untie_recipes.tasks.study.protocol import ARMS, CELLS, DEVELOPMENT_SEEDS
from untie_recipes.tasks.study.stats import above_zero, below_zero

#: The cells the rule reads, and the seeds each needs complete before it decides.
RULE_CELLS = ("A", "B")
SEEDS_NEEDED = len(DEVELOPMENT_SEEDS)


def tied_phase_fraction(arm: str) -> float:
    """How much of the budget an arm with a tied phase trains tied (1 for tied)."""
    fraction = ARMS[arm].fraction
    return 1.0 if fraction is None else fraction


#: What each fine-tuning arm means as the default for a loaded tied model.
LOADED_DEFAULTS = {
    "stay-tied": "stay tied",
    "untie-now": "untie at once, the head a copy",
    "default": "the former default (tied, then the trigger, or the deadline at 30%)",
    "untie@1/2": "untie at half the run",
}


def loaded_verdict(table: dict) -> str:
    """The loaded-model half of the rule: the arm with the lowest mean target loss among those whose source loss is not
    significantly worse than staying tied (its paired interval against stay-tied does not lie above 0); "pending"
    until the table has `SEEDS_NEEDED` complete seeds."""
    seeds = (table or {}).get("seeds", [])
    if len(seeds) < SEEDS_NEEDED:
        return f"pending: the fine-tuning table has {len(seeds)} of {SEEDS_NEEDED} complete seeds"
    arms = {arm: row for arm, row in table["arms"].items() if arm in LOADED_DEFAULTS}  # round one's arms
    allowed = [a for a in arms if a == "stay-tied" or not above_zero(arms[a]["source"]["vs_stay_tied"])]
    best = min(allowed, key=lambda a: (arms[a]["target"]["mean"], a != "stay-tied"))
    refused = sorted(set(arms) - set(allowed))
    why = f"the lowest mean target loss ({arms[best]['target']['mean']:.4f})"
    why += f" among the arms that forget no more than staying tied (left out: {', '.join(refused)})" if refused else ""
    return f"{LOADED_DEFAULTS[best]} ({best}: {why})"


def _complete(cells: dict[str, dict], cell: str) -> bool:
    return len((cells.get(cell) or {}).get("seeds", [])) >= SEEDS_NEEDED


def _finite(interval: dict) -> bool:
    """Whether a paired difference was measured: a finite mean and interval (not missing, not a diverged run)."""
    values = [interval.get(key) for key in ("mean", "low", "high")]
    return all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)


def _copy_verdict(cells: dict[str, dict]) -> str:
    """Rule 3: reads cell A's copy at step 0 against the drawn head, once cell A is complete."""
    if not _complete(cells, "A"):
        return "pending"
    copy = cells["A"]["arms"].get("copy0", {}).get("vs_untied", {})
    if not _finite(copy):
        return "pending (cell A has no finite difference for the copy at step 0)"
    if above_zero(copy):
        return "costly: a misread of 'fresh' must not fall back to a copy silently; draw only on positive evidence"
    return "acceptable fallback (its interval against the drawn head does not lie above 0 in cell A)"


def _still_possible(cells: dict[str, dict], arm: str) -> bool:
    """Whether rule 1 can still pick `arm`: every complete cell has it with an interval below 0, and every cell still
    in progress has it among its arms (an arm that a cell leaves out can never qualify)."""
    for cell in RULE_CELLS:
        if arm not in CELLS[cell].arms:
            return False
        if not _complete(cells, cell):
            continue
        interval = cells[cell]["arms"].get(arm, {}).get("vs_untied", {})
        if _finite(interval) and not below_zero(interval):
            return False  # (a missing or diverged difference decides nothing early)
    return True


def verdict(cells: dict[str, dict], finetune: dict | None = None) -> dict:
    """The fresh-model default and the copy fallback from the tables of cells A and B, and the loaded-model default
    from the fine-tuning table. Each answer is given as soon as the cells it reads allow: the copy fallback reads cell
    A alone; the fresh-model default is decided early when the complete cells already leave no tied-phase arm that
    rule 1 could pick (an incomplete cell cannot bring one back); otherwise it is "pending" until both cells have
    `SEEDS_NEEDED` complete seeds."""
    loaded = loaded_verdict(finetune or {})
    copy = _copy_verdict(cells)
    missing = [c for c in RULE_CELLS if not _complete(cells, c)]
    candidates = [arm for arm in CELLS["A"].arms if ARMS[arm].tied_phase and _still_possible(cells, arm)]
    if missing and candidates:  # (with both cells complete, a candidate left by a missing difference does not qualify)
        return {"fresh_model": "pending", "why": f"cells {missing} lack {SEEDS_NEEDED} complete seeds",
                "copy_at_step_0": copy, "loaded_model": loaded}  # fmt: skip
    qualifying = [arm for arm in candidates if all(below_zero(cells[c]["arms"][arm]["vs_untied"]) for c in RULE_CELLS)]
    if qualifying:
        arm = min(qualifying, key=lambda a: (tied_phase_fraction(a), cells["A"]["arms"][a]["vs_untied"]["mean"]))
        fraction = tied_phase_fraction(arm)
        fresh = "stay tied" if fraction == 1.0 else f"a tied phase to {fraction:.3g} of the run ({arm})"
        why = f"{arm}'s interval against untied lies below 0 in cells {', '.join(RULE_CELLS)}"
    else:
        fresh = "untied from step 0, head drawn (unchanged)"
        why = "no tied-phase arm's interval against untied lies below 0 in both cells"
        if missing:
            done = [c for c in RULE_CELLS if c not in missing]
            why = (
                f"decided by cell {', '.join(done)}: no tied-phase arm that both cells run has its interval against "
                f"untied below 0 there, so none can in both cells; cell {', '.join(missing)}, still in progress, "
                "cannot change it"
            )
    return {"fresh_model": fresh, "why": why, "copy_at_step_0": copy, "loaded_model": loaded}
