"""The untie policy's evidence: per decision-map folder and budget, the default tie-then-untie run against training
untied from the start, paired by seed, next to tied and untied; or, with ``--validation``, the held-out validation of
a policy (``--policy``, issue 48; "auto" by default) over the folders' reports; or, with ``--per_seed``, that
validation seed by seed from the records, including seeds whose fixed branches are not all recorded yet (what a
shape says before its report exists); or, with ``--tie_then_untie``, every arm with a tied phase of the folders'
reports against the better of tied and untied, seed by seed (issue 48's second criterion, asked of every arm).

    python scripts/policy_table.py docs/data/decision-map/dev-d128x2 docs/data/decision-map/dev-d128x4 \\
        --output docs/data/decision-map/policy-dev.md
    python scripts/policy_table.py --validation docs/data/decision-map/heldout-d64x4 ... \\
        --output docs/data/decision-map/policy-heldout.md
    python scripts/policy_table.py --per_seed docs/data/decision-map/heldout-d128x8 ... \\
        --output docs/data/decision-map/policy-heldout-seeds.md
    python scripts/policy_table.py --tie_then_untie docs/data/decision-map/heldout-d128x8 ... \\
        --output docs/data/decision-map/tie-then-untie.md

Each folder is a `recipes/decision_map.py` output_dir that ran the arms tied, untied and auto (the default
`Untier()`), then ``--arms auto --untie_at 0 --untie_when none --head_init model``: the run `policy="auto"` makes
where it trains a freshly built model untied from the start. With ``--head_init copy`` here, the table reads instead
the run made without ``--head_init model`` (its head copied from the embedding). A row is (folder's shape, budget)
over the seeds that have all four runs. Differences are paired by seed (the arms of a seed share the initialisation
and the data order); < 0: the first arm named is better (lower validation loss, nats per token).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import replace
from pathlib import Path

from untie import UntieConfig
from untie.decision.settings import POLICIES
from untie.structure.policy import embedding_share
from untie_recipes.tasks.decision_map.corpus import BLOCK
from untie_recipes.tasks.decision_map.report import arm_losses
from untie_recipes.tasks.decision_map.runs import FIXED_FRACTIONS, MapContext
from untie_recipes.tasks.decision_map.training import TrainingSetup, build_model, fixed_untie_step


def _spread(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else math.nan)


def start_arm(head_init: str) -> str:
    """The record name of the map's auto arm run with ``--untie_at 0 --untie_when none`` and, for a drawn head,
    ``--head_init model`` (without it, an explicit untie_at=0 copies the embedding)."""
    config = UntieConfig(untie_at=0, untie_when=None, head_init="model" if head_init == "model" else "auto")
    return MapContext(None, (1,), Path("."), untie=config).arm("auto")  # type: ignore[arg-type]  # no corpus needed


def read_folder(folder: Path, head_init: str) -> dict[int, dict[str, dict]]:
    """Seed -> arm ("tied", "untied", "default", "untied-from-start") -> its record, for the seeds with all four;
    "untied-from-start" is the run whose head started as `head_init` ("copy" or "model")."""
    names = {"tied": "tied", "untied": "untied", "auto": "default", start_arm(head_init): "untied-from-start"}
    by_seed: dict[int, dict[str, dict]] = {}
    for path in sorted((folder / "records").glob("*.json")):
        record = json.loads(path.read_text())
        if record["arm"] in names:
            by_seed.setdefault(record["seed"], {})[names[record["arm"]]] = record
    return {seed: arms for seed, arms in by_seed.items() if len(arms) == 4}


def shape_of(folder: Path, record: dict) -> tuple[TrainingSetup, int, float]:
    """The setup of a folder's runs (from one of its records), its vocabulary and the embedding's share of the tied
    model's parameters (what `policy="auto"` reads)."""
    setup = TrainingSetup(**record["setup"])
    vocab = json.loads((folder / "map.json").read_text())["vocab_size"]
    return setup, vocab, embedding_share(build_model(setup, vocab, BLOCK, tied=True))[0]


