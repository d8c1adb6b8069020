"""The map's cells from its run records: per (width, budget), each arm's mean and sd over seeds, the winner, the
oracle fixed step, and the auto arm's regret against it in sd units; written as JSON, Markdown and a heatmap."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from untie import UntieConfig
from untie_recipes.tasks.decision_map.runs import AUTO_DEADLINE, FIXED_FRACTIONS, MAP_ARMS, deadline_steps
from untie_recipes.tasks.decision_map.training import RunRecord, fixed_untie_step

ARMS = ("tied", "untied", *(f"fixed-{round(f * 100)}" for f in FIXED_FRACTIONS), "auto")


def arm_losses(
    records: dict[str, RunRecord], budget: int, budgets: tuple[int, ...], arms: tuple[str, ...] = MAP_ARMS
) -> dict[str, tuple[float, str]]:
    """One (width, seed)'s loss per arm at `budget`, with the arm's untie step (and reason) as text, for the map's
    `arms` (`--arms`; "fixed" stands for the four fixed arms). A missing run raises KeyError."""
    key = str(budget)
    out = {plain: (records[plain].losses[key], "-") for plain in ("tied", "untied") if plain in arms}
    if "fixed" in arms:
        for fraction in FIXED_FRACTIONS:
            step = fixed_untie_step(fraction, budget)
            out[f"fixed-{round(fraction * 100)}"] = (records[f"untie@{step}"].losses[key], str(step))
    if "auto" in arms:
        auto = records["auto"]
        deadline = deadline_steps(budgets)[budget]
        if auto.untie_step is not None and auto.untie_step <= deadline:
            out["auto"] = (auto.losses[key], f"{auto.untie_step} ({auto.reason})")
        else:
            out["auto"] = (records[f"untie@{deadline}"].losses[key], f"{deadline} (deadline)")
    return out


def unit_complete(records: dict[str, RunRecord], budgets: tuple[int, ...], arms: tuple[str, ...] = MAP_ARMS) -> bool:
    """Whether a (width, seed) has every run its cells read (an interrupted map leaves some missing)."""
    try:
        for budget in budgets:
            arm_losses(records, budget, budgets, arms)
    except KeyError:
        return False
    return True


def _spread(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else math.nan)


def cells(
    units: dict[tuple[int, int], dict[str, RunRecord]], budgets: tuple[int, ...], map_arms: tuple[str, ...] = MAP_ARMS
) -> list[dict]:
    """One dict per (width, budget) over the seeds present for that width, for the map's arms (`map_arms`: without
    "fixed" there is no oracle, without "auto" no regret: None)."""
    out = []
    for width in sorted({w for w, _ in units}):
        seeds = sorted(s for w, s in units if w == width)
        for budget in budgets:
            per_seed = {seed: arm_losses(units[(width, seed)], budget, budgets, map_arms) for seed in seeds}
            names = [a for a in ARMS if a in per_seed[seeds[0]]]
            arms = {}
            for arm in names:
                mean, sd = _spread([per_seed[s][arm][0] for s in seeds])
                arms[arm] = {"mean": mean, "sd": sd, "untie": [per_seed[s][arm][1] for s in seeds],
                             "per_seed": [per_seed[s][arm][0] for s in seeds]}  # fmt: skip
            fixed = [a for a in names if a.startswith("fixed-")]
            plain = [a for a in ("tied", "untied") if a in arms]
            candidates = [a for a in [*fixed, "auto"] if a in arms]
            oracle = min(fixed, key=lambda a: arms[a]["mean"]) if fixed else None
            cell: dict = {"width": width, "budget": budget, "seeds": seeds, "arms": arms,
                          "winner": min(names, key=lambda a: arms[a]["mean"]), "oracle": oracle,
                          "oracle_step": fixed_untie_step(float(oracle[6:]) / 100, budget) if oracle else None,
                          "auto_regret": None, "auto_regret_sd": None, "auto_regret_paired": None}  # fmt: skip
            if oracle and "auto" in arms:
                regret = arms["auto"]["mean"] - arms[oracle]["mean"]
                sd = max(arms["auto"]["sd"], arms[oracle]["sd"])
                cell["auto_regret"], cell["auto_regret_sd"] = regret, (regret / sd if sd > 0 else math.nan)
                cell["auto_regret_paired"] = _spread(
                    [a - o for a, o in zip(arms["auto"]["per_seed"], arms[oracle]["per_seed"], strict=True)]
                )
            best_plain = min(arms[a]["mean"] for a in plain)
            best_tie_then_untie = min((arms[a]["mean"] for a in candidates), default=math.inf)
            cell["tie_then_untie_beats_both"] = best_tie_then_untie < best_plain
            cell["margin_over_best_plain"] = best_plain - best_tie_then_untie if candidates else None
            cell["paired"] = paired_differences(arms, candidates) if candidates else None
            cell["validation"] = validation(arms, oracle) if oracle and "auto" in arms and len(plain) == 2 else None
            out.append(cell)
    return out


def paired_differences(arms: dict[str, dict], candidates: list[str]) -> dict:
    """The best tie-then-untie arm (by mean) against tied and against untied, seed by seed.

    Every arm of a seed starts from the same initialisation and reads the same data order, so the seed moves all
    arms together: the per-seed difference shows an effect that the arms' own sd (mostly the seed's) hides."""
    best = min(candidates, key=lambda a: arms[a]["mean"])
    out: dict = {"arm": best}
    for plain in ("tied", "untied"):
        if plain not in arms:
            continue
        # > 0: the tie-then-untie arm is better (lower loss) than the plain arm in that seed
        gains = [p - b for p, b in zip(arms[plain]["per_seed"], arms[best]["per_seed"], strict=True)]
        mean, sd = _spread(gains)
        out[plain] = {"mean": mean, "sd": sd, "wins": sum(g > 0 for g in gains), "seeds": len(gains)}
    return out


#: The validation's tolerance (issue 48): the auto arm may trail the best baseline by one paired sd or this, whichever
#: is larger (nats per token).
REGRET_TOLERANCE = 0.01


def validation(arms: dict[str, dict], oracle: str) -> dict:
    """The auto arm against the best baseline of the cell (tied, untied or the oracle fixed arm, by mean), paired by
    seed: its regret, the tolerance (one paired sd or `REGRET_TOLERANCE`), whether it passes, and in how many seeds
    it beats the better of tied and untied (seed by seed)."""
    best = min(("tied", "untied", oracle), key=lambda a: arms[a]["mean"])
    regrets = [a - b for a, b in zip(arms["auto"]["per_seed"], arms[best]["per_seed"], strict=True)]
    mean, sd = _spread(regrets)
    tolerance = max(sd if sd == sd else 0.0, REGRET_TOLERANCE)
    plain = [min(t, u) for t, u in zip(arms["tied"]["per_seed"], arms["untied"]["per_seed"], strict=True)]
    beats = sum(a < p for a, p in zip(arms["auto"]["per_seed"], plain, strict=True))
    return {"best": best, "regret": mean, "sd": sd, "tolerance": tolerance, "passes": mean <= tolerance,
            "beats_better_plain": beats, "seeds": len(regrets)}  # fmt: skip


def validation_table(table: list[dict]) -> str:
    """Per cell: the auto arm's paired regret against the best of tied, untied and the oracle fixed arm, the
    tolerance, the verdict, and the seeds in which it beats the better of tied and untied."""
    lines = [
        "| width | budget | auto untied at | best baseline | auto's regret (paired) | tolerance | within it "
        "| beats the better of tied and untied |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for cell in table:
        check = cell["validation"]
        if check is None:
            continue
        untie = ", ".join(cell["arms"]["auto"]["untie"])
        lines.append(
            f"| d{cell['width']} | {cell['budget']:,} | {untie} | {check['best']} | {check['regret']:+.4f} ± "
            f"{check['sd']:.4f} | {check['tolerance']:.4f} | {'yes' if check['passes'] else 'no'} | "
            f"{check['beats_better_plain']}/{check['seeds']} seeds |"
        )
    return "\n".join(lines)


def paired_table(table: list[dict]) -> str:
    """The best tie-then-untie arm of each cell against tied and untied, paired by seed."""
    lines = [
        "| width | budget | best tie-then-untie arm | gain over tied (paired) | gain over untied (paired) "
        "| auto's regret (paired) |",
        "|---|---|---|---|---|---|",
    ]
    for cell in table:
        paired = cell["paired"] or {"arm": "-"}
        gains = [
            f"{paired[p]['mean']:+.4f} ± {paired[p]['sd']:.4f} (better in {paired[p]['wins']}/{paired[p]['seeds']})"
            if p in paired
            else "-"
            for p in ("tied", "untied")
        ]
        regret = "-"
        if cell["auto_regret_paired"] is not None:
            regret = "{:+.4f} ± {:.4f}".format(*cell["auto_regret_paired"])
        lines.append(f"| d{cell['width']} | {cell['budget']:,} | {paired['arm']} | {gains[0]} | {gains[1]} "
                     f"| {regret} |")  # fmt: skip
    return "\n".join(lines)


def markdown(table: list[dict], tokens_per_step: int) -> str:
    names = [a for a in ARMS if all(a in cell["arms"] for cell in table)]
    lines = [
        "| width | budget (steps / tokens) | " + " | ".join(names) + " | winner | oracle step | auto's regret |",
        "|---|---|" + "---|" * (len(names) + 3),
    ]
    for cell in table:
        arms = cell["arms"]
        values = [f"{arms[a]['mean']:.4f} ± {arms[a]['sd']:.4f}" for a in names]
        oracle = f"{cell['oracle_step']} ({cell['oracle']})" if cell["oracle"] else "-"
        regret = "-"
        if cell["auto_regret"] is not None:
            regret = f"{cell['auto_regret']:+.4f} ({cell['auto_regret_sd']:+.1f} sd)"
        lines.append(
            f"| d{cell['width']} | {cell['budget']:,} / {cell['budget'] * tokens_per_step / 1e6:.2f}M | "
            + " | ".join(values)
            + f" | {cell['winner']} | {oracle} | {regret} |"
        )
    return "\n".join(lines)


def auto_steps(table: list[dict]) -> str:
    """Where the auto arm untied, per cell and seed."""
    lines = ["| width | budget | auto untie step per seed (reason) |", "|---|---|---|"]
    for cell in table:
        if "auto" not in cell["arms"]:
            continue
        steps = ", ".join(f"{s}: {u}" for s, u in zip(cell["seeds"], cell["arms"]["auto"]["untie"], strict=True))
        lines.append(f"| d{cell['width']} | {cell['budget']:,} | {steps} |")
    return "\n".join(lines)


def heatmap(table: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    widths = sorted({c["width"] for c in table})
    budgets = sorted({c["budget"] for c in table})
    grid = {(c["width"], c["budget"]): c for c in table}
    fig, axes = plt.subplots(1, 2, figsize=(11, 1.4 + 1.1 * len(widths)))
    panels = (
        ("margin_over_best_plain", "best tie-then-untie arm vs best of tied / untied\n(nats; > 0: tie-then-untie wins)",
         "RdBu"),
        ("auto_regret_sd", "auto's regret against the oracle fixed step\n(sd units; 0 = oracle)", "Reds"),
    )  # fmt: skip
    for ax, (key, title, cmap) in zip(axes, panels, strict=True):
        values = [[_finite(grid[(w, b)][key]) for b in budgets] for w in widths]
        if key == "margin_over_best_plain":
            scale = max(1e-9, max(abs(v) for row in values for v in row))
            image = ax.imshow(values, cmap=cmap, vmin=-scale, vmax=scale, aspect="auto")
        else:
            top = max(1e-9, max(v for row in values for v in row))  # auto beat the oracle everywhere: all below 0
            image = ax.imshow(values, cmap=cmap, vmin=0, vmax=top, aspect="auto")
        for i, w in enumerate(widths):
            for j, b in enumerate(budgets):
                cell = grid[(w, b)]
                if cell[key] is None:
                    ax.text(j, i, "not run", ha="center", va="center", fontsize=8)
                    continue
                text = f"{cell[key]:+.3f}\n{cell['winner']}" if key.startswith("margin") else (
                    f"{cell[key]:+.1f} sd\noracle {cell['oracle_step']}")  # fmt: skip
                shade = float(image.norm(cell[key]))  # where the cell's colour sits on the map: dark at the ends
                dark = abs(shade - 0.5) > 0.3 if key.startswith("margin") else shade > 0.6
                ax.text(j, i, text, ha="center", va="center", fontsize=8, color="white" if dark else "black")
        ax.set_xticks(range(len(budgets)), [f"{b:,} steps" for b in budgets])
        ax.set_yticks(range(len(widths)), [f"d = {w}" for w in widths])
        ax.set_title(title, fontsize=9)
        fig.colorbar(image, ax=ax, shrink=0.8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _finite(value: float | None) -> float:
    """A cell's value for the heatmap's colours: an arm that was not run (None) is drawn as 0."""
    return 0.0 if value is None or value != value else value


def auto_arm_name(untie: dict) -> str:
    """The auto arm's `Untier` in words: "the default `Untier()`", or the settings that differ from the defaults
    (`untie`: the map's `UntieConfig.to_json_dict()`)."""
    default = UntieConfig().to_json_dict()
    changed = ", ".join(f"{key}={value!r}" for key, value in untie.items() if key in default and value != default[key])
    return f"`Untier({changed})`" if changed else "the default `Untier()`"


def write_report(output_dir: Path, units: dict[tuple[int, int], dict[str, RunRecord]], budgets: tuple[int, ...],
                 tokens_per_step: int, settings: dict, suffix: str = "",
                 arms: tuple[str, ...] = MAP_ARMS) -> list[dict]:  # fmt: skip
    """results{suffix}.json / .md and figures/decision-map{suffix}.png; `suffix` names a non-default optimizer state
    at the untie (``-fresh``)."""
    table = cells(units, budgets, arms)
    (output_dir / f"results{suffix}.json").write_text(json.dumps({"settings": settings, "cells": table}, indent=2))
    state = settings.get("optimizer_state", "copy")
    auto = auto_arm_name(settings.get("untie", {}))
    text = (
        f"# Decision map (optimizer state at the untie: {state})\n\nValidation loss (nats per token), mean ± sd over "
        "seeds; arms: tied, untied, untie at "
        f"{', '.join(f'{round(f * 100)}%' for f in FIXED_FRACTIONS)} of the budget (fixed-N), and auto ({auto}: "
        f"by default the evidence trigger with the tokenizer's pairs, deadline at {round(AUTO_DEADLINE * 100)}%; "
        "where each seed untied: the second table). "
        "The oracle is the best fixed arm; auto's regret is its mean minus the oracle's, in nats and in units of "
        "the larger of the two arms' sd.\n\n" + markdown(table, tokens_per_step) + "\n\n" + auto_steps(table) + "\n\n"
        "Paired by seed (the arms of a seed share the initialisation and the data order): the loss of tied, or "
        "untied, minus that of the cell's best tie-then-untie arm, mean ± sd over seeds (> 0: tie-then-untie is "
        "better), and in how many seeds it is better; the auto arm's loss minus the oracle fixed arm's.\n\n"
        + paired_table(table)
        + "\n\nThe validation of the auto arm (issue 48): its loss minus that of the cell's best baseline (tied, "
        "untied or the oracle fixed arm, by mean), paired by seed; it passes where that is at most one paired sd or "
        f"{REGRET_TOLERANCE} nat, whichever is larger.\n\n" + validation_table(table) + "\n"
    )
    (output_dir / f"results{suffix}.md").write_text(text)
    heatmap(table, output_dir / "figures" / f"decision-map{suffix}.png")
    return table
