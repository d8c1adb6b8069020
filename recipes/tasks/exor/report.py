"""EXor's report: `results.json`, the Markdown table of runs and claims, and the figures (distances and signals)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

import untie
from untie_recipes.tasks.exor.claims import check_claims, group, mean_spread, recovery_comparison
from untie_recipes.tasks.exor.data import EQUIVALENT_PAIRS, vocabulary
from untie_recipes.tasks.exor.setup import ARMS, AUTO_RULE


def markdown_table(records: list[dict], claims: list[dict], recovery: list[dict]) -> str:
    lines = [
        "# EXor results",
        "",
        "Mean ± standard deviation over seeds. `loss`: masked cross-entropy on fresh draws of the training strings at "
        "the end of training; `acc train` / `acc held-out`: masked-bit accuracy on the training strings (what the "
        "paper plotted) and on the 12 held-out strings; distances: Euclidean, between rows of the input (`in`) and "
        "output (`out`) tables at the end of training.",
        "",
        "| variant | model | arm | seeds | untie step | loss | acc train | acc held-out | in 0-1 | in 2-3 | out 0-1 "
        "| out 2-3 | ref 0-2 (in/out) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def cell(values: list[float], digits: int = 3) -> str:
        mean, spread = mean_spread(values)
        return f"{mean:.{digits}f} ± {spread:.{digits}f}"

    keys = sorted({(r["variant"], r["model"], r["arm"]) for r in records}, key=lambda k: (k[0], k[1], ARMS.index(k[2])))
    for variant, model, arm in keys:
        rs = group(records, variant=variant, model=model, arm=arm)
        steps = sorted({r["untie_step"] for r in rs if r["untie_step"] is not None})
        lines.append(
            f"| {variant} | {model} | {arm} | {len(rs)} | {', '.join(map(str, steps)) or '-'} "
            f"| {cell([r['final_loss'] for r in rs], 4)} | {cell([r['train_accuracy'] for r in rs])} "
            f"| {cell([r['heldout_accuracy'] for r in rs])} "
            f"| {cell([r['input_distance']['0-1'] for r in rs])} | {cell([r['input_distance']['2-3'] for r in rs])} "
            f"| {cell([r['output_distance']['0-1'] for r in rs])} | {cell([r['output_distance']['2-3'] for r in rs])} "
            f"| {mean_spread([r['input_distance']['0-2'] for r in rs])[0]:.2f} / "
            f"{mean_spread([r['output_distance']['0-2'] for r in rs])[0]:.2f} |"
        )
    lines += ["", "## The paper's claims", "", "| claim | holds | evidence |", "|---|---|---|"]
    verdict = {True: "yes", False: "**no**", None: "not tested"}
    lines += [f"| {c['claim']} | {verdict[c['holds']]} | {c['evidence']} |" for c in claims]
    if recovery:
        lines += ["", "## Scheduled arm: copied vs reset optimizer state at the untie", ""]
        lines += ["Mean eval loss (training strings) over all evaluations after the untie, and at the end.", ""]
        lines += [
            "| variant | model | after untie (copy) | after untie (reset) | final (copy) | final (reset) | better |"
        ]
        lines += ["|---|---|---|---|---|---|---|"]
        lines += [
            f"| {r['variant']} | {r['model']} | {r['copy_post_untie_loss']:.4f} | {r['reset_post_untie_loss']:.4f} "
            f"| {r['copy_final_loss']:.4f} | {r['reset_final_loss']:.4f} | {r['better']} |"
            for r in recovery
        ]
    return "\n".join(lines) + "\n"


#: Where the claims are explained, with the runs behind the quick preset's verdicts (a page of the repository).
CLAIMS_DOCS = 'docs/recipes/exor.md ("What the quick preset shows", "Where the tied claim fails")'


# -- Figures --

PAIR_STYLE = {
    "0-1": ("tab:red", "(0,1) semantic only in main"),
    "2-3": ("tab:blue", "(2,3)"),
    "0-2": ("grey", "(0,2) ref"),
}


def aligned(records: list[dict], series: str, value) -> tuple[list[int], np.ndarray]:
    """The steps any run recorded in `history[series]`, and a (runs, steps) array of `value(entry)`, NaN where a run
    has no entry at that step: runs that untie log once more (at the untie), and the auto arm unties on some seeds
    and not on others, so per-run histories need not have the same length."""
    steps = sorted({entry["step"] for r in records for entry in r["history"][series]})
    column = {step: i for i, step in enumerate(steps)}
    values = np.full((len(records), len(steps)), np.nan)
    for row, r in enumerate(records):
        for entry in r["history"][series]:
            values[row, column[entry["step"]]] = value(entry)
    return steps, values


def _band(ax, records: list[dict], space: str, pair: str, linestyle: str = "-", label: str | None = None) -> None:
    steps, values = aligned(records, "geometry", lambda g: g[space][pair])
    color, name = PAIR_STYLE[pair]
    ax.plot(steps, np.nanmean(values, 0), color=color, linestyle=linestyle, label=label or name)
    if len(records) > 1:
        ax.fill_between(steps, np.nanmin(values, 0), np.nanmax(values, 0), color=color, alpha=0.15)


def _step_axis(ax) -> None:
    from matplotlib.ticker import FuncFormatter

    ax.set_xlabel("step")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x / 1000:g}k" if abs(x) >= 1000 else f"{x:g}"))


def _save_figure(fig, figures_dir: str, name: str) -> str:
    """Lay out, write as a PNG and close `fig`; return its path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = os.path.join(figures_dir, name)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_figures(records: list[dict], figures_dir: str) -> list[str]:
    """Per variant and model: distances over steps (tied, untied input, untied output, scheduled) and curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(figures_dir, exist_ok=True)
    written = []
    for variant in sorted({r["variant"] for r in records}):
        for model in sorted({r["model"] for r in records}):
            by_arm = {arm: group(records, variant=variant, model=model, arm=arm) for arm in ARMS}
            by_arm = {arm: rs for arm, rs in by_arm.items() if rs}
            if not by_arm:
                continue
            panels = []
            if "tied" in by_arm:
                panels.append(("tied (shared matrix)", by_arm["tied"], ["input"]))
            if "untied" in by_arm:
                panels += [("untied: input table", by_arm["untied"], ["input"])]
                panels += [("untied: output table", by_arm["untied"], ["output"])]
            for arm in ("scheduled", "scheduled-reset", "auto"):
                if arm in by_arm:
                    panels.append((f"{arm}: input (solid), output (dashed)", by_arm[arm], ["input", "output"]))
            fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), sharey=True, squeeze=False)
            for ax, (title, rs, spaces) in zip(axes[0], panels, strict=True):
                for space in spaces:
                    for pair in PAIR_STYLE:
                        label = None if space == "input" else f"{PAIR_STYLE[pair][1]} out"
                        _band(ax, rs, space, pair, "-" if space == "input" else "--", label)
                untie_steps = {r["untie_step"] for r in rs if r["untie_step"]}
                for step in untie_steps:
                    ax.axvline(step, color="black", linewidth=0.8, linestyle=":", label=f"untie @ {step}")
                ax.set_title(title, fontsize=10)
                _step_axis(ax)
            axes[0][0].set_ylabel("Euclidean distance")
            axes[0][0].legend(fontsize=7)
            if len(panels) > 3:
                axes[0][-1].legend(fontsize=6)
            fig.suptitle(f"EXor {variant}, {model}: distances between embedding rows (mean over seeds, min-max band)")
            written.append(_save_figure(fig, figures_dir, f"{variant}-{model}-distances.png"))

            fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
            for i, (arm, rs) in enumerate(by_arm.items()):
                color = f"C{i}"
                for ax, key in ((axes[0], "train_accuracy"), (axes[1], "heldout_accuracy")):
                    steps, values = aligned(rs, "eval", lambda e, key=key: e[key])
                    ax.plot(steps, np.nanmean(values, 0), color=color, label=arm, linewidth=max(0.8, 2.6 - 0.5 * i))
                train_steps, losses = aligned(rs, "train", lambda e: e["loss"])
                axes[2].plot(
                    train_steps, np.nanmean(losses, 0), color=color, label=arm, linewidth=max(0.6, 1.6 - 0.3 * i)
                )
                for step in {r["untie_step"] for r in rs if r["untie_step"]}:
                    for ax in axes:
                        ax.axvline(step, color=color, linewidth=0.8, linestyle=":")
            ceiling = vocabulary(variant).bayes_accuracy()
            titles = ("accuracy, training strings", "accuracy, 12 held-out strings")
            for ax, title in zip(axes[:2], titles, strict=True):
                ax.axhline(ceiling, color="black", linewidth=0.8, linestyle="--", label=f"Bayes {ceiling:.2f}")
                ax.set_title(title, fontsize=10)
                ax.set_ylim(0, 1)
            axes[2].set_title("training loss", fontsize=10)
            for ax in axes:
                _step_axis(ax)
            axes[0].legend(fontsize=7)
            fig.suptitle(f"EXor {variant}, {model} (mean over seeds)")
            written.append(_save_figure(fig, figures_dir, f"{variant}-{model}-curves.png"))
    return written


def write_signal_figures(records: list[dict], figures_dir: str, rule: untie.UntieWhen) -> list[str]:
    """Per variant and model: each equivalent pair's conditional gap and tension while tied (tied and auto arms),
    with the auto rule's threshold and the steps where its trigger fired."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for variant in sorted({r["variant"] for r in records}):
        for model in sorted({r["model"] for r in records}):
            by_arm = {arm: group(records, variant=variant, model=model, arm=arm) for arm in ("tied", "auto")}
            by_arm = {arm: rs for arm, rs in by_arm.items() if rs and rs[0]["history"]["signals"]}
            if not by_arm:
                continue
            keys = [f"{kind}/{a}-{b}" for kind in ("gap", "tension") for a, b in EQUIVALENT_PAIRS]
            fig, axes = plt.subplots(2, len(EQUIVALENT_PAIRS), figsize=(11, 6.4), squeeze=False)
            for ax, key in zip(axes.flat, keys, strict=True):
                for i, (arm, rs) in enumerate(by_arm.items()):
                    for j, r in enumerate(rs):
                        points = [(s["step"], s[key]) for s in r["history"]["signals"] if key in s]
                        if points:
                            steps, values = zip(*points, strict=True)
                            ax.plot(steps, values, color=f"C{i}", alpha=0.7, linewidth=0.8, label=None if j else arm)
                    for step in sorted({r["trigger_step"] for r in rs if r.get("trigger_step")}):
                        ax.axvline(step, color=f"C{i}", linewidth=0.8, linestyle=":")
                if key.startswith(rule.signal + "/") or key == rule.signal:
                    ax.axhline(rule.threshold, color="black", linewidth=0.8, linestyle="--", label="auto threshold")
                ax.set_title(
                    f"{key} ({'nats' if key.startswith('gap') else '0..1'}); NaN (absent) when a form never occurs",
                    fontsize=8,
                )
                _step_axis(ax)
            axes[0][0].legend(fontsize=7)
            fig.suptitle(f"EXor {variant}, {model}: what tying costs, per equivalent pair (dotted: trigger fired)")
            written.append(_save_figure(fig, figures_dir, f"{variant}-{model}-signals.png"))
    return written


