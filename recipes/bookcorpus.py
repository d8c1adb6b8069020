"""BookCorpus (Bertolotti & Cazzola, ICML 2024, as in the authors' code) with Trainer + UntieCallback, every arm.

    python recipes/bookcorpus.py                              # quick preset, offline: all arms (10-11 min, 2 cores)
    python recipes/bookcorpus.py --arms scheduled             # one arm; the report covers every finished arm
    accelerate launch recipes/bookcorpus.py --preset paper --arms tied  # the paper's run on BookCorpus, 1..N GPUs
    python recipes/bookcorpus.py --report_only                # rebuild the table and figures from finished arms

The paper's masked LM (3 layers, 4 heads, d 128, no positional encoding) learns a corpus in which each of the
100 most common words has a *twin* token drawn in its place on every read. Twins drawn .5/.5 satisfy the
distributional hypothesis; `--twins mixed` (the quick preset) skews every other twin .1/.9, which breaks it. Each
arm records, at every evaluation, the masked-token accuracy and perplexity and the mean Euclidean distance between
word and twin (and between random pairs of different words, the far baseline) in the input and the output space.
`--objective clm` runs the same comparison with a GPT-2 of the same size; its quick preset is shorter
(`OBJECTIVE_PRESETS`: 400 steps of batch 16).

Writes `<output_dir>/arms/<arm>.json` per arm, then `results.json`, `results.md` and `figures/*.png` over every
finished arm in `<output_dir>`. Arms already finished are reused unless `--overwrite`.
The command line takes the recipe's flags (`untie_recipes.tasks.bookcorpus.setup.BookCorpusArguments`), every untie
setting (`--untie_at`, `--metrics_every`, ...) and every Trainer flag (`--learning_rate`, `--seed`, `--bf16`,
`--report_to wandb`, ...); a preset fills what it does not set. The task lives in `untie_recipes.tasks.bookcorpus`: its
data and models, `setup` (the settings), `training` (the arms) and `report`.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from untie_recipes.progress import JobProgress
from untie_recipes.tasks.bookcorpus.report import report
from untie_recipes.tasks.bookcorpus.setup import resolve
from untie_recipes.tasks.bookcorpus.training import launch_rank, prepare_data, train_arm


def main(argv: list[str] | None = None) -> dict:
    """Train the arms not finished yet and report on every finished arm; returns the results (rank 0; others: {})."""
    setup = resolve(argv)
    os.makedirs(setup.output_dir, exist_ok=True)
    args = setup.args
    if args.threads < 0:
        raise ValueError(f"--threads {args.threads}: pass 1 or more, or 0 for torch's default (one per core).")
    if not args.report_only:
        todo = [a for a in args.arms if args.overwrite or not Path(setup.output_dir, "arms", f"{a}.json").exists()]
        if todo:
            train_arms(todo, setup)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return report(setup.output_dir) if launch_rank() == 0 else {}


def train_arms(arms: list[str], setup) -> None:
    """Train `arms` one after another with `--threads` CPU threads, put back after (a caller keeps its own)."""
    threads = torch.get_num_threads()
    if setup.args.threads:
        torch.set_num_threads(setup.args.threads)
    data = prepare_data(setup)
    progress = None
    if not setup.training.disable_tqdm:  # one line for every arm; its length: the first arm's max_steps
        progress = JobProgress(len(arms), None, description="BookCorpus", disable=launch_rank() != 0)
    try:
        for arm in arms:
            train_arm(arm, setup, data, progress)
    finally:
        torch.set_num_threads(threads)
        if progress:
            progress.close()


if __name__ == "__main__":
    main()
