"""When does untying pay? Train small causal LMs tied, untied, untied at fixed fractions of the budget, and with the
default trigger, across widths, token budgets and seeds; write the per-cell table and a heatmap.

    python recipes/decision_map.py                     # the map: 2 widths x 3 budgets x 3 seeds (hours on 2 cores)
    python recipes/decision_map.py --preset quick      # a minutes-long map on the shipped text: a check that it runs
    python recipes/decision_map.py --report_only       # table and figure from the runs finished so far
    python recipes/decision_map.py --widths 64 --seeds 7 --budgets 500   # one cell, other seeds
    python recipes/decision_map.py --optimizer_state fresh   # untying arms with other settings (any UntieConfig flag)
    python recipes/decision_map.py --arms tied untied auto     # fewer arms (no fixed branches): a cheaper map

Finished runs are kept under ``--output_dir/records`` and skipped by a rerun, so the map spreads over sittings; an
interrupted tied or untied run resumes from its last checkpoint. No arm sees a token twice: the largest budget must
fit in the corpus's training blocks (checked at the start).
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from untie import UntieConfig
from untie_recipes.common import parse
from untie_recipes.tasks.decision_map.corpus import BLOCK, SOURCES, VOCAB_SIZE, default_cache_dir, load_corpus
from untie_recipes.tasks.decision_map.report import unit_complete, write_report
from untie_recipes.tasks.decision_map.runs import MAP_ARMS, MapContext, run_unit, steps_of_unit
from untie_recipes.tasks.decision_map.training import RunRecord, TrainingSetup

#: Preset -> defaults; flags given on the command line win.
PRESETS = {
    "map": {"sources": ["shakespeare", "kjv"], "widths": [64, 256], "budgets": [250, 500, 1000], "seeds": [1, 2, 3]},
    "quick": {"sources": ["shakespeare"], "widths": [32], "budgets": [20, 40], "seeds": [1, 2], "layers": 1},
}
#: Width -> (layers, heads, learning rate) of the map's models, fixed before any run (not tuned on the map).
MODEL_SHAPES = {32: (1, 2, 3e-3), 64: (2, 4, 3e-3), 128: (2, 4, 2e-3), 256: (4, 4, 1e-3)}


@dataclass
class MapArguments:
    preset: str = field(default="map", metadata={"help": f"one of {sorted(PRESETS)}; flags override its values"})
    sources: list[str] | None = field(default=None, metadata={"help": f"corpus sources among {SOURCES}"})
    widths: list[int] | None = field(default=None, metadata={"help": f"model widths among {sorted(MODEL_SHAPES)}"})
    budgets: list[int] | None = field(default=None, metadata={"help": "token budgets, in optimizer steps"})
    seeds: list[int] | None = field(default=None, metadata={"help": "seeds (model init and data order)"})
    arms: list[str] = field(
        default_factory=lambda: list(MAP_ARMS),
        metadata={"help": f"the arms to run, among {MAP_ARMS} (tied always runs: the branches start from it)"},
    )
    layers: int | None = field(default=None, metadata={"help": "override the width's number of layers"})
    vocab_size: int = field(default=VOCAB_SIZE, metadata={"help": "the BPE vocabulary trained on the corpus"})
    batch_size: int = field(default=8, metadata={"help": f"blocks of {BLOCK} tokens per optimizer step"})
    warmup: int = field(default=50, metadata={"help": "linear warm-up steps, then a constant learning rate"})
    output_dir: str = field(default="runs/decision-map", metadata={"help": "records, checkpoints, report"})
    cache_dir: str | None = field(
        default=None, metadata={"help": "corpus cache (default $UNTIE_CACHE or ~/.cache/untie)"}
    )
    report_only: bool = field(default=False, metadata={"help": "write the report from the finished runs only"})
    disable_tqdm: bool = field(default=False, metadata={"help": "no progress line"})

    def resolve(self) -> None:
        if self.preset not in PRESETS:
            raise SystemExit(f"--preset {self.preset!r}: choose one of {sorted(PRESETS)}.")
        for key, value in PRESETS[self.preset].items():
            if getattr(self, key) is None:
                setattr(self, key, value)
        wrong = sorted(set(self.arms) - set(MAP_ARMS))
        if wrong:
            raise SystemExit(f"--arms {wrong}: choose among {MAP_ARMS}.")
        self.arms = [arm for arm in MAP_ARMS if arm in self.arms or arm == "tied"]
        unknown = sorted(set(self.widths) - set(MODEL_SHAPES))
        if unknown:
            raise SystemExit(f"--widths {unknown}: choose among {sorted(MODEL_SHAPES)}.")
        if min(self.budgets) <= self.warmup and self.preset != "quick":
            raise SystemExit(f"--budgets {self.budgets}: every budget must exceed --warmup {self.warmup}.")
        self.budgets = sorted(set(self.budgets))


def setup_for(args: MapArguments, width: int, seed: int) -> TrainingSetup:
    layers, heads, learning_rate = MODEL_SHAPES[width]
    warmup = min(args.warmup, max(1, min(args.budgets) // 4))
    return TrainingSetup(width=width, layers=args.layers or layers, heads=heads, seed=seed,
                         batch_size=args.batch_size, learning_rate=learning_rate, warmup=warmup)  # fmt: skip


def check_same_data(output_dir: Path, args: MapArguments) -> None:
    """Refuse an output_dir whose runs were trained on other data (sources, vocabulary) or another model depth or
    batch: its records are named by width and seed only, and would be reused as if they were this map's."""
    wanted = {"sources": sorted(args.sources), "vocab_size": args.vocab_size, "layers": args.layers,
              "batch_size": args.batch_size}  # fmt: skip
    path = output_dir / "map.json"
    if path.exists():
        found = json.loads(path.read_text())
        if found != wanted:
            raise SystemExit(
                f"{output_dir} holds a map of {found}; this one is {wanted}. Pass another --output_dir for it."
            )
        return
    output_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(wanted, indent=2))