def claims_summary(claims: list[dict]) -> str:
    """The claims' verdict in words: how many of those checked hold, how many were not tested, and the failing ones by
    name with the page that explains them."""
    checked = [c for c in claims if c["holds"] is not None]
    untested = len(claims) - len(checked)
    summary = f"The paper's claims: {sum(c['holds'] for c in checked)} of {len(checked)} checked hold in this run" + (
        f"; {untested} not tested (arms not run, or too few seeds: see results.md)." if untested else "."
    )
    failing = [c["claim"] for c in checked if not c["holds"]]
    if failing:
        summary += (
            f"\nFailing: {'; '.join(failing)}. What each claim asks, and the runs behind the verdicts: {CLAIMS_DOCS}"
        )
    return summary + _leanings(claims)


def _leanings(claims: list[dict]) -> str:
    """Which way the claims left untested for too few seeds lean in this run's numbers (`claim_record`'s `leans`),
    each against-leaning one named with its numbers; "" where none has numbers."""
    leaning = [c for c in claims if c.get("leans") is not None]
    if not leaning:
        return ""
    against = [c for c in leaning if not c["leans"]]
    line = (
        f"\nNot tested for too few seeds, this run's numbers go the claim's way for {len(leaning) - len(against)} of "
        f"{len(leaning)}"
    )
    if not against:
        return line + "."
    return line + "; against it: " + "; ".join(f"{c['claim']}: {c['numbers']}" for c in against) + "."


def report(records: list[dict], output_dir: str, rule: untie.UntieWhen | None = AUTO_RULE) -> list[dict]:
    """Write results.json, results.md and the figures; print the table and the claims."""
    claims = check_claims(records)
    recovery = recovery_comparison(records)
    summary = [{k: v for k, v in r.items() if k not in ("history", "settings")} for r in records]
    results = {"runs": summary, "claims": claims, "optimizer_state_recovery": recovery}
    Path(output_dir, "results.json").write_text(json.dumps(results, indent=2))
    table = markdown_table(records, claims, recovery)
    Path(output_dir, "results.md").write_text(table)
    figures = write_figures(records, os.path.join(output_dir, "figures"))
    figures += write_signal_figures(records, os.path.join(output_dir, "figures"), rule)
    print(table)
    print(f"Wrote {output_dir}/results.json, results.md and {len(figures)} figures in {output_dir}/figures")
    print(claims_summary(claims))
    return claims
