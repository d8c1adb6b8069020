"""Worker for test_bookcorpus_recipe.py: the recipe's scheduled arm under `torchrun --nproc_per_node 2` (`ARGV`, a
small model); each rank dumps its untie step, final parameters and the losses the arm recorded."""

from __future__ import annotations

import os
import sys

import torch
import transformers as tf
import worker_exit

from untie_recipes.tasks.bookcorpus.setup import resolve
from untie_recipes.tasks.bookcorpus.training import prepare_data, train_arm

#: The arm both the 2-process run and the test's 1-process comparison train; the batch size is per process.
ARGV = ["--arms", "scheduled", "--max_steps", "8", "--untie_at", "4", "--eval_steps", "4", "--max_train_samples", "256",
        "--max_eval_samples", "32", "--hidden_size", "32", "--intermediate_size", "64", "--num_hidden_layers", "1",
        "--max_length", "32", "--logging_steps", "4", "--disable_tqdm"]  # fmt: skip


def main(out_dir: str) -> None:
    tf.logging.set_verbosity_error()
    setup = resolve(["--output_dir", out_dir, "--batch_size", "8", *ARGV])
    record, trainer = train_arm("scheduled", setup, prepare_data(setup))
    model = trainer.model
    torch.save(
        {
            "distributed_type": str(trainer.accelerator.distributed_type).split(".")[-1],
            "untie_step": record["untie_step"],
            "tied": model.get_input_embeddings().weight is model.get_output_embeddings().weight,
            "input": model.get_input_embeddings().weight.detach().clone(),
            "output": model.get_output_embeddings().weight.detach().clone(),
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "eval_loss": [e["loss"] for e in record["history"]["eval"]],
            "train_loss": [e["loss"] for e in record["history"]["train"]],
        },
        os.path.join(out_dir, f"rank{trainer.args.process_index}.pt"),
    )


if __name__ == "__main__":
    worker_exit.start()
    main(sys.argv[1])
    worker_exit.finish()
