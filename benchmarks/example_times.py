"""Wall time of every example, and of the quick-start job, with their default arguments, as a Markdown table.

python benchmarks/example_times.py [--only tie_then_untie.py pretrain_minimal.py] [--include_quick_start]

Each command runs in a fresh process in a temporary directory (its outputs go there), one after another, so the
times are those of a machine doing nothing else. The table names the machine (CPU count, torch build), because a
time means nothing without it; the docs quote this table next to the command.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers as tf

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.py"))
QUICK_START = ("python recipes/exor.py", [str(ROOT / "recipes" / "exor.py"), "--output_dir", "exor"])


@dataclass
class TimingArguments:
    only: list[str] | None = field(default=None, metadata={"help": "Time these examples only (file names)."})
    include_quick_start: bool = field(
        default=False, metadata={"help": "Also time the quick start's job (python recipes/exor.py)."}
    )


def machine() -> str:
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    return f"{os.cpu_count()} cores, {device}, torch {torch.__version__}, {platform.system()}"


def wall_time(argv: list[str]) -> float:
    with tempfile.TemporaryDirectory() as workdir:
        started = time.perf_counter()
        result = subprocess.run([sys.executable, *argv], cwd=workdir, capture_output=True, text=True)
        elapsed = time.perf_counter() - started
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{result.stderr[-3000:]}")
    return elapsed


def duration(seconds: float) -> str:
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s" if minutes else f"{seconds:.0f} s"


def main(argv: list[str] | None = None) -> str:
    (args,) = tf.HfArgumentParser(TimingArguments).parse_args_into_dataclasses(args=argv)
    names = args.only or EXAMPLES
    unknown = sorted(set(names) - set(EXAMPLES))
    if unknown:
        raise ValueError(f"No such example: {unknown}; the examples are {EXAMPLES}.")
    commands = [(f"python examples/{name}", [str(ROOT / "examples" / name)]) for name in names]
    if args.include_quick_start:
        commands.append(QUICK_START)
    rows = ["| command | wall time |", "|---|---|"]
    for shown, command in commands:
        seconds = wall_time(command)
        rows.append(f"| `{shown}` | {duration(seconds)} |")
        print(f"{shown}: {seconds:.1f} s", file=sys.stderr)
    table = "\n".join(rows) + f"\n\nMachine: {machine()}; `python benchmarks/example_times.py`, one command at a time."
    print(table)
    return table


if __name__ == "__main__":
    main()
