"""Per-seed table of where the EXor auto arm's divergence trigger fired, over several recipe output folders.

    python scripts/trigger_table.py runs/exor-4k runs/exor-20k          # Markdown to stdout
    python scripts/trigger_table.py runs/exor-4k --json trigger.json    # and the rows as JSON

Each folder is an `recipes/exor.py` output_dir; every auto-arm record in its `runs/` is one cell: the step the
trigger fired at (or "never") and the pairs past the rule then. Rows are (preset, budget, variant), columns seeds.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


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


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", help="recipes/exor.py output folders")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
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