def main(argv: list[str] | None = None) -> list[dict]:
    (args, config), _explicit = parse((MapArguments, UntieConfig), argv)  # lists: --seeds 1 2 3, as every recipe
    args.resolve()
    output_dir = Path(args.output_dir)
    cache_dir = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    corpus = load_corpus(tuple(args.sources), cache_dir, args.vocab_size)
    needed = max(args.budgets) * args.batch_size
    if needed > len(corpus.train):
        raise SystemExit(
            f"The largest budget, {max(args.budgets)} steps of {args.batch_size} blocks, needs {needed} training "
            f"blocks of {BLOCK} tokens and the corpus ({'+'.join(args.sources)}) has {len(corpus.train)}: an arm would "
            f"see tokens twice. Lower --budgets (at most {len(corpus.train) // args.batch_size} steps) or "
            "--batch_size."
        )
    check_same_data(output_dir, args)
    ctx = MapContext(corpus, tuple(args.budgets), output_dir, untie=config, arms=tuple(args.arms))
    units_wanted = [(w, s) for w in args.widths for s in args.seeds]
    units: dict[tuple[int, int], dict[str, RunRecord]] = {}
    if not args.report_only:
        total = steps_of_unit(ctx) * len(units_wanted)
        bar = tqdm(total=total, desc="Decision map", unit="step", disable=args.disable_tqdm, dynamic_ncols=True)

        def progress(steps: int, loss: float) -> None:
            bar.update(steps)
            if loss == loss:
                bar.set_postfix_str(f"loss {loss:.3f}", refresh=False)

        for width, seed in units_wanted:
            bar.set_description(f"Decision map d{width} seed {seed}")
            units[(width, seed)] = run_unit(ctx, setup_for(args, width, seed), progress)
        bar.close()
    else:
        for width, seed in units_wanted:
            records = ctx.load_records(setup_for(args, width, seed))
            if unit_complete(records, tuple(args.budgets), tuple(args.arms)):
                units[(width, seed)] = records
            else:
                print(f"d{width} seed {seed}: not finished ({len(records)} runs recorded), left out", file=sys.stderr)
        if not units:
            raise SystemExit(f"No finished (width, seed) in {output_dir}/records: run the map first.")
    settings = {**asdict(args), "optimizer_state": config.optimizer_state, "untie": config.to_json_dict(),
                "train_blocks": len(corpus.train), "validation_blocks": len(corpus.validation), "block": BLOCK,
                "torch": torch.__version__}  # fmt: skip
    timed = [r.seconds for records in units.values() for r in records.values() if r.seconds is not None]
    settings["core_hours"] = {"runs_timed": len(timed), "seconds": round(sum(timed), 1),
                              "hours": round(sum(timed) / 3600, 3)}  # fmt: skip  # one thread per run
    suffix = ctx.label.replace("+", "-")
    table = write_report(output_dir, units, tuple(args.budgets), args.batch_size * BLOCK, settings, suffix,
                         tuple(args.arms))  # fmt: skip
    print((output_dir / f"results{suffix}.md").read_text())
    print(f"Wrote {output_dir}/results{suffix}.json, .md and figures/decision-map{suffix}.png", file=sys.stderr)
    return table


if __name__ == "__main__":
    main()
