"""What the default's freshness evidence costs at attach (`untie.structure.policy.weights_evidence`), on one thread,
at the embedding shapes of today's large-vocabulary models, beside one copy of the same embedding (what an untie
costs at least). Every rank reads it once per attach.

    python benchmarks/freshness_cost.py --shapes 32768x2048 262144x2304 128256x4096 --output_dir runs/bench-freshness
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import transformers as tf
from common import machine, write_results

from untie.structure.policy import weights_evidence


@dataclass
class Arguments:
    shapes: list[str] = field(
        default_factory=lambda: ["32768x2048", "262144x2304", "128256x4096"], metadata={"help": "rows x width"}
    )
    dtype: str = field(default="bfloat16", metadata={"help": "the embedding's dtype (bfloat16: as checkpoints ship)"})
    repeats: int = field(default=3, metadata={"help": "timed reads per shape (the best is reported)"})
    output_dir: str = "runs/bench-freshness"


def measure(rows: int, width: int, args: Arguments) -> dict:
    """The best of `repeats` evidence reads and of as many copies of a (rows, width) embedding drawn as a Llama's."""
    model = tf.LlamaForCausalLM(
        tf.LlamaConfig(vocab_size=8, hidden_size=width, intermediate_size=8, num_hidden_layers=0, num_attention_heads=1)
    )  # the initialiser the evidence compares with (std 0.02); the embedding itself is passed in
    embedding = torch.empty(rows, width, dtype=getattr(torch, args.dtype)).normal_(0.0, 0.02)
    reads, copies, verdict = [], [], ""
    for _ in range(args.repeats):
        started = time.perf_counter()
        verdict = weights_evidence(model, embedding).verdict
        reads.append(time.perf_counter() - started)
        started = time.perf_counter()
        embedding.clone()
        copies.append(time.perf_counter() - started)
    return {"shape": f"{rows}x{width}", "verdict": verdict, "evidence_seconds": min(reads), "copy_seconds": min(copies)}


def main() -> None:
    (args,) = tf.HfArgumentParser(Arguments).parse_args_into_dataclasses()
    torch.set_num_threads(1)
    rows = [measure(*(int(part) for part in shape.split("x")), args) for shape in args.shapes]
    lines = [
        f"Freshness evidence at attach on {machine()}, one thread, {args.dtype} embeddings drawn as a Llama's "
        f"(best of {args.repeats}).",
        "",
        "| rows x width | verdict | evidence (s) | one copy of the embedding (s) |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {r['shape']} | {r['verdict']} | {r['evidence_seconds']:.3f} | {r['copy_seconds']:.3f} |" for r in rows
    ]
    write_results(args.output_dir, {"arguments": vars(args), "rows": rows}, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
