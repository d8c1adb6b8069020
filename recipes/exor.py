"""EXor (Bertolotti & Cazzola, ICML 2024, as in the authors' code) with Trainer + UntieCallback, plus tie-then-untie.

    python recipes/exor.py                        # quick preset: main variant, Transformer, one seed (7 min, 2 cores)
    python recipes/exor.py --preset paper         # the paper's setup: 150k full-batch steps, 5 seeds, all variants
    accelerate launch recipes/exor.py --preset paper   # runs one after another, each on all processes

Each run (variant x model x arm x seed) trains with Trainer, records the Euclidean distances between the rows of
the input and the output tables for the pairs (0,1), (2,3) and the reference pair (0,2), and the masked-bit
accuracy on the training strings and on the 12 held-out strings. The recipe writes `results.json`, `results.md`,
PNG figures and `runs/<run>.json` (full histories) to `--output_dir`, then checks the paper's claims and prints
where they stand. Finished runs found in `--output_dir/runs` are reused; pass `--overwrite` to train them again.

The command line takes the recipe's flags (`untie_recipes.tasks.exor.setup.ExorArguments`), every untie setting
(`--untie_at`, `--untie_when evidence`, `--metrics_every`, ...) and every Trainer flag (`--learning_rate`,
`--report_to wandb`, ...); a preset fills what it does not set. The task lives in `untie_recipes.tasks.exor`: its
data and models, `setup` (the settings), `training` (the runs), `claims` and `report`.
"""

from __future__ import annotations

import os
import sys

import torch

from untie_recipes.kernels import portable_environment, requested_kernels
from untie_recipes.tasks.exor.report import report
from untie_recipes.tasks.exor.setup import resolve
from untie_recipes.tasks.exor.training import launch_rank, run_grid


def main(argv: list[str] | None = None) -> list[dict]:
    """Train the grid's missing runs and report on it; returns the claims (rank 0; other ranks: [])."""
    # Set before this process computes anything (a rank of a launch trains in it) and inherited by the runs' workers.
    with portable_environment(requested_kernels(sys.argv[1:] if argv is None else argv)):
        setup = resolve(argv)
        os.makedirs(setup.output_dir, exist_ok=True)
        records = run_grid(setup)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()  # every rank finished; rank 0 has written every record
        torch.distributed.destroy_process_group()
    return report(records, setup.output_dir, setup.rule) if launch_rank() == 0 else []


if __name__ == "__main__":
    main()
