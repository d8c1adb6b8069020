"""Where does a tied phase pay? The tie-then-untie study of issue 68: Llama-style decoders on the decision map's
corpus (shakespeare + kjv + debian-docs, blocks of 128 tokens), an LR sweep per cell, eight arms, three development
seeds. The protocol and the rule that turns its tables into the default: docs/recipes/study.md.

    python recipes/study.py --plan                  # the cells' sizes, budgets and branch steps; runs nothing
    python recipes/study.py                         # the CPU tier: cells A then B (8,192 vocabulary, one thread)
    python recipes/study.py --cells A --seeds 1     # a part of it
    python recipes/study.py --cells B --rates tied  # the tied sweep, run and branches; beside it, on another core,
    python recipes/study.py --cells B --rates untied  # the untied sweep and arms (the same --output_dir)
    python recipes/study.py --report_only           # results.json and results.md from the finished runs
    python recipes/study.py --cells A --finetune_here  # cell A's fine-tuning table on this CPU kind's own tied runs
    python recipes/study.py --cells B --round_two --rates untied  # round two: the embedding-scale sweep and arm
    python recipes/study.py --cells B --round_two --rates tied    # round two: the branch at 0.9
    python recipes/study.py --preset share --plan                # round two's cell C (a 2,048-token vocabulary)
    python recipes/study.py --preset share --rates tied  &  python recipes/study.py --preset share --rates untied
    python recipes/study.py --preset device --export_corpus runs/corpus-vocab32768   # build and export its corpus
    python recipes/study.py --preset device --corpus_dir runs/corpus-vocab32768      # the device tier, one call
    python recipes/study.py --preset ladder --cells L4k --export_corpus runs/ladder  # the share ladder's text and
    python recipes/study_ladder.py --corpus_dir runs/ladder                          # 4k tokenizer; then its call

Finished runs are records under ``--output_dir/records`` (copied to ``--records_dir``, the committed folder, and
read back from it at the start, so a fresh machine skips them), skipped by a rerun; an interrupted run resumes from
its last checkpoint, so the study spreads over sittings. The device tier (``--preset device``: cells of 64 x 2, 128 x
4 and 256 x 8 at 4 and 10 tokens per parameter, a 32,768 vocabulary, batches of 32 blocks, one CUDA device) stops
each call cleanly at ``--time_limit`` seconds and the next call continues. Seeds 31-33 are reserved for an
independent held-out evaluation and refused without ``--held_out``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from untie_recipes.common import parse
from untie_recipes.tasks.decision_map.corpus import (
    BLOCK,
    SOURCES,
    TokenizedCorpus,
    default_cache_dir,
    documents,
    load_corpus,
)
from untie_recipes.tasks.study import training
from untie_recipes.tasks.study.corpus_files import (
    LADDER_TEXT,
    export_corpus,
    export_ladder,
    load_exported,
    load_ladder,
)
from untie_recipes.tasks.study.finetune import (
    ALL_FINETUNE_ARMS,
    FINETUNE_CELLS,
    FINETUNE_STEPS,
    KINDS,
    load_finetune_records,
    load_kinds_finetune_records,
    run_finetune,
)
from untie_recipes.tasks.study.protocol import (
    ARMS,
    CELL_VOCABS,
    CELLS,
    CPU_CELLS,
    DEVELOPMENT_SEEDS,
    DEVICE_CELLS,
    LADDER_CELLS,
    SCALE_SWEEP,
    SHARE_CELLS,
    arm_spec,
    best_value,
    check_seeds,
    half_budget,
    scaled_arm,
    untie_step,
)
from untie_recipes.tasks.study.provenance import (
    blocks_digest,
    check_pin,
    corpus_pin,
    kind_folder,
    machine_facts,
    repeat_refusal,
)
from untie_recipes.tasks.study.report import load_records, write_report
from untie_recipes.tasks.study.runs import (
    StudyContext,
    cell_plan,
    finished,
    retrain_tied,
    run_or_reuse,
    run_seed,
    seed_specs,
)
from untie_recipes.tasks.study.sweep import PLAIN, run_scale_sweep, run_sweep, scale_choice
from untie_recipes.tasks.study.target import fetch_target_documents, target_corpus

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "docs" / "data" / "study"
#: Preset -> defaults (flags given on the command line win). "cpu": the CPU tier; "device": the device tier, whose
#: batches are 4 times larger (32 blocks of 128 tokens: a GPU step of 8 blocks is mostly overhead).
PRESETS = {
    "cpu": {"cells": list(CPU_CELLS), "vocab_size": 8192, "batch_size": 8, "device": "cpu", "time_limit": 0.0,
            "output_dir": "runs/study", "records_dir": str(DATA / "records"), "corpus_pin": str(DATA / "corpus.json"),
            "allow_repeats": False, "finetune": True, "finetune_pin": str(DATA / "finetune-target.json")},
    "share": {"cells": list(SHARE_CELLS), "vocab_size": CELL_VOCABS["C"], "batch_size": 8, "device": "cpu",
              "time_limit": 0.0, "output_dir": "runs/study-share", "records_dir": str(DATA / "records"),
              "corpus_pin": str(DATA / f"corpus-vocab{CELL_VOCABS['C']}.json"), "allow_repeats": False,
              "finetune": True, "finetune_pin": str(DATA / f"finetune-target-vocab{CELL_VOCABS['C']}.json")},
    "device": {"cells": list(DEVICE_CELLS), "vocab_size": 32768, "batch_size": 32, "device": "cuda",
               "time_limit": 450.0, "output_dir": "runs/study-device", "records_dir": str(DATA / "device" / "records"),
               "corpus_pin": str(DATA / "corpus-vocab32768.json"), "allow_repeats": True, "finetune": False},
    # The share ladder (issue 77, item 6): one cell per process (its vocabulary, its pin, its folder), started in
    # parallel by recipes/study_ladder.py; `resolve` fills in the cell's vocabulary, pin and output folder.
    "ladder": {"cells": list(LADDER_CELLS), "batch_size": 32, "device": "cuda", "time_limit": 450.0,
               "allow_repeats": True, "finetune": False, "output_dir": "runs/study-ladder/report",
               "records_dir": str(DATA / "ladder" / "records")},
}  # fmt: skip


@dataclass
class StudyArguments:
    preset: str = field(default="cpu", metadata={"help": f"one of {sorted(PRESETS)}; flags override its values"})
    cells: list[str] | None = field(default=None, metadata={"help": f"among {sorted(CELLS)}"})
    seeds: list[int] = field(default_factory=lambda: list(DEVELOPMENT_SEEDS), metadata={"help": "development seeds"})
    sweep_seed: int = field(default=DEVELOPMENT_SEEDS[0], metadata={"help": "the LR sweep's development seed"})
    rates: list[str] = field(
        default_factory=lambda: list(PLAIN),
        metadata={"help": "the swept rates this process runs: their sweeps, then the arms at them (tied: the tied run, "
                          "its branches, the fine-tuning; untied: the arms untied at step 0); one each: two processes"},
    )  # fmt: skip
    held_out: bool = field(default=False, metadata={"help": "allow the reserved held-out seeds (their evaluation)"})
    batch_size: int | None = field(default=None, metadata={"help": f"blocks of {BLOCK} tokens per optimizer step"})
    warmup: int = field(default=100, metadata={"help": "linear warm-up steps (then constant, then the cooldown)"})
    curve_points: int = field(default=20, metadata={"help": "validation evaluations per run (the curve)"})
    curve_blocks: int = field(default=512, metadata={"help": "validation blocks the curve reads (the final: all)"})
    resume_every: int = field(default=250, metadata={"help": "steps between resume checkpoints"})
    max_extensions: int = field(default=1, metadata={"help": "LR values a sweep may add beyond an edge"})
    threads: int = field(default=1, metadata={"help": "torch threads (1: the same numbers at any load)"})
    vocab_size: int | None = field(default=None, metadata={"help": "the corpus's BPE vocabulary"})
    device: str | None = field(default=None, metadata={"help": "cpu, or cuda (one device)"})
    time_limit: float | None = field(default=None, metadata={"help": "seconds of training per call (0: none)"})
    allow_repeats: bool | None = field(default=None, metadata={"help": "let a budget read the blocks again"})
    output_dir: str | None = field(default=None, metadata={"help": "records, checkpoints, results"})
    records_dir: str | None = field(default=None, metadata={"help": "finished records are copied here; '' off"})
    corpus_pin: str | None = field(default=None, metadata={"help": "the committed corpus pin (written once)"})
    repin: bool = field(default=False, metadata={"help": "accept a corpus or fine-tuning target unlike its pin"})
    finetune: bool | None = field(
        default=None, metadata={"help": f"fine-tune cells {list(FINETUNE_CELLS)}' tied checkpoints"}
    )
    finetune_here: bool = field(
        default=False,
        metadata={"help": "a fine-tuning table of this machine's CPU kind: each seed's tied run trained here at the "
                          "study's swept rate, then every fine-tuning arm, all under kinds/<kind>/ (no branches, no "
                          "other arm); for cells whose tied runs were recorded on another kind"},
    )  # fmt: skip
    finetune_pin: str | None = field(
        default=None,
        metadata={"help": "the committed pin of the fine-tuning's target (one per vocabulary; default: the preset's)"},
    )
    cache_dir: str | None = field(default=None, metadata={"help": "corpus cache (default $UNTIE_CACHE or ~/.cache)"})
    corpus_dir: str | None = field(default=None, metadata={"help": "an exported corpus folder (no cache, no fetch)"})
    export_corpus: str | None = field(default=None, metadata={"help": "write the corpus to this folder and exit"})
    report_only: bool = field(default=False, metadata={"help": "write the report from the finished runs only"})
    round_two: bool = field(default=False, metadata={"help": "round two (issue 77): the embedding-scale sweep and "
                                                              "arm, and the cells' round-two branches"})  # fmt: skip
    plan: bool = field(default=False, metadata={"help": "print the cells' sizes, budgets and branch steps, then exit"})
    disable_tqdm: bool = field(default=False, metadata={"help": "no progress line"})

    def resolve(self) -> None:
        if self.preset not in PRESETS:
            raise SystemExit(f"--preset {self.preset!r}: choose one of {sorted(PRESETS)}.")
        if self.preset == "ladder" and not self.report_only:
            if not self.cells or len(self.cells) != 1 or self.cells[0] not in LADDER_CELLS:
                raise SystemExit(
                    f"--preset ladder runs one cell of {list(LADDER_CELLS)} per process (its own vocabulary and "
                    "folder): pass --cells with one of them, or start them all with recipes/study_ladder.py."
                )
            vocab = CELL_VOCABS[self.cells[0]]
            self.vocab_size = self.vocab_size or vocab
            self.corpus_pin = self.corpus_pin or str(DATA / f"corpus-vocab{vocab}.json")
            self.output_dir = self.output_dir or f"runs/study-ladder/{self.cells[0]}"
        for key, value in PRESETS[self.preset].items():
            if getattr(self, key) is None:
                setattr(self, key, value)
        unknown = sorted(set(self.cells) - set(CELLS))
        if unknown:
            raise SystemExit(f"--cells {unknown}: choose among {sorted(CELLS)}.")
        for cell in self.cells:
            check_seeds(cell, (*self.seeds, self.sweep_seed), self.held_out)
        if not self.rates or not set(self.rates) <= set(PLAIN):
            raise SystemExit(f"--rates {self.rates}: choose one or both of {list(PLAIN)}.")
        if self.finetune_here and not self.report_only:
            if not set(self.cells) <= set(FINETUNE_CELLS) or "tied" not in self.rates or not self.finetune:
                raise SystemExit(
                    f"--finetune_here fine-tunes the tied runs of cells {list(FINETUNE_CELLS)}: pass --cells among "
                    "them, --rates tied (or both) and leave --finetune on."
                )
            if self.round_two:
                raise SystemExit("--finetune_here runs no branch: drop --round_two (it adds branches).")


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


def run_study(ctx: StudyContext, args: StudyArguments, target: TokenizedCorpus | None = None) -> None:
    """Each cell: its LR sweep, then every arm of each seed, then (cell A, with a `target`) each seed's fine-tuning,
    for the swept rates of `--rates` (both by default); one progress line for the whole job."""
    plans = {cell: cell_plan(cell, ctx.vocab, args.batch_size) for cell in args.cells}
    for cell, plan in plans.items():
        if plan["budget_steps"] * args.batch_size > len(ctx.corpus.train) and not args.allow_repeats:
            raise SystemExit(
                f"cell {cell}: {plan['budget_steps']} steps of {args.batch_size} blocks need more than the corpus's "
                f"{len(ctx.corpus.train)} training blocks: an arm would see tokens twice (--allow_repeats allows it)."
            )
    rates = tuple(rate for rate in PLAIN if rate in args.rates)
    total = sum(p["sweep_steps"] * len(rates) // len(PLAIN) + len(args.seeds) * sum(
                    p["budget_steps"] - p["branch_steps"].get(arm, 0) for arm in p["arms"]
                    if arm_spec(arm).plain in rates)
                for p in plans.values())  # fmt: skip
    if "tied" not in rates:
        target = None  # the fine-tuning starts from the tied run's checkpoint: the tied process runs it
    if target is not None:
        total += FINETUNE_STEPS * len(ALL_FINETUNE_ARMS) * len(args.seeds) * len(set(FINETUNE_CELLS) & set(plans))
    bar = tqdm(total=total, desc="Study", unit="step", disable=args.disable_tqdm, dynamic_ncols=True, mininterval=10)

    def progress(steps: int, loss: float) -> None:
        bar.update(steps)
        if loss == loss:
            bar.set_postfix_str(f"loss {loss:.3f}", refresh=False)

    def extend(steps: int) -> None:
        bar.total += steps

    if args.finetune_here:
        per_seed = {cell: p["budget_steps"] + FINETUNE_STEPS * len(ALL_FINETUNE_ARMS) for cell, p in plans.items()}
        bar.total = sum(p["sweep_steps"] // len(PLAIN) + len(args.seeds) * per_seed[c] for c, p in plans.items())
    try:
        for cell in args.cells:
            budget = plans[cell]["budget_steps"]
            if args.finetune_here:
                finetune_here(ctx, args, cell, budget, target, bar, progress, extend)
                continue
            bar.set_description(f"Study {cell} sweep")
            sweep = run_sweep(ctx, cell, args.sweep_seed, budget, progress, args.max_extensions, extend, rates)
            for arm, summary in sweep.items():
                logging.info("study: cell %s, %s: LR %g (%s)", cell, arm, summary.best, summary.note())
            lrs = {arm: summary.best for arm, summary in sweep.items()}
            two = args.round_two or cell in SHARE_CELLS
            extra = round_two_arms(ctx, args, cell, budget, lrs, progress, extend) if two else ()
            for seed in args.seeds:
                bar.set_description(f"Study {cell} seed {seed}")
                records = run_seed(ctx, cell, seed, lrs, budget, progress, extra)
                if target is not None and cell in FINETUNE_CELLS:
                    bar.set_description(f"Study {cell} seed {seed} fine-tuning")
                    tied = next(s for s in seed_specs(ctx, cell, seed, lrs, budget) if s.arm == "tied")
                    retrain = functools.partial(retrain_tied, ctx, tied, progress)
                    run_finetune(ctx, target, seed, tied, records["tied"], retrain, progress)
    finally:
        bar.close()


def finetune_here(ctx: StudyContext, args: StudyArguments, cell: str, budget: int, target: TokenizedCorpus | None,
                  bar, progress, extend) -> None:  # fmt: skip
    """`--finetune_here`: the cell's fine-tuning table on this machine's CPU kind (docs/recipes/study.md, "A cell's
    fine-tuning on a kind of its own"). The tied rate is the study's sweep's (its committed records, reused); each
    seed's tied run is trained here under ``kinds/<kind>/`` of the records and checkpoints (its name is the study's
    tied run's, its record this kind's own, never pooled with the pretraining tables), then every fine-tuning arm from
    its final checkpoint. Float kernels differ between kinds: a tied checkpoint trained here is this kind's, and the
    arms pair only with each other."""
    if target is None:
        raise SystemExit("--finetune_here: no fine-tuning target (--finetune false, or no tied rate).")
    bar.set_description(f"Study {cell} sweep")
    sweep = run_sweep(ctx, cell, args.sweep_seed, budget, progress, args.max_extensions, extend, ("tied",))
    lrs = {"tied": sweep["tied"].best}
    here = dataclasses.replace(ctx, subfolder=f"{KINDS}/{kind_folder(ctx.machine)}")  # its committed records: imported
    for seed in args.seeds:
        tied = next(s for s in seed_specs(here, cell, seed, lrs, budget) if s.arm == "tied")
        own = finished(ctx, tied)  # the study's own tied run of the seed
        if own is not None and repeat_refusal(own.machine, ctx.machine, tied.name) is None:
            raise SystemExit(
                f"--finetune_here: {tied.name} was recorded on this machine's kind ({own.machine.get('cpu')}, "
                f"{own.machine.get('kernel_path')}, torch {own.machine.get('torch')}): its fine-tuning is the study's "
                f"own; run it without --finetune_here (python recipes/study.py --cells {cell} --rates tied)."
            )
        bar.set_description(f"Study {cell} seed {seed} tied, here")
        record = run_or_reuse(here, tied, progress)
        for path in here.checkpoint_path(tied, "step").parent.glob("step*.pt"):  # no branch reads them
            path.unlink()
        bar.set_description(f"Study {cell} seed {seed} fine-tuning, here")
        run_finetune(here, target, seed, tied, record, functools.partial(retrain_tied, here, tied, progress), progress)


def round_two_arms(ctx, args: StudyArguments, cell: str, budget: int, lrs: dict, progress, extend) -> tuple[str, ...]:
    """Round two's arms of `cell` (docs/recipes/study.md, "Round two"): its branches, and, in the process that runs
    the untied rate, the embedding-scale sweep (on the sweep seed, at half the budget) and the arm at its best k."""
    arms = CELLS[cell].round_two
    if CELLS[cell].scale_sweep and "untied" in lrs:
        extend(len(SCALE_SWEEP) * half_budget(budget))
        losses = run_scale_sweep(ctx, cell, args.sweep_seed, budget, lrs["untied"], progress, args.max_extensions,
                                 extend)  # fmt: skip
        best = best_value(losses)
        logging.info("study: cell %s, the embedding-scale sweep: %s; best k = %g", cell,
                     ", ".join(f"k={k:g}: {v:.4f}" for k, v in sorted(losses.items())), best)  # fmt: skip
        arms += (scaled_arm(best),) if best != 1.0 else ()
    elif "untied" in lrs:  # the other cells take the k cell B's sweep chose, once it has
        best = scale_choice(load_records(ctx.output_dir / "records"), args.max_extensions)
        if best is None:
            logging.info("study: cell %s waits for cell B's embedding-scale sweep for its untied-emb arm.", cell)
        elif best != 1.0:
            arms += (scaled_arm(best),)
    extend(len(args.seeds) * sum(budget - (untie_step(ARMS[a].fraction, budget) if a in ARMS and ARMS[a].fraction
                                           else 0) for a in arms))  # fmt: skip
    return arms


def load_target(args: StudyArguments, corpus: TokenizedCorpus) -> TokenizedCorpus | None:
    """The fine-tuning's target, cut with the corpus's tokenizer and checked against its pin (one per vocabulary);
    None where the job does not fine-tune (`--finetune false`, no cell of `FINETUNE_CELLS`, or only the untied rate:
    the tied process fine-tunes)."""
    if not args.finetune or not set(FINETUNE_CELLS) & set(args.cells) or "tied" not in args.rates:
        return None
    documents, facts = fetch_target_documents(Path(args.cache_dir) if args.cache_dir else default_cache_dir())
    target = target_corpus(documents, corpus.tokenizer)
    pin = {**facts, "train_blocks": len(target.train), "validation_blocks": len(target.validation),
           "blocks_sha256": blocks_digest(target)}  # fmt: skip
    check_pin(pin, Path(args.finetune_pin), args.repin)
    return target


def load(args: StudyArguments) -> tuple[TokenizedCorpus, dict]:
    """The corpus and its pin: from an exported folder (`--corpus_dir`), or built and cached."""
    if args.corpus_dir and (Path(args.corpus_dir) / LADDER_TEXT).exists():  # the ladder's text: cut here
        return load_ladder(Path(args.corpus_dir), args.vocab_size)
    if args.corpus_dir:
        return load_exported(Path(args.corpus_dir))
    cache_dir = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    corpus = load_corpus(SOURCES, cache_dir, args.vocab_size)
    return corpus, corpus_pin(corpus, cache_dir, args.vocab_size)


def on_device(corpus: TokenizedCorpus, device: torch.device) -> TokenizedCorpus:
    """The blocks on `device`; on CUDA, deterministic kernels and full float32 matmuls (a rerun repeats numbers)."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device here; --device cpu runs the same protocol on the CPU.")
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    return dataclasses.replace(corpus, train=corpus.train.to(device), validation=corpus.validation.to(device))


