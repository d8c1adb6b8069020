"""Per-seed table of where the EXor auto arm's divergence trigger fired, over several recipe output folders.

    python scripts/trigger_table.py runs/exor-4k runs/exor-20k          # Markdown to stdout
    python scripts/trigger_table.py runs/exor-4k --json trigger.json    # and the rows as JSON
    python scripts/trigger_table.py runs/exor-4k-tied --gaps_after 400  # the conditional gaps' levels instead

Each folder is an `recipes/exor.py` output_dir; every auto-arm record in its `runs/` is one cell: the step the
trigger fired at (or "never") and the pairs past the rule then. Rows are (preset, budget, variant), columns seeds.

With ``--gaps_after STEP`` the table is the range of each equivalent pair's measured conditional gap after STEP, per
variant and seed, in the tied arms, next to what the data generation makes it: |log(w_a / w_b)| for two forms of a
bit drawn with weights w_a and w_b (NaN, skipped by the probe, when a form never occurs).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from recipes.tasks.exor.data import EQUIVALENT_PAIRS, vocabulary  # noqa: E402


def read_auto_runs(folders: list[str]) -> list[dict]:
    """The auto arm's records in the folders' runs/, without their histories."""
    records = []
    for folder in folders:
        for path in sorted(Path(folder, "runs").glob("*-auto-*.json")):
            record = json.loads(path.read_text())
            records.append(
                {
                    "preset": record["settings"]["preset"],
                    "budget": record["settings"]["max_steps"],
                    "steps": record["steps"],
                    "variant": record["variant"],
                    "seed": record["seed"],
                    "trigger_step": record["trigger_step"],
                    "trigger_pairs": record.get("trigger_pairs", []),
                }
            )
    return records


def markdown(records: list[dict]) -> str:
    seeds = sorted({r["seed"] for r in records})
    rows = sorted({(r["preset"], r["budget"], r["variant"]) for r in records}, key=lambda k: (k[1], k[0], k[2]))
    lines = [
        "| preset | budget (steps) | variant | " + " | ".join(f"seed {s}" for s in seeds) + " |",
        "|---|---|---|" + "---|" * len(seeds),
    ]
    for preset, budget, variant in rows:
        cells = []
        for seed in seeds:
            match = [
                r
                for r in records
                if (r["preset"], r["budget"], r["variant"], r["seed"]) == (preset, budget, variant, seed)
            ]
            if not match:
                cells.append("-")
            elif match[0]["trigger_step"] is None:
                cells.append("never")
            else:
                cells.append(f"{match[0]['trigger_step']:,} ({', '.join(match[0]['trigger_pairs'])})")
        lines.append(f"| {preset} | {budget:,} | {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def expected_gap(variant: str, pair: tuple[int, int]) -> float:
    """The conditional gap the data generation gives a pair of forms of one bit: |log(w_a / w_b)| in every context
    (NaN when a form is never drawn: the probe skips a pair whose symbol never occurs)."""
    vocab = vocabulary(variant)
    weights = (*vocab.zero_weights, *vocab.one_weights)
    a, b = (weights[symbol] for symbol in pair)
    return abs(math.log(a / b)) if a > 0 and b > 0 else math.nan


def gap_levels(folders: list[str], after: int) -> str:
    """Markdown: per tied run (variant, seed) and equivalent pair, the measured gap's range after step `after`."""
    lines = [
        f"| variant | seed | pair | drawn | data's gap | measured gap after step {after:,} |",
        "|---|---|---|---|---|---|",
    ]
    records = []
    for folder in folders:
        for path in sorted(Path(folder, "runs").glob("*-tied-*.json")):
            records.append(json.loads(path.read_text()))
    if not records:
        raise SystemExit(f"no tied-arm runs in {folders}: run recipes/exor.py --arms tied ... first")
    for record in sorted(records, key=lambda r: (r["variant"], r["seed"])):
        vocab = vocabulary(record["variant"])
        weights = (*vocab.zero_weights, *vocab.one_weights)
        for pair in EQUIVALENT_PAIRS:
            key = f"gap/{pair[0]}-{pair[1]}"
            values = [s[key] for s in record["history"]["signals"] if s["step"] > after and key in s]
            finite = [v for v in values if math.isfinite(v)]
            measured = f"{min(finite):.2f}-{max(finite):.2f}" if finite else "NaN (skipped)"
            expected = expected_gap(record["variant"], pair)
            drawn = f"{weights[pair[0]]:g} / {weights[pair[1]]:g}"
            lines.append(
                f"| {record['variant']} | {record['seed']} | ({pair[0]},{pair[1]}) | {drawn} | "
                f"{'NaN' if math.isnan(expected) else f'{expected:.2f}'} | {measured} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", help="recipes/exor.py output folders")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    parser.add_argument("--gaps_after", type=int, help="tabulate the tied arms' conditional gaps after this step")
    args = parser.parse_args(argv)
    if args.gaps_after is not None:
        table = gap_levels(args.folders, args.gaps_after)
        print(table)
        return table
    records = read_auto_runs(args.folders)
    if not records:
        raise SystemExit(f"no auto-arm runs in {args.folders}: run recipes/exor.py --arms auto ... first")
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=2))
    table = markdown(records)
    print(table)
    return table


if __name__ == "__main__":
    main()
