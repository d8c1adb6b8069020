"""Where does a tied phase pay? The tie-then-untie study of issue 68, CPU tier: Llama-style decoders on the decision
map's corpus (shakespeare + kjv + debian-docs, an 8,192 BPE vocabulary, blocks of 128 tokens), two cells, an LR sweep
per cell, eight arms, three development seeds. The protocol and the rule that turns its tables into the default:
docs/recipes/study.md.

    python recipes/study.py --plan                  # the cells' sizes, budgets and branch steps; runs nothing
    python recipes/study.py                         # cells A then B: sweep, then seeds 1, 2, 3 (hours, one thread)
    python recipes/study.py --cells A --seeds 1     # a part of it
    python recipes/study.py --report_only           # results.json and results.md from the finished runs

Finished runs are records under ``--output_dir/records`` (copied to ``--records_dir``, the committed folder), skipped
by a rerun; an interrupted run resumes from its last checkpoint, so the study spreads over sittings. Seeds 31-33 are
reserved for an independent held-out evaluation and refused without ``--held_out``.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from untie_recipes.common import parse
from untie_recipes.tasks.decision_map.corpus import BLOCK, SOURCES, VOCAB_SIZE, default_cache_dir, load_corpus
from untie_recipes.tasks.study.protocol import CELLS, DEVELOPMENT_SEEDS, check_seeds
from untie_recipes.tasks.study.provenance import check_pin, corpus_pin, machine_facts
from untie_recipes.tasks.study.report import load_records, write_report
from untie_recipes.tasks.study.runs import StudyContext, cell_plan, run_seed
from untie_recipes.tasks.study.sweep import run_sweep

REPO = Path(__file__).resolve().parents[1]
#: The committed pin of the corpus the CPU tier's tables come from, and the committed records.
CORPUS_PIN = REPO / "docs" / "data" / "study" / "corpus.json"
RECORDS_DIR = REPO / "docs" / "data" / "study" / "records"


@dataclass
class StudyArguments:
    cells: list[str] = field(default_factory=lambda: list(CELLS), metadata={"help": f"among {sorted(CELLS)}"})
    seeds: list[int] = field(default_factory=lambda: list(DEVELOPMENT_SEEDS), metadata={"help": "development seeds"})
    sweep_seed: int = field(default=DEVELOPMENT_SEEDS[0], metadata={"help": "the LR sweep's development seed"})
    held_out: bool = field(default=False, metadata={"help": "allow the reserved held-out seeds (their evaluation)"})
    batch_size: int = field(default=8, metadata={"help": f"blocks of {BLOCK} tokens per optimizer step"})
    warmup: int = field(default=100, metadata={"help": "linear warm-up steps (then constant, then the cooldown)"})
    curve_points: int = field(default=20, metadata={"help": "validation evaluations per run (the curve)"})
    curve_blocks: int = field(default=512, metadata={"help": "validation blocks the curve reads (the final: all)"})
    resume_every: int = field(default=250, metadata={"help": "steps between resume checkpoints"})
    max_extensions: int = field(default=1, metadata={"help": "LR values a sweep may add beyond an edge"})
    threads: int = field(default=1, metadata={"help": "torch threads (1: the same numbers at any load)"})
    vocab_size: int = field(default=VOCAB_SIZE, metadata={"help": "the corpus's BPE vocabulary"})
    output_dir: str = field(default="runs/study", metadata={"help": "records, checkpoints, results"})
    records_dir: str = field(default=str(RECORDS_DIR), metadata={"help": "finished records are copied here; '' off"})
    corpus_pin: str = field(default=str(CORPUS_PIN), metadata={"help": "the committed corpus pin (written once)"})
    repin: bool = field(default=False, metadata={"help": "accept a corpus whose blocks differ from the pin"})
    cache_dir: str | None = field(default=None, metadata={"help": "corpus cache (default $UNTIE_CACHE or ~/.cache)"})
    report_only: bool = field(default=False, metadata={"help": "write the report from the finished runs only"})
    plan: bool = field(default=False, metadata={"help": "print the cells' sizes, budgets and branch steps, then exit"})
    disable_tqdm: bool = field(default=False, metadata={"help": "no progress line"})

    def resolve(self) -> None:
        unknown = sorted(set(self.cells) - set(CELLS))
        if unknown:
            raise SystemExit(f"--cells {unknown}: choose among {sorted(CELLS)}.")
        for cell in self.cells:
            check_seeds(cell, (*self.seeds, self.sweep_seed), self.held_out)


def check_same_settings(output_dir: Path, args: StudyArguments, digest: str) -> None:
    """Refuse an output_dir whose runs used other settings: records are named by cell, arm, seed and LR only."""
    wanted = {"vocab_size": args.vocab_size, "batch_size": args.batch_size, "warmup": args.warmup, "block": BLOCK,
              "curve_points": args.curve_points, "curve_blocks": args.curve_blocks,
              "corpus_digest": digest}  # fmt: skip
    path = output_dir / "study.json"
    if path.exists():
        found = json.loads(path.read_text())
        if found != wanted:
            raise SystemExit(f"{output_dir} holds a study of {found}; this one is {wanted}: pass another --output_dir.")
        return
    output_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(wanted, indent=2) + "\n")


def run_study(ctx: StudyContext, args: StudyArguments) -> None:
    """Each cell: its LR sweep, then every arm of each seed; one progress line for the whole job."""
    plans = {cell: cell_plan(cell, ctx.vocab, args.batch_size) for cell in args.cells}
    for cell, plan in plans.items():
        if plan["budget_steps"] * args.batch_size > len(ctx.corpus.train):
            raise SystemExit(
                f"cell {cell}: {plan['budget_steps']} steps of {args.batch_size} blocks need more than the corpus's "
                f"{len(ctx.corpus.train)} training blocks: an arm would see tokens twice."
            )
    total = sum(p["sweep_steps"] + p["steps_per_seed"] * len(args.seeds) for p in plans.values())
    bar = tqdm(total=total, desc="Study", unit="step", disable=args.disable_tqdm, dynamic_ncols=True, mininterval=10)

    def progress(steps: int, loss: float) -> None:
        bar.update(steps)
        if loss == loss:
            bar.set_postfix_str(f"loss {loss:.3f}", refresh=False)

    def extend(steps: int) -> None:
        bar.total += steps

    for cell in args.cells:
        budget = plans[cell]["budget_steps"]
        bar.set_description(f"Study {cell} sweep")
        sweep = run_sweep(ctx, cell, args.sweep_seed, budget, progress, args.max_extensions, extend)
        for arm, summary in sweep.items():
            logging.info("study: cell %s, %s: LR %g (%s)", cell, arm, summary.best, summary.note())
        lrs = {arm: summary.best for arm, summary in sweep.items()}
        for seed in args.seeds:
            bar.set_description(f"Study {cell} seed {seed}")
            run_seed(ctx, cell, seed, lrs, budget, progress)
    bar.close()


def main(argv: list[str] | None = None) -> dict:
    (args,), _explicit = parse((StudyArguments,), argv)
    args.resolve()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    torch.set_num_threads(args.threads)
    output_dir = Path(args.output_dir)
    if args.report_only:
        results = write_report(output_dir, load_records(output_dir / "records"))
        print((output_dir / "results.md").read_text())
        return results
    cache_dir = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    corpus = load_corpus(SOURCES, cache_dir, args.vocab_size)
    if args.plan:
        plans = {cell: cell_plan(cell, len(corpus.tokenizer), args.batch_size) for cell in args.cells}
        print(json.dumps(plans, indent=2))
        return plans
    pin = corpus_pin(corpus, cache_dir, args.vocab_size)
    check_pin(pin, Path(args.corpus_pin), args.repin)
    check_same_settings(output_dir, args, pin["blocks_sha256"])
    ctx = StudyContext(corpus, output_dir, machine_facts(torch.device("cpu"), REPO), pin["blocks_sha256"],
                       batch_size=args.batch_size, warmup=args.warmup, curve_points=args.curve_points,
                       curve_blocks=args.curve_blocks, resume_every=args.resume_every,
                       records_dir=Path(args.records_dir) if args.records_dir else None)  # fmt: skip
    run_study(ctx, args)
    results = write_report(output_dir, load_records(output_dir / "records"))
    print((output_dir / "results.md").read_text())
    return results


if __name__ == "__main__":
    main()
