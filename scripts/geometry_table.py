"""Per-run table of the EXor pairs' final distances, relative to the reference pair (0,2), over several recipe output
folders: how a geometry claim's numbers move with the schedule, seed by seed.

    python scripts/geometry_table.py runs/mixer-tied-40k runs/mixer-tied-20k    # Markdown to stdout
    python scripts/geometry_table.py runs/exor --arms tied untied               # some arms only

Each folder is a `recipes/exor.py` output_dir; every record in its `runs/` is one row: the run's schedule (steps,
peak learning rate, cosine half-period), its seed, its final masked-bit accuracy on the training strings and whether
that counts as learning the task (`untie_recipes.tasks.exor.claims.learned`: the claims judge geometry on those runs
only), and d(0,1) / d(0,2) and d(2,3) / d(0,2) in the input and output tables (one shared table in a tied run).
A pair is close below `claims.SEPARATION` (0.3) times the reference distance, apart otherwise.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from untie_recipes.tasks.exor.claims import learned, relative


def read_runs(folders: list[str], arms: list[str] | None = None) -> list[dict]:
    """The run records in the folders' runs/ (of `arms` only, if given), without their histories but with their final
    geometry."""
    records = []
    for folder in folders:
        for path in sorted(Path(folder, "runs").glob("*.json")):
            record = json.loads(path.read_text())
            if arms and record["arm"] not in arms:
                continue
            settings = record["settings"]
            records.append(
                {
                    "variant": record["variant"],
                    "model": record["model"],
                    "arm": record["arm"],
                    "seed": record["seed"],
                    "steps": settings["max_steps"],
                    "learning_rate": settings["learning_rate"],
                    "cosine_steps": settings["cosine_steps"],
                    "train_accuracy": record["train_accuracy"],
                    "learned": learned(record),
                    "geometry": record["history"]["geometry"][-1],
                }
            )
    return records


def markdown(records: list[dict]) -> str:
    """One row per run, longest schedule first, then by seed."""
    lines = [
        "| variant | model | arm | steps | peak lr | half-period | seed | train acc | learned "
        "| in 0-1 | in 2-3 | out 0-1 | out 2-3 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    order = sorted(records, key=lambda r: (r["variant"], r["model"], r["arm"], -r["steps"], r["seed"]))
    for r in order:
        distances = " | ".join(
            f"{relative(r['geometry'], space, pair):.3f}" for space in ("input", "output") for pair in ("0-1", "2-3")
        )
        lines.append(
            f"| {r['variant']} | {r['model']} | {r['arm']} | {r['steps']:,} | {r['learning_rate']:g} | "
            f"{r['cosine_steps']:,} | {r['seed']} | {r['train_accuracy']:.3f} | {'yes' if r['learned'] else 'no'} | "
            f"{distances} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", help="recipes/exor.py output folders")
    parser.add_argument("--arms", nargs="+", help="only these arms (default: every arm found)")
    args = parser.parse_args(argv)
    records = read_runs(args.folders, args.arms)
    if not records:
        raise SystemExit(f"no runs in {args.folders}: run recipes/exor.py --output_dir FOLDER ... first")
    table = markdown(records)
    print(table)
    return table


if __name__ == "__main__":
    main()
