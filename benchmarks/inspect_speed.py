"""Time `untie inspect` on an untied checkpoint with a 256k x 4096 input embedding and LM head (random values).

python benchmarks/inspect_speed.py [--vocab 256000 --hidden 4096 --dtype bfloat16 --repeats 3]

Writes a one-layer Llama-shaped checkpoint (the two embedding matrices dominate it: 4.2 GB in bf16), then runs
`untie inspect DIR --json` in fresh processes and reports the wall time, the time inside `describe()` split into
reading and drift, and the peak RSS. The first run reads from disk, the others from the page cache.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch
import transformers as tf
from safetensors.torch import save_file


@dataclass
class BenchmarkArguments:
    vocab: int = field(default=256_000, metadata={"help": "Vocabulary size (rows of both matrices)."})
    hidden: int = field(default=4096, metadata={"help": "Embedding width."})
    dtype: str = field(default="bfloat16", metadata={"help": "Stored dtype: bfloat16, float16 or float32."})
    repeats: int = field(default=3, metadata={"help": "Timed `untie inspect` runs."})
    checkpoint_dir: str | None = field(default=None, metadata={"help": "Where to write it (default: a temp dir)."})
    keep: bool = field(default=False, metadata={"help": "Keep the written checkpoint."})


def write_checkpoint(path: str, vocab: int, hidden: int, dtype: torch.dtype) -> float:
    """An untied one-layer Llama whose embedding and head are independent random matrices; returns GB written."""
    config = tf.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=False,
        torch_dtype=str(dtype).removeprefix("torch."),
    )
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in tf.LlamaForCausalLM(config).state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for name, shape in shapes.items():
        drawn = torch.randn(shape, generator=generator)  # drawn for every tensor, so the stream stays as measured
        tensors[name] = torch.ones(shape, dtype=dtype) if "norm" in name else (drawn * 0.02).to(dtype)
    os.makedirs(path, exist_ok=True)
    config.save_pretrained(path)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return sum(t.numel() * t.element_size() for t in tensors.values()) / 1e9


def time_inspect(path: str) -> dict:
    """One `untie inspect` in a fresh process: wall time, its report, and that process's own peak RSS."""
    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "untie", "inspect", path, "--json"], stdout=subprocess.PIPE)
    stdout = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)  # this child's own rusage (the writer process is another child)
    process.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - started
    if process.returncode:
        raise RuntimeError(f"untie inspect failed with exit code {process.returncode}")
    report = json.loads(stdout)
    peak = usage.ru_maxrss / 1024  # KiB on Linux; mostly the memory-mapped checkpoint's file pages (see README)
    return {
        "wall_s": wall,
        **{f"{k}_s": v for k, v in report["seconds"].items()},
        "peak_rss_mib": peak,
        "status": report["status"],
        "drift": report["drift"],
    }


def main() -> None:
    (args,) = tf.HfArgumentParser(BenchmarkArguments).parse_args_into_dataclasses()
    dtype = getattr(torch, args.dtype)
    path = args.checkpoint_dir or tempfile.mkdtemp(prefix="untie-inspect-")
    started = time.perf_counter()
    with multiprocessing.get_context("spawn").Pool(1) as pool:  # keeps this process's RSS small
        size = pool.apply(write_checkpoint, (path, args.vocab, args.hidden, dtype))
    elapsed = time.perf_counter() - started
    print(f"wrote {path}: {args.vocab} x {args.hidden} {args.dtype}, {size:.2f} GB in {elapsed:.0f} s")
    runs = [time_inspect(path) for _ in range(args.repeats)]
    for i, run in enumerate(runs):
        print(
            f"run {i}: wall {run['wall_s']:.2f} s (read {run['read_s']:.2f} s, drift {run['drift_s']:.2f} s), "
            f"peak RSS {run['peak_rss_mib']:.0f} MiB"
        )
    summary = {
        "vocab": args.vocab,
        "hidden": args.hidden,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "median_wall_s": statistics.median(r["wall_s"] for r in runs),
        "median_read_s": statistics.median(r["read_s"] for r in runs),
        "median_drift_s": statistics.median(r["drift_s"] for r in runs),
        "peak_rss_mib": max(r["peak_rss_mib"] for r in runs),
        "drift": runs[-1]["drift"],
    }
    print(json.dumps(summary, indent=2))
    if not args.keep and not args.checkpoint_dir:
        import shutil

        shutil.rmtree(path)


if __name__ == "__main__":
    main()
