"""What the Trainer benchmarks share: a step timer, random tokens, CPU training arguments, and alternating arms."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import transformers as tf


class StepTimer(tf.TrainerCallback):
    """Wall time of every optimizer step, from on_step_begin to on_step_end."""

    def __init__(self) -> None:
        self.durations: dict[int, float] = {}
        self._start = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.durations[state.global_step] = time.perf_counter() - self._start


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int, length: int, vocab: int) -> None:
        self.ids = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def benchmark_training_arguments(output_dir: str, steps: int, batch_size: int) -> tf.TrainingArguments:
    """Trainer settings of one timed arm: no checkpoints, no reporting, one log at the end."""
    return tf.TrainingArguments(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=batch_size,
        learning_rate=1e-4,
        logging_steps=steps,
        save_strategy="no",
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


def run_arms_alternating(script: str, arms: Sequence[str], repeats: int, describe: Callable[[dict], str]) -> list[dict]:
    """Run `script --arm <arm>` in a fresh process per arm, arms alternating `repeats` times, so that slow drifts of
    the machine hit every arm; each run prints one ``RESULT <json>`` line, returned in order."""
    runs: list[dict] = []
    for repeat in range(repeats):
        for arm in arms:
            command = [sys.executable, script, *sys.argv[1:], "--arm", arm]
            runs.append(run_worker(command))
            print(f"{arm} #{repeat}: {describe(runs[-1])}")
    return runs


def arm_or_arms(
    arguments: type, run_arm: Callable[[Any], dict], arms: Sequence[str], describe: Callable[[dict], str]
) -> tuple[Any, list[dict] | None]:
    """A benchmark's entry: parse `arguments`; with ``--arm`` run that one arm here and print its ``RESULT`` line
    (returns None for the runs); else run every arm in a fresh process, alternating (`run_arms_alternating`)."""
    (args,) = tf.HfArgumentParser(arguments).parse_args_into_dataclasses()
    if args.arm:
        print("RESULT " + json.dumps(run_arm(args)))
        return args, None
    return args, run_arms_alternating(sys.argv[0], arms, args.repeats, describe)


def machine() -> str:
    """The machine a figure was measured on, as the tables name it."""
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    return f"{os.cpu_count()} cores, CPU, torch {torch.__version__}"


def write_results(output_dir: str, results: object, table: str) -> None:
    """Write `results.json` and the Markdown `results.md` into `output_dir`, and print the table."""
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, "results.json"), "w") as handle:
        json.dump(results, handle, indent=2)
    with open(os.path.join(output_dir, "results.md"), "w") as handle:
        handle.write(table + "\n")
    print(table)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(script: str, ranks: int, *args: str) -> dict:
    """Run `script args` under `torch.distributed.run` on `ranks` processes (this interpreter); the JSON of the
    ``RESULT`` line its rank 0 prints (`print_result`)."""
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}"]
    return run_worker([*command, f"--master_port={free_port()}", script, *args])


def print_result(result: dict | None) -> None:
    """A worker's result, as `run_worker` reads it (ranks other than 0 pass None and print nothing)."""
    if result is not None:
        print("RESULT " + json.dumps(result), flush=True)


def run_worker(command: list[str]) -> dict:
    """Run a benchmark's worker process and return the JSON of its ``RESULT`` line."""
    output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(next(line for line in output.splitlines() if line.startswith("RESULT "))[7:])