def rows(folders: list[Path], head_init: str = "model") -> list[dict]:
    out = []
    for folder in folders:
        seeds = read_folder(folder, head_init)
        if not seeds:
            print(f"{folder}: no seed with all four runs, left out", file=sys.stderr)
            continue
        setup, vocab, share = shape_of(folder, next(iter(seeds.values()))["tied"])
        budgets = sorted({int(b) for arms in seeds.values() for b in arms["tied"]["losses"]})
        for budget in budgets:
            key = str(budget)
            loss = {
                arm: [seeds[s][arm]["losses"][key] for s in sorted(seeds)]
                for arm in ("tied", "untied", "default", "untied-from-start")
            }
            best_plain = [min(t, u) for t, u in zip(loss["tied"], loss["untied"], strict=True)]

            def paired(a: list[float], b: list[float]) -> dict:
                differences = [x - y for x, y in zip(a, b, strict=True)]
                mean, sd = _spread(differences)
                return {"mean": mean, "sd": sd, "better": sum(d < 0 for d in differences), "seeds": len(differences)}

            out.append({
                "shape": f"d{setup.width}x{setup.layers}", "vocab": vocab, "share": share, "budget": budget,
                "seeds": sorted(seeds), "means": {arm: _spread(values) for arm, values in loss.items()},
                "start_minus_default": paired(loss["untied-from-start"], loss["default"]),
                "start_minus_untied": paired(loss["untied-from-start"], loss["untied"]),
                "default_minus_best_plain": paired(loss["default"], best_plain),
                "default_untie": [f"{seeds[s]['default']['untie_step']} ({seeds[s]['default']['reason']})"
                                  for s in sorted(seeds)],
            })  # fmt: skip
    return out


