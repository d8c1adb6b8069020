"""Judge the EXor quick start's restated tied claim (issue 69) on fresh seeds: pre-registered in
`untie_recipes.tasks.exor.claims` (`judge_relative_tied_claim`) and docs/recipes/exor.md before any of them ran.

    python recipes/exor.py --arms untied tied --seeds 43 44 45 --output_dir runs/exor-judge   # quick preset
    python scripts/judge_tied_claim.py runs/exor-judge

The claim: in the tied arm (main variant, the quick preset's Mixer), (2,3) is close (below 0.3 of d(0,2)) and (0,1)
is at least 10 times (2,3)'s distance and at least the untied arm's input (0,1), all relative to d(0,2). It is judged
on seeds 43, 44 and 45 (portable kernels, the recipe's default): it holds if it holds on every seed whose tied and
untied runs both learned the task and at least two did; one learned seed where it fails decides that it fails; with
fewer than two learned, the next seed must run (46, 47, ...): the script prints its command. Exit status: 0 holds,
1 fails, 2 undecided. Seed 42 and development seeds 1-2 are never counted: they ran before the claim was written.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from untie_recipes.tasks.exor.claims import COLLAPSE_FACTOR, judge_relative_tied_claim

EXIT = {"holds": 0, "fails": 1, "undecided": 2}


def read_records(folder: str) -> list[dict]:
    """The full run records (histories included) in a recipe output folder's runs/."""
    return [json.loads(path.read_text()) for path in sorted(Path(folder, "runs").glob("*.json"))]


def markdown(judgement: dict) -> str:
    lines = [
        f"claim: {judgement['claim']}",
        "",
        f"| seed | learned (tied and untied) | tied 0-1 | tied 2-3 | {COLLAPSE_FACTOR} x tied 2-3 | untied input 0-1 "
        "| holds |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in judgement["seeds"]:
        holds = "-" if row["holds"] is None else ("yes" if row["holds"] else "**no**")
        lines.append(
            f"| {row['seed']} | {'yes' if row['learned'] else 'no'} | {row['tied_0_1']:.3f} | {row['tied_2_3']:.3f} | "
            f"{COLLAPSE_FACTOR * row['tied_2_3']:.3f} | {row['untied_input_0_1']:.3f} | {holds} |"
        )
    lines.append("")
    lines.append(f"verdict: {judgement['verdict']} (learned seeds: {judgement['learned_seeds'] or 'none'})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", nargs="?", default="runs/exor-judge", help="the recipe's output folder")
    parser.add_argument("--model", default="mixer", help="the model judged (the quick preset's: mixer)")
    parser.add_argument(
        "--write", metavar="PATH", help="also write the table and verdict to PATH and exit 0 (the docs table's command)"
    )
    args = parser.parse_args(argv)
    judgement = judge_relative_tied_claim(read_records(args.folder), args.model)
    print(markdown(judgement))
    if args.write:
        Path(args.write).write_text(markdown(judgement) + "\n")
        return 0
    if judgement["verdict"] == "undecided":
        seed = judgement["next_seed"]
        print(
            f"run the next seed, then judge again: python recipes/exor.py --arms untied tied --seeds {seed} "
            f"--output_dir {args.folder}"
        )
    return EXIT[judgement["verdict"]]


if __name__ == "__main__":
    raise SystemExit(main())
