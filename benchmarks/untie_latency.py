"""Latency of an untie against one copy of the matrix and its optimizer state, at Qwen2.5-7B's 151,936 x 3584 in bf16.

Each repeat runs in a fresh process: it builds a one-layer Qwen2-shaped model with tied embeddings (the matrix
dominates it), takes one AdamW step so that the matrix has its two moments, then times

* ``copy``: cloning the matrix and each tensor of its optimizer state (the least an untie must do: the head gets its
  own copy of both), the median of three;
* ``untie``: `untie.untie_embeddings(model, optimizer)`: the head's new parameter, its place in the optimizer's group
  and its copied state, and the model's bookkeeping.

Reports the ratio untie / copy per repeat and their median (the goal of issue 25: <= 2x).

    python benchmarks/untie_latency.py --vocab 151936 --hidden 3584 --dtype bfloat16 --repeats 3
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch
import transformers as tf
from common import machine, run_worker, write_results

import untie


@dataclass
class BenchmarkArguments:
    vocab: int = field(default=151_936, metadata={"help": "Vocabulary size (Qwen2.5: 151,936)."})
    hidden: int = field(default=3584, metadata={"help": "Embedding width (Qwen2.5-7B: 3584)."})
    dtype: str = field(default="bfloat16", metadata={"help": "Parameter (and AdamW state) dtype."})
    repeats: int = field(default=3, metadata={"help": "Fresh processes, one untie each."})
    output_dir: str = "runs/bench-untie-latency"
    worker: bool = field(default=False, metadata={"help": "Internal: measure once in this process."})


def _timed(action, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    action()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def measure(args: BenchmarkArguments) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tf.set_seed(0)
    config = tf.Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden,
        num_hidden_layers=1,
        num_attention_heads=max(1, args.hidden // 128),
        num_key_value_heads=max(1, args.hidden // 512),
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    model = tf.Qwen2ForCausalLM(config).to(device=device, dtype=getattr(torch, args.dtype))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, args.vocab, (1, 16), generator=torch.Generator().manual_seed(0)).to(device)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    weight = model.get_input_embeddings().weight
    state = optimizer.state[weight]

    def copy_matrix_and_state() -> None:
        copies = [weight.detach().clone()] + [v.clone() for v in state.values() if torch.is_tensor(v) and v.dim()]
        del copies

    copy_s = statistics.median(_timed(copy_matrix_and_state, device) for _ in range(3))
    untie_s = _timed(lambda: untie.untie_embeddings(model, optimizer), device)
    head = model.get_output_embeddings().weight
    assert head is not weight and torch.equal(head, weight) and optimizer.state[head], "the untie must have happened"
    state_bytes = sum(v.nbytes for v in state.values() if torch.is_tensor(v))
    return {
        "device": str(device),
        "copy_s": copy_s,
        "untie_s": untie_s,
        "ratio": untie_s / copy_s,
        "matrix_gib": weight.nbytes / 2**30,
        "state_gib": state_bytes / 2**30,
    }


def main() -> None:
    (args,) = tf.HfArgumentParser(BenchmarkArguments).parse_args_into_dataclasses()
    if args.worker:
        print("RESULT " + json.dumps(measure(args)), flush=True)
        return
    runs = []
    for _ in range(args.repeats):
        command = [sys.executable, __file__, *sys.argv[1:], "--worker", "true"]
        runs.append(run_worker(command))
        print(json.dumps(runs[-1]), flush=True)
    first = runs[0]
    ratios = ", ".join(f"x{run['ratio']:.2f}" for run in runs)
    table = "\n".join(
        [
            "| matrix | its AdamW state | copy of both (median) | untie (median) | ratio per repeat | median ratio |",
            "|---|---|---|---|---|---|",
            f"| {args.vocab:,} x {args.hidden} {args.dtype}, {first['matrix_gib']:.2f} GiB "
            f"| {first['state_gib']:.2f} GiB | {statistics.median(r['copy_s'] for r in runs):.3f} s "
            f"| {statistics.median(r['untie_s'] for r in runs):.3f} s "
            f"| {ratios} | x{statistics.median(r['ratio'] for r in runs):.2f} |",
            "",
            f"Machine: {machine()}; `python benchmarks/untie_latency.py {' '.join(sys.argv[1:])}`.",
        ]
    )
    write_results(args.output_dir, runs, table)


if __name__ == "__main__":
    main()