@contextlib.contextmanager
def rate_locks(output_dir: Path, rates: list[str]):
    """Hold one lock per swept rate in `output_dir` while the study runs: a second process given a rate already
    running there (the same command twice, or both rates beside `--rates untied`) is refused before it trains the
    same runs. The kernel releases the locks when the process ends, however it ends (Unix; elsewhere no lock)."""
    try:
        import fcntl
    except ImportError:  # Windows: no advisory locks; run one process per folder
        yield
        return
    with contextlib.ExitStack() as stack:
        for rate in sorted(set(rates)):
            handle = stack.enter_context(open(output_dir / f"running-{rate}.lock", "w"))
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise SystemExit(
                    f"{output_dir}: another process runs the {rate} rate's runs there; give this one the other rate "
                    f"(--rates), another --output_dir, or wait for it."
                ) from None
        yield


def import_records(records_dir: Path | None, folder: Path) -> None:
    """Copy the committed records that `folder` lacks into it: a fresh machine skips the runs finished elsewhere."""
    if records_dir is None or not records_dir.is_dir():
        return
    folder.mkdir(parents=True, exist_ok=True)
    for path in records_dir.rglob("*.json"):
        copy = folder / path.relative_to(records_dir)
        if not copy.exists():
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, copy)


def report(output_dir: Path) -> dict:
    records = output_dir / "records"
    results = write_report(output_dir, load_records(records), load_finetune_records(records / "finetune"),
                           load_kinds_finetune_records(records))  # fmt: skip
    print((output_dir / "results.md").read_text())
    return results


