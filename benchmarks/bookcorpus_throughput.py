"""Training throughput of the BookCorpus recipe's arms on the offline corpus, as ratios to the tied arm.

Runs `recipes/bookcorpus.py --arms <arm>` for tied, untied, scheduled and auto, each in a fresh subprocess, `--repeats`
times in alternating order (a shared machine's speed drifts; alternating spreads the drift over the arms), and
reports each arm's median tokens/s (training steps only, from the recipe's ThroughputMeter) and its ratio to the
tied arm's median. tied and untied are plain Trainer; scheduled and auto add UntieCallback, so their ratios hold
the callback's cost plus, after the untie, the untied model's own (one more V x d matrix in AdamW), which the
untied arm's ratio shows on its own.

    python benchmarks/bookcorpus_throughput.py --max_steps 400 --repeats 2
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import transformers as tf

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "bookcorpus.py"
ARMS = ("tied", "untied", "scheduled", "auto")


@dataclass
class ThroughputArguments:
    max_steps: int = field(default=400, metadata={"help": "Optimizer steps per arm run."})
    repeats: int = field(default=2, metadata={"help": "Runs per arm, in alternating order; medians are reported."})
    output_dir: str = "runs/bench-bookcorpus"
    extra: str = field(default="", metadata={"help": "More recipe flags, e.g. '--objective clm'."})


def run_arm(arm: str, repeat: int, args: ThroughputArguments) -> float:
    out = os.path.join(args.output_dir, f"repeat{repeat}")
    cmd = [sys.executable, str(RECIPE), "--arms", arm, "--output_dir", out, "--overwrite", "--disable_tqdm",
           "--max_steps", str(args.max_steps), "--eval_steps", str(args.max_steps), *args.extra.split()]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(Path(out, "arms", f"{arm}.json").read_text())["tokens_per_second"]


def main(argv: list[str] | None = None) -> dict:
    (args,) = tf.HfArgumentParser(ThroughputArguments).parse_args_into_dataclasses(args=argv)
    measured: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for repeat in range(args.repeats):
        order = ARMS if repeat % 2 == 0 else tuple(reversed(ARMS))
        for arm in order:
            measured[arm].append(run_arm(arm, repeat, args))
            print(f"repeat {repeat} {arm}: {measured[arm][-1]:.0f} tokens/s", flush=True)
    medians = {arm: statistics.median(values) for arm, values in measured.items()}
    results = {
        "max_steps": args.max_steps,
        "repeats": args.repeats,
        "tokens_per_second": measured,
        "median_tokens_per_second": medians,
        "ratio_to_tied": {arm: medians[arm] / medians["tied"] for arm in ARMS},
    }
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    Path(args.output_dir, "results.json").write_text(json.dumps(results, indent=2))
    print("| arm | median tokens/s | ratio to tied |\n|---|---|---|")
    for arm in ARMS:
        print(f"| {arm} | {medians[arm]:.0f} | {results['ratio_to_tied'][arm]:.3f} |")
    return results


if __name__ == "__main__":
    main()
