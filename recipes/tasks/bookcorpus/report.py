"""BookCorpus's report over every finished arm: `results.json`, the Markdown table and the figures."""

from __future__ import annotations

import json
import os
from pathlib import Path

from untie_recipes.tasks.bookcorpus.setup import ARMS


def load_records(output_dir: str) -> list[dict]:
    """Every finished arm in output_dir, in ARMS order."""
    records = {p.stem: json.loads(p.read_text()) for p in Path(output_dir, "arms").glob("*.json")}
    return [records[arm] for arm in ARMS if arm in records]


def markdown_table(records: list[dict]) -> str:
    tied = next((r for r in records if r["arm"] == "tied"), None)
    groups = [g for g in ("twin-dh", "twin-skewed", "random") if g in records[0]["distances"]["input"]]
    head = ["arm", "untie step", "eval loss", "perplexity", "accuracy"]
    head += [f"{g} in / out" for g in groups] + ["tokens/s", "vs tied"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in records:
        untie_cell = "-" if r["untie_step"] is None else f"{r['untie_step']} ({r['untie_reason']})"
        ratio = r["tokens_per_second"] / tied["tokens_per_second"] if tied else float("nan")
        cells = [r["arm"], untie_cell, f"{r['eval_loss']:.3f}", f"{r['perplexity']:.1f}", f"{r['accuracy']:.3f}"]
        cells += [f"{r['distances']['input'][g]:.2f} / {r['distances']['output'][g]:.2f}" for g in groups]
        cells += [f"{r['tokens_per_second']:.0f}", f"{ratio:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    first = records[0]
    lines += [
        "",
        f"Objective {first['objective']}, twins {first['twins']}, dataset {first['dataset']}, {first['steps']} steps. "
        "Distances are mean Euclidean distances word-twin (twin-dh: drawn .5/.5; twin-skewed: .1/.9) and between "
        "random different common words, in the input / output table at the end. tokens/s counts training steps "
        "only; 'vs tied' is the ratio to the tied arm of the same report.",
    ]
    return "\n".join(lines) + "\n"


def write_figures(records: list[dict], figures_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(figures_dir, exist_ok=True)
    written = []

    def mark_untie(ax, record: dict) -> None:
        if record["untie_step"] is not None:
            ax.axvline(record["untie_step"], color="grey", linestyle=":", linewidth=1)

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for r in records:
        steps = [e["step"] for e in r["history"]["eval"]]
        for ax, key in zip(axes, ("loss", "accuracy"), strict=True):
            ax.plot(steps, [e[key] for e in r["history"]["eval"]], marker=".", label=r["arm"])
    for ax, title in zip(axes, ("eval loss", "eval accuracy (masked / next token)"), strict=True):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
    fig.tight_layout()
    written.append(os.path.join(figures_dir, "curves.png"))
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)

    styles = {"twin-dh": "-", "twin-skewed": "--", "random": ":"}
    fig, axes = plt.subplots(2, len(records), figsize=(3.6 * len(records), 6), sharey=True, squeeze=False)
    for column, r in enumerate(records):
        steps = [e["step"] for e in r["history"]["eval"]]
        for row, space in enumerate(("input", "output")):
            ax = axes[row][column]
            for group, style in styles.items():
                if group in r["distances"][space]:
                    values = [e["distances"][space][group] for e in r["history"]["eval"]]
                    ax.plot(steps, values, linestyle=style, label=group)
            mark_untie(ax, r)
            ax.set_title(f"{r['arm']}: {space}" + (" (= tied)" if r["arm"] == "tied" else ""), fontsize=9)
            ax.set_xlabel("step")
    axes[0][0].set_ylabel("mean distance")
    axes[1][0].set_ylabel("mean distance")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    written.append(os.path.join(figures_dir, "distances.png"))
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)
    return written


def report(output_dir: str) -> dict:
    """results.json, results.md and figures over every finished arm in output_dir."""
    records = load_records(output_dir)
    if not records:
        raise FileNotFoundError(f"No finished arms in {output_dir}/arms: train one first (drop --report_only).")
    tied = next((r for r in records if r["arm"] == "tied"), None)
    summary = []
    for r in records:
        row = {k: v for k, v in r.items() if k not in ("history", "settings")}
        row["throughput_vs_tied"] = r["tokens_per_second"] / tied["tokens_per_second"] if tied else None
        summary.append(row)
    results = {"arms": summary}
    Path(output_dir, "results.json").write_text(json.dumps(results, indent=2))
    table = markdown_table(records)
    Path(output_dir, "results.md").write_text(table)
    figures = write_figures(records, os.path.join(output_dir, "figures"))
    print(table)
    print(f"Wrote {output_dir}/results.json, results.md and {len(figures)} figures in {output_dir}/figures")
    return results
