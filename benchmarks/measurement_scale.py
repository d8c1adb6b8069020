"""Cost of a measuring step against a plain step, and its extra peak memory, as the vocabulary grows.

For each vocabulary V, a fresh process builds a one-layer Llama-shaped model (tied, width d) and trains it with a
plain loop and `untie.Untier`, what a custom loop runs:

1. plain steps: `Untier(untie_at=None, untie_when=None, metrics_every=0)`, no measurement;
2. measuring steps: `Untier(untie_when=<the evidence rule, never firing>, pairs=<256 pairs>, metrics_every=1)`: every
   step measures the role signals, the pairs' gaps and evidence and the cross-entropy, what the defaults measure
   every `metrics_every` steps when the model has a tokenizer.

The batch is natural-text-like: tokens drawn by Zipf's law over the vocabulary (frequency 1/rank). The pairs are, by
default (`--pairs_from batch`), made of the batch's most frequent tokens, as the tokenizer's pairs are (`the`/`The`,
...): every pair occurs in every batch, the case that reads the most rows. `--pairs_from vocabulary` takes ids that
never occur in the batch instead.

The two kinds alternate (plain, measuring, plain, ...) on the same batch, after warm-up steps of each. Reports, per V:
the median step time of each kind and their ratio, and the extra peak memory of a measuring step over a plain one,
as a share of the embedding matrix's size: on CUDA the peak allocated bytes; on CPU the peak of the bytes torch
holds, from the profiler's memory timeline of one step of each kind (exact and repeatable, where the process's RSS
also counts the allocator's caching). The goals (issues 25, 35): a ratio <= 1.1 and extra memory <= 10% of the
embedding.

    python benchmarks/measurement_scale.py --vocabs 32000 128000 256000 --hidden 2048 --output_dir runs/bench-scale
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import tempfile
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
    pairs_from: str = field(
        default="batch",
        metadata={"help": "batch: the batch's most frequent tokens (as the tokenizer's pairs); vocabulary: rare ids."},
    )
    dtype: str = field(default="float32", metadata={"help": "Model dtype: float32 or bfloat16."})
    threads: int = field(default=0, metadata={"help": "torch threads (0: torch's default)."})
    output_dir: str = "runs/bench-scale"
    vocab: int | None = field(default=None, metadata={"help": "Internal: measure this vocabulary in this process."})


def _step_peak_bytes(step, device: torch.device) -> int:
    """Peak bytes torch holds during `step()`: CUDA's peak allocated; on CPU, from the profiler's memory timeline."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        step()
        return torch.cuda.max_memory_allocated(device)
    with torch.profiler.profile(profile_memory=True, record_shapes=True, with_stack=True) as profile:
        step()
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "timeline.json")
        profile.export_memory_timeline(path, device="cpu")
        with open(path) as f:
            _, sizes = json.load(f)
    return max(sum(row) for row in sizes)


def _zipf_batch(vocab: int, shape: tuple[int, int]) -> torch.Tensor:
    """Token ids drawn with frequency 1/rank, as words are in natural text (id 0 the most frequent)."""
    weights = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
    return torch.multinomial(weights, shape[0] * shape[1], replacement=True, generator=torch.Generator()).reshape(shape)


def _pairs(ids: torch.Tensor, count: int, source: str, vocab: int) -> list[tuple[int, int]]:
    """`count` pairs of distinct tokens: the batch's most frequent, or ids at the rare end of the vocabulary."""
    if source == "vocabulary":
        return [(vocab - 1 - 2 * i, vocab - 2 - 2 * i) for i in range(count)]
    tokens, counts = ids.unique(return_counts=True)
    frequent = tokens[counts.argsort(descending=True, stable=True)].tolist()
    if len(frequent) < 2 * count:
        raise ValueError(
            f"the batch holds {len(frequent)} distinct tokens, fewer than the {2 * count} of {count} pairs"
        )
    return [(frequent[2 * i], frequent[2 * i + 1]) for i in range(count)]


def _step(model, optimizer, untier: untie.Untier, batch, device, measure: bool) -> float:
    """One optimizer step; `measure` False disarms the probe (hooks stay on): a step between two measurements."""
    untier.run.measurements.probe.armed = measure
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
    ids = _zipf_batch(args.vocab, (args.batch_size, args.sequence_length))
    batch = {"input_ids": ids.to(device), "labels": ids.to(device)}
    never = dataclasses.replace(untie.RULES["evidence"], warmup=10**9)
    pairs = _pairs(ids, args.pairs, args.pairs_from, args.vocab)
    untier = untie.Untier(model, optimizer, untie_at=None, untie_when=never, pairs=pairs, metrics_every=1)
    times: dict[str, list[float]] = {"plain": [], "measuring": []}
    _step(model, optimizer, untier, batch, device, measure=False)  # warm-up
    for _ in range(args.steps):
        times["plain"].append(_step(model, optimizer, untier, batch, device, measure=False))
    _step(model, optimizer, untier, batch, device, measure=True)  # warm-up
    for _ in range(args.steps):  # alternating, so that a slow drift of the machine hits both kinds
        times["measuring"].append(_step(model, optimizer, untier, batch, device, measure=True))
        times["plain"].append(_step(model, optimizer, untier, batch, device, measure=False))
    peaks = {
        kind: _step_peak_bytes(lambda m=kind == "measuring": _step(model, optimizer, untier, batch, device, m), device)
        for kind in ("plain", "measuring")
    }  # one more step of each kind, outside the timed ones (the profiler slows it)
    assert untie.is_tied(model) and len(untier.history) == args.steps + 2, "every measuring step must have measured"
    in_batch = torch.isin(torch.tensor(pairs).reshape(-1), ids).float().mean().item()
    plain_s, measuring_s = statistics.median(times["plain"]), statistics.median(times["measuring"])
    extra = max(0, peaks["measuring"] - peaks["plain"])
    return {
        "vocab": args.vocab,
        "hidden": args.hidden,
        "dtype": args.dtype,
        "device": str(device),
        "tokens_per_step": args.batch_size * args.sequence_length,
        "pairs_from": args.pairs_from,
        "pair_tokens_in_batch": in_batch,
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
        "| V x d | tokens/step | pair tokens in the batch | plain step | measuring step | ratio | extra peak memory "
        "| share of the embedding |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        rows.append(
            f"| {r['vocab']:,} x {r['hidden']} {r['dtype']} | {r['tokens_per_step']} "
            f"| {100 * r['pair_tokens_in_batch']:.0f}% | {r['plain_step_s']:.3f} s "
            f"| {r['measuring_step_s']:.3f} s | x{r['ratio']:.3f} | {r['extra_peak_mib']:.1f} MiB "
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
