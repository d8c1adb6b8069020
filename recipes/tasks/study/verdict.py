"""The rule of docs/recipes/study.md ("The rule"), written before any development arm ran, applied to the cells'
tables: what the default does for a fresh model, whether a copy at step 0 is an acceptable fallback, and (from the
fine-tuning table) what it does for a loaded tied model."""

from __future__ import annotations

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
    "default": "unchanged (the trigger, or the deadline at 30%)",
    "untie@1/2": "untie at half the run",
}


def loaded_verdict(table: dict) -> str:
    """The loaded-model half of the rule: the arm with the lowest mean target loss among those whose source loss is not
    significantly worse than staying tied (its paired interval against stay-tied does not lie above 0); "pending"
    until the table has `SEEDS_NEEDED` complete seeds."""
    seeds = (table or {}).get("seeds", [])
    if len(seeds) < SEEDS_NEEDED:
        return f"pending: the fine-tuning table has {len(seeds)} of {SEEDS_NEEDED} complete seeds"
    arms = table["arms"]
    allowed = [a for a in arms if a == "stay-tied" or not above_zero(arms[a]["source"]["vs_stay_tied"])]
    best = min(allowed, key=lambda a: (arms[a]["target"]["mean"], a != "stay-tied"))
    refused = sorted(set(arms) - set(allowed))
    why = f"the lowest mean target loss ({arms[best]['target']['mean']:.4f})"
    why += f" among the arms that forget no more than staying tied (left out: {', '.join(refused)})" if refused else ""
    return f"{LOADED_DEFAULTS[best]} ({best}: {why})"


def verdict(cells: dict[str, dict], finetune: dict | None = None) -> dict:
    """The fresh-model default and the copy fallback from the tables of cells A and B ("pending" until both have
    `SEEDS_NEEDED` complete seeds), and the loaded-model default from the fine-tuning table."""
    loaded = loaded_verdict(finetune or {})
    missing = [c for c in RULE_CELLS if len((cells.get(c) or {}).get("seeds", [])) < SEEDS_NEEDED]
    if missing:
        return {"fresh_model": "pending", "why": f"cells {missing} lack {SEEDS_NEEDED} complete seeds",
                "copy_at_step_0": "pending", "loaded_model": loaded}  # fmt: skip
    qualifying = []
    for arm in CELLS["A"].arms:
        if not ARMS[arm].tied_phase:
            continue
        if all(arm in cells[c]["arms"] and below_zero(cells[c]["arms"][arm]["vs_untied"]) for c in RULE_CELLS):
            qualifying.append(arm)
    if qualifying:
        arm = min(qualifying, key=lambda a: (tied_phase_fraction(a), cells["A"]["arms"][a]["vs_untied"]["mean"]))
        fraction = tied_phase_fraction(arm)
        fresh = "stay tied" if fraction == 1.0 else f"a tied phase to {fraction:.3g} of the run ({arm})"
        why = f"{arm}'s interval against untied lies below 0 in cells {', '.join(RULE_CELLS)}"
    else:
        fresh = "untied from step 0, head drawn (unchanged)"
        why = "no tied-phase arm's interval against untied lies below 0 in both cells"
    copy = cells["A"]["arms"].get("copy0", {}).get("vs_untied", {})
    if above_zero(copy):
        fallback = "costly: a misread of 'fresh' must not fall back to a copy silently; draw only on positive evidence"
    else:
        fallback = "acceptable fallback (its interval against the drawn head does not lie above 0 in cell A)"
    return {"fresh_model": fresh, "why": why, "copy_at_step_0": fallback, "loaded_model": loaded}
