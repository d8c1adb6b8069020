"""Compare the BookCorpus recipe's arms over seeds: one output folder per seed, as a Markdown table.

python scripts/bookcorpus_seeds.py runs/clm400-42 runs/clm400-43 runs/clm400-44

Reads each folder's arm records (`arms/<arm>.json`, written by `recipes/bookcorpus.py`) and prints, per arm, the
final eval loss of every seed, its mean and standard deviation, and the untie step with its reason; then whether the
auto arm's mean lies within one standard deviation (the larger of the two arms') of the better of the tied and
untied arms. Only seeds that every listed arm finished are compared.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

ORDER = ("tied", "untied", "scheduled", "auto")


def load(folders: list[str]) -> dict[str, dict[int, dict]]:
    """arm -> seed -> record, from each folder's `arms/<arm>.json` (the record's settings name its seed)."""
    table: dict[str, dict[int, dict]] = {}
    for folder in folders:
        paths = sorted(Path(folder, "arms").glob("*.json"))
        if not paths:
            raise FileNotFoundError(f"No finished arm in {folder}/arms: run recipes/bookcorpus.py there first.")
        for path in paths:
            record = json.loads(path.read_text())
            seed = record["settings"]["seed"]
            if seed in table.get(record["arm"], {}):
                raise ValueError(f"Two folders hold the {record['arm']} arm of seed {seed}: pass one per seed.")
            table.setdefault(record["arm"], {})[seed] = record
    return table


def spread(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def untie_text(record: dict) -> str:
    if record.get("untie_step") is None:
        return "-"
    return f"{record['untie_step']} ({record['untie_reason']})"


def markdown(table: dict[str, dict[int, dict]]) -> str:
    arms = [arm for arm in ORDER if arm in table] + sorted(set(table) - set(ORDER))
    seeds = sorted(set.intersection(*(set(table[arm]) for arm in arms)))
    if not seeds:
        raise ValueError("No seed has every arm finished.")
    lines = [
        "| arm | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | sd | untie step (reason) per seed |",
        "|---" * (len(seeds) + 4) + "|",
    ]
    stats = {}
    for arm in arms:
        losses = [table[arm][s]["eval_loss"] for s in seeds]
        stats[arm] = spread(losses)
        cells = " | ".join(f"{loss:.4f}" for loss in losses)
        untie = ", ".join(untie_text(table[arm][s]) for s in seeds)
        lines.append(f"| {arm} | {cells} | {stats[arm][0]:.4f} | {stats[arm][1]:.4f} | {untie} |")
    if {"tied", "untied", "auto"} <= set(stats):
        best = min(("tied", "untied"), key=lambda arm: stats[arm][0])
        margin = max(stats[best][1], stats["auto"][1])
        delta = stats["auto"][0] - stats[best][0]
        verdict = "within" if abs(delta) <= margin else ("below" if delta < 0 else "outside")
        lines.append("")
        lines.append(
            f"auto - {best} (the better of tied and untied) = {delta:+.4f} nats; one sd = {margin:.4f}: auto is "
            f"{verdict} one sd of {best} ({len(seeds)} seeds: {', '.join(map(str, seeds))})."
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    folders = sys.argv[1:] if argv is None else argv
    if not folders:
        raise SystemExit("usage: python scripts/bookcorpus_seeds.py FOLDER [FOLDER ...] (one recipe output per seed)")
    text = markdown(load(folders))
    print(text)
    return text


if __name__ == "__main__":
    main()
