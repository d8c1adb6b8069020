"""Cost of a measuring step against a plain step, and its extra peak memory, as the vocabulary grows.

For each vocabulary V, a fresh process builds a one-layer Llama-shaped model (tied, width d) and trains it with a
plain loop and `untie.Untier`, what a custom loop runs:

1. plain steps: `Untier(untie_at=None, untie_when=None, metrics_every=0)`, no measurement;
2. measuring steps: `Untier(untie_when=<the evidence rule, never firing>, pairs=<256 pairs>, metrics_every=1)`: every
   step measures the role signals, the pairs' gaps and evidence and the cross-entropy, what the defaults measure
   every `metrics_every` steps when the model has a tokenizer.

The two kinds alternate (plain, measuring, plain, ...) on the same batch, after warm-up steps of each. Reports, per V:
the median step time of each kind and their ratio, and the extra peak memory of the measuring steps (CUDA: peak
allocated bytes; CPU: the growth of the process's peak RSS once the plain steps have set it) as a share of the
embedding matrix's size. The goals of issue 25: a ratio <= 1.1 and extra memory <= 10% of the embedding.

    python benchmarks/measurement_scale.py --vocabs 32000 128000 256000 --hidden 2048 --output_dir runs/bench-scale
"""

from __future__ import annotations

import dataclasses
import json
import resource
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
    vocabs: list[int] = field(default_factory=lambda: [32_000, 128_000, 256_000], metadata={"help": "Vocabularies."})
    hidden: int = field(default=2048, metadata={"help": "Embedding width d."})
    layers: int = field(default=1, metadata={"help": "Decoder layers (the embedding dominates at 1-2)."})
    batch_size: int = 1
    sequence_length: int = 256
    steps: int = field(default=4, metadata={"help": "Timed steps of each kind (after 1 warm-up step of each)."})
    pairs: int = field(default=256, metadata={"help": "Pairs measured (the tokenizer default reads 256)."})
    dtype: str = field(default="float32", metadata={"help": "Model dtype: float32 or bfloat16."})
    threads: int = field(default=0, metadata={"help": "torch threads (0: torch's default)."})
    output_dir: str = "runs/bench-scale"
    vocab: int | None = field(default=None, metadata={"help": "Internal: measure this vocabulary in this process."})


def _peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _step(model, optimizer, untier: untie.Untier, batch, device, measure: bool) -> float:
    """One optimizer step; `measure` False disarms the probe (hooks stay on): a step between two measurements."""
    untier.run.probe.armed = measure
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    model(**batch).loss.backward()
    optimizer.step()
    if measure:
        untier.step()  # the measurement itself ran in the optimizer's step pre-hook; this feeds the trigger
    optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def run_vocabulary(args: BenchmarkArguments) -> dict:
    """One vocabulary, in this process: plain and measuring steps alternating on one model."""
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tf.set_seed(0)
    config = tf.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 128),
        num_key_value_heads=max(1, args.hidden // 128),
        max_position_embeddings=args.sequence_length,
        tie_word_embeddings=True,
    )
    model = tf.LlamaForCausalLM(config).to(device=device, dtype=getattr(torch, args.dtype))
    embedding_bytes = model.get_input_embeddings().weight.nbytes
    # SGD holds no state: the memory measured is the model's and the measurement's, not the optimizer's.
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    ids = torch.randint(0, args.vocab, (args.batch_size, args.sequence_length), generator=torch.Generator())
    batch = {"input_ids": ids.to(device), "labels": ids.to(device)}
    never = dataclasses.replace(untie.RULES["evidence"], warmup=10**9)
    pairs = [(2 * i, 2 * i + 1) for i in range(args.pairs)]
    untier = untie.Untier(model, optimizer, untie_at=None, untie_when=never, pairs=pairs, metrics_every=1)
    times: dict[str, list[float]] = {"plain": [], "measuring": []}
    _step(model, optimizer, untier, batch, device, measure=False)  # warm-up; the plain steps set the peak first
    for _ in range(args.steps):
        times["plain"].append(_step(model, optimizer, untier, batch, device, measure=False))
    peaks = {"plain": _peak_bytes(device)}
    _step(model, optimizer, untier, batch, device, measure=True)  # warm-up
    for _ in range(args.steps):  # alternating, so that a slow drift of the machine hits both kinds
        times["measuring"].append(_step(model, optimizer, untier, batch, device, measure=True))
        times["plain"].append(_step(model, optimizer, untier, batch, device, measure=False))
    peaks["measuring"] = _peak_bytes(device)
    assert untie.is_tied(model) and len(untier.history) == args.steps + 1, "every measuring step must have measured"
    plain_s, measuring_s = statistics.median(times["plain"]), statistics.median(times["measuring"])
    extra = max(0, peaks["measuring"] - peaks["plain"])
    return {
        "vocab": args.vocab,
        "hidden": args.hidden,
        "dtype": args.dtype,
        "device": str(device),
        "tokens_per_step": args.batch_size * args.sequence_length,
        "plain_step_s": plain_s,
        "measuring_step_s": measuring_s,
        "ratio": measuring_s / plain_s,
        "embedding_mib": embedding_bytes / 2**20,
        "extra_peak_mib": extra / 2**20,
        "extra_share_of_embedding": extra / embedding_bytes,
        "signals": {k: untier.history[-1][k] for k in ("cancellation", "cosine", "learned_z")},
    }


def main() -> None:
    (args,) = tf.HfArgumentParser(BenchmarkArguments).parse_args_into_dataclasses()
    if args.vocab is not None:
        print("RESULT " + json.dumps(run_vocabulary(args)), flush=True)
        return
    results = []
    for vocab in args.vocabs:
        command = [sys.executable, __file__, *sys.argv[1:], "--vocab", str(vocab)]
        result = run_worker(command)
        print(json.dumps(result), flush=True)
        results.append(result)
    rows = [
        "| V x d | tokens/step | plain step | measuring step | ratio | extra peak memory | share of the embedding |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        rows.append(
            f"| {r['vocab']:,} x {r['hidden']} {r['dtype']} | {r['tokens_per_step']} | {r['plain_step_s']:.3f} s "
            f"| {r['measuring_step_s']:.3f} s | x{r['ratio']:.3f} | {r['extra_peak_mib']:.0f} MiB "
            f"| {100 * r['extra_share_of_embedding']:.1f}% of {r['embedding_mib']:.0f} MiB |"
        )
    table = (
        "\n".join(rows)
        + f"\n\nMachine: {machine()}; `python benchmarks/measurement_scale.py "
        + " ".join(sys.argv[1:])
        + "`."
    )
    write_results(args.output_dir, results, table)


if __name__ == "__main__":
    main()