def markdown(table: list[dict]) -> str:
    def cell(paired: dict) -> str:
        return f"{paired['mean']:+.4f} ± {paired['sd']:.4f} ({paired['better']}/{paired['seeds']})"

    lines = [
        "| shape | embedding share | budget (steps) | seeds | tied | untied | default | untied from the start "
        "| from the start − default | from the start − untied | default − best of tied, untied |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in table:
        means = " | ".join(
            "{:.4f} ± {:.4f}".format(*row["means"][arm]) for arm in ("tied", "untied", "default", "untied-from-start")
        )
        lines.append(
            f"| {row['shape']} ({row['vocab']:,}) | {row['share']:.0%} | {row['budget']:,} | "
            f"{' '.join(map(str, row['seeds']))} | {means} | {cell(row['start_minus_default'])} | "
            f"{cell(row['start_minus_untied'])} | {cell(row['default_minus_best_plain'])} |"
        )
    return "\n".join(lines)


def validated(policy: str) -> UntieConfig:
    """The map's auto arm under test in a validation: `policy`, every other setting the default."""
    return UntieConfig(policy=policy)  # type: ignore[arg-type]  # checked by UntieConfig


def validation_rows(folders: list[Path], policy: str = "auto") -> list[dict]:
    """Per (folder's shape, budget): each arm's mean and sd, the policy's untie steps and the validation's verdict,
    from the report `recipes/decision_map.py` wrote for `validated(policy)` (``results-cfg<digest>.json``). A cell
    with fewer seeds than the map was run with, or with one (no paired sd), is left out, and said, until they are in."""
    config = validated(policy)
    suffix = MapContext(None, (1,), Path("."), untie=config).label.replace("+", "-")  # type: ignore[arg-type]
    out = []
    for folder in folders:
        report = folder / f"results{suffix}.json"
        if not report.exists():
            print(f"{folder}: no report {report.name} (run the map with --policy {policy}), left out", file=sys.stderr)
            continue
        content = json.loads(report.read_text())
        cells = [cell for cell in content["cells"] if cell["validation"] is not None]
        asked = content["settings"]["seeds"]
        unfinished = [cell["budget"] for cell in cells if len(cell["seeds"]) < max(2, len(asked))]
        if unfinished:  # a verdict needs every seed the map was asked for, and two for a paired sd
            print(f"{folder}: budgets {unfinished} have fewer seeds than the map's {asked} (or one), left out until "
                  "they are in (rerun the map, or its --report_only)", file=sys.stderr)  # fmt: skip
            cells = [cell for cell in cells if cell["budget"] not in unfinished]
        tied = next(iter(sorted((folder / "records").glob("*-tied.json"))), None)
        if not cells or tied is None:
            print(f"{folder}: no finished cell with every arm, left out", file=sys.stderr)
            continue
        setup, vocab, share = shape_of(folder, json.loads(tied.read_text()))
        for cell in cells:
            arms = cell["arms"]
            shown = ("tied", "untied", cell["oracle"], "auto")
            out.append({
                "shape": f"d{setup.width}x{setup.layers}", "vocab": vocab, "share": share, "budget": cell["budget"],
                "seeds": cell["seeds"], "oracle": cell["oracle"],
                "means": {arm: (arms[arm]["mean"], arms[arm]["sd"]) for arm in shown},
                "policy_untie": sorted(set(arms["auto"]["untie"])), "validation": cell["validation"],
            })  # fmt: skip
    return out


def validation_markdown(table: list[dict]) -> str:
    lines = [
        "| shape | embedding share | budget (steps) | seeds | tied | untied | best fixed | policy | policy untied at "
        "| best baseline | policy's regret (paired) | tolerance | within it | beats the better of tied, untied |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in table:
        means = [row["means"][arm] for arm in ("tied", "untied", row["oracle"], "auto")]
        values = [f"{mean:.4f} ± {sd:.4f}" for mean, sd in means]
        values[2] += f" ({row['oracle']})"
        check = row["validation"]
        lines.append(
            f"| {row['shape']} ({row['vocab']:,}) | {row['share']:.0%} | {row['budget']:,} | "
            f"{' '.join(map(str, row['seeds']))} | {' | '.join(values)} | {', '.join(row['policy_untie'])} | "
            f"{check['best']} | {check['regret']:+.4f} ± {check['sd']:.4f} | {check['tolerance']:.4f} | "
            f"{'yes' if check['passes'] else 'no'} | {check['beats_better_plain']}/{check['seeds']} seeds |"
        )
    return "\n".join(lines)


def seed_rows(folders: list[Path], policy: str = "auto") -> list[dict]:
    """Per (folder's shape, seed, budget) whose tied, untied and `validated(policy)` runs are recorded (and, where the
    policy's run had not untied by a budget's deadline, that deadline's branch, as the report reads it): the three
    losses, the policy's untie, the best fixed arm recorded so far at that budget (of the four) and the policy's
    differences. From the records alone: a seed counts before its fixed branches have all run."""
    out = []
    for folder in folders:
        tied = [json.loads(path.read_text()) for path in sorted((folder / "records").glob("*-tied.json"))]
        if not tied:
            print(f"{folder}: no tied run recorded, left out", file=sys.stderr)
            continue
        setup, vocab, share = shape_of(folder, tied[0])
        probe = MapContext(None, (1,), folder, untie=validated(policy))  # type: ignore[arg-type]  # no corpus needed
        for seed in sorted(record["seed"] for record in tied):
            records = probe.load_records(replace(setup, seed=seed))
            out.extend(_seed_cells(records, replace(setup, seed=seed), vocab, share))
    return out


def _seed_cells(records: dict, setup: TrainingSetup, vocab: int, share: float) -> list[dict]:
    """`seed_rows` for one (folder, seed), from its records keyed by their arms' plain names."""
    if "auto" not in records:
        return []
    budgets = tuple(sorted(int(key) for key in records["auto"].losses))
    out = []
    for budget in budgets:
        try:
            losses = arm_losses(records, budget, budgets, ("tied", "untied", "auto"))
        except KeyError:  # the tied or untied run, or the deadline branch the policy's cell reads, is not recorded
            continue
        recorded = {
            f"fixed-{round(fraction * 100)}": records[name].losses[str(budget)]
            for fraction in FIXED_FRACTIONS
            if str(budget) in getattr(records.get(name := f"untie@{fixed_untie_step(fraction, budget)}"), "losses", {})
        }
        best = min(recorded, key=recorded.__getitem__) if recorded else None
        (tied, _), (untied, _), (policy, untie) = losses["tied"], losses["untied"], losses["auto"]
        out.append({
            "shape": f"d{setup.width}x{setup.layers}", "vocab": vocab, "share": share, "seed": setup.seed,
            "budget": budget, "tied": tied, "untied": untied, "policy": policy, "policy_untie": untie,
            "fixed_recorded": len(recorded), "best_fixed": best,
            "best_fixed_loss": recorded.get(best) if best else None,
            "policy_minus_untied": policy - untied, "policy_minus_tied": policy - tied,
            "policy_minus_best": policy - min([tied, untied, *recorded.values()]),
        })  # fmt: skip
    return out


def seed_markdown(table: list[dict]) -> str:
    lines = [
        "| shape | embedding share | seed | budget (steps) | tied | untied | best fixed so far | policy "
        "| policy untied at | policy − untied | policy − tied | policy − best of those |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in table:
        fixed = (
            f"{row['best_fixed_loss']:.4f} ({row['best_fixed']}; {row['fixed_recorded']}/{len(FIXED_FRACTIONS)} run)"
            if row["best_fixed"]
            else f"- (0/{len(FIXED_FRACTIONS)} run)"
        )
        lines.append(
            f"| {row['shape']} ({row['vocab']:,}) | {row['share']:.0%} | {row['seed']} | {row['budget']:,} | "
            f"{row['tied']:.4f} | {row['untied']:.4f} | {fixed} | {row['policy']:.4f} | {row['policy_untie']} | "
            f"{row['policy_minus_untied']:+.4f} | {row['policy_minus_tied']:+.4f} | {row['policy_minus_best']:+.4f} |"
        )
    return "\n".join(lines)


def _is_tie_then_untie(arm: str, cell: dict) -> bool:
    """Whether a report's arm had a tied phase and then untied: a fixed untie step, or the auto arm where it did not
    train untied from the start (a policy's "0 (start)")."""
    if arm.startswith("fixed-"):
        return True
    return arm == "auto" and not all(untie.startswith("0 ") for untie in cell["arms"]["auto"]["untie"])


def tie_then_untie_rows(folders: list[Path]) -> list[dict]:
    """Per report of each folder (``results*.json``) and cell: every tie-then-untie arm against the better of tied and
    untied seed by seed (in how many seeds it was below both, and its margin over the better, paired by seed), the
    best of them (most such seeds, then the lowest mean margin), and whether any arm was below both in every seed:
    issue 48's second criterion asked of every arm the maps ran, not only the policy."""
    out = []
    for folder in folders:
        reports = sorted(folder.glob("results*.json"))
        if not reports:
            print(f"{folder}: no report (run the map with --report_only true), left out", file=sys.stderr)
        for report in reports:
            for cell in json.loads(report.read_text())["cells"]:
                arms = cell["arms"]
                if "tied" not in arms or "untied" not in arms:
                    continue
                better = [min(t, u) for t, u in zip(arms["tied"]["per_seed"], arms["untied"]["per_seed"], strict=True)]
                margins = {
                    arm: [x - b for x, b in zip(values["per_seed"], better, strict=True)]
                    for arm, values in arms.items()
                    if _is_tie_then_untie(arm, cell)
                }
                if not margins:
                    continue
                below = {arm: sum(m < 0 for m in values) for arm, values in margins.items()}
                best = min(margins, key=lambda arm: (-below[arm], statistics.fmean(margins[arm])))
                out.append({
                    "map": f"{folder.name}/{report.stem}", "width": cell["width"], "budget": cell["budget"],
                    "seeds": cell["seeds"], "arms": sorted(margins), "best": best, "best_below": below[best],
                    "best_margin": _spread(margins[best]),
                    "every_seed": sorted(arm for arm, count in below.items() if count == len(better)),
                })  # fmt: skip
    return out


def tie_then_untie_markdown(table: list[dict]) -> str:
    lines = [
        "| map (report) | width | budget (steps) | seeds | tie-then-untie arms | best of them | seeds it was below "
        "tied and untied | its loss − the better of tied, untied (paired) | arms below both in every seed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in table:
        mean, sd = row["best_margin"]
        lines.append(
            f"| {row['map']} | d{row['width']} | {row['budget']:,} | {' '.join(map(str, row['seeds']))} | "
            f"{len(row['arms'])} | {row['best']} | {row['best_below']}/{len(row['seeds'])} | {mean:+.4f} ± {sd:.4f} | "
            f"{', '.join(row['every_seed']) or 'none'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", type=Path, help="decision-map output folders")
    parser.add_argument("--output", type=Path, help="write the Markdown table (and .json beside it) here too")
    parser.add_argument(
        "--head_init", choices=("model", "copy"), default="model",
        help="the run untied from the start whose head was drawn by the model's initialiser (model: what the policy "
        "does for a freshly built model) or copied from the embedding (copy)",
    )  # fmt: skip
    parser.add_argument(
        "--validation", action="store_true",
        help="the held-out validation of --policy (issue 48) from the folders' reports, instead",
    )  # fmt: skip
    parser.add_argument(
        "--policy", choices=[name for name in POLICIES if name != "off"], default="auto",
        help="the policy whose held-out runs --validation and --per_seed read (the map's --policy)",
    )  # fmt: skip
    parser.add_argument(
        "--per_seed", action="store_true",
        help="the held-out validation seed by seed, from the folders' records (fixed branches may be unfinished)",
    )  # fmt: skip
    parser.add_argument(
        "--tie_then_untie", action="store_true",
        help="every tie-then-untie arm of the folders' reports against the better of tied and untied, seed by seed",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.validation + args.per_seed + args.tie_then_untie > 1:
        parser.error("--validation, --per_seed and --tie_then_untie are three views: pass one")
    if args.tie_then_untie:
        table = tie_then_untie_rows(args.folders)
        text = tie_then_untie_markdown(table)
    elif args.validation:
        table = validation_rows(args.folders, args.policy)
        text = validation_markdown(table)
    elif args.per_seed:
        table = seed_rows(args.folders, args.policy)
        text = seed_markdown(table)
    else:
        table = rows(args.folders, args.head_init)
        text = markdown(table)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text + "\n")
        args.output.with_suffix(".json").write_text(json.dumps(table, indent=2) + "\n")
    print(text)
    return text


if __name__ == "__main__":
    main()