def main(argv: list[str] | None = None) -> dict:
    (args,), _explicit = parse((StudyArguments,), argv)
    args.resolve()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    torch.set_num_threads(args.threads)
    stop_at = training.CLOCK() + args.time_limit if args.time_limit else None
    output_dir = Path(args.output_dir)
    if args.report_only:
        import_records(Path(args.records_dir) if args.records_dir else None, output_dir / "records")
        return report(output_dir)
    corpus, pin = load(args)
    if args.export_corpus and args.preset == "ladder":  # the text once, this cell's tokenizer, its committed pin
        cache_dir = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
        export_ladder(lambda: documents(SOURCES, cache_dir), corpus, Path(args.export_corpus), pin, args.vocab_size)
        check_pin(pin, Path(args.corpus_pin), args.repin)
        return pin
    if args.export_corpus:
        export_corpus(corpus, Path(args.export_corpus), pin)
        return pin
    if args.plan:
        plans = {cell: cell_plan(cell, len(corpus.tokenizer), args.batch_size) for cell in args.cells}
        print(json.dumps(plans, indent=2))
        return plans
    check_pin(pin, Path(args.corpus_pin), args.repin)
    check_same_settings(output_dir, args, pin["blocks_sha256"])
    target = load_target(args, corpus)
    records_dir = Path(args.records_dir) if args.records_dir else None
    import_records(records_dir, output_dir / "records")
    device = torch.device(args.device)
    ctx = StudyContext(on_device(corpus, device), output_dir, machine_facts(device, REPO), pin["blocks_sha256"],
                       batch_size=args.batch_size, warmup=args.warmup, curve_points=args.curve_points,
                       curve_blocks=args.curve_blocks, resume_every=args.resume_every, records_dir=records_dir,
                       device=device, stop_at=stop_at)  # fmt: skip
    try:
        with rate_locks(output_dir, args.rates):
            run_study(ctx, args, target)
    except training.OutOfTime:
        logging.info("study: stopped at the time limit (%s s); the same command continues.", args.time_limit)
    return report(output_dir)


if __name__ == "__main__":
    main()
