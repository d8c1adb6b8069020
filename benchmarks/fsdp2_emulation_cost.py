"""Emulated tying's extra memory and step time under FSDP2, against a really tied model sharded the same way.

Launches `torchrun --nproc_per_node <ranks>` once per arm (arms alternating, `--repeats` times); each rank trains a
GPT-2-small-shaped model (vocabulary 50257, d 768, `--layers` blocks) sharded with `fully_shard`, with AdamW, on the
same random tokens, through a plain loop:

* ``tied``: one shared parameter (the embedding and the head in one FSDP group, as accelerate lays a tied model out);
* ``emulated``: `untie.Untier(untie_at=None, untie_when=None, tying_mode="emulated", metrics_every=0)`: the head
  has its own parameter, sharded like the embedding, kept tied (gradient fold, copy after each step);
* ``measuring``: the same with the default trigger measuring every `--metrics_every` steps (pairs (0, 1), ...):
  what `UntieCallback()` runs under FSDP2 now that a measurement costs O(|T| d) per rank.

Reports per arm, on rank 0: the median step time and its ratio to ``tied``, the bytes of the rank's parameter
shards and AdamW state, and the peak RSS. On CPU the ranks use gloo; on GPUs, NCCL (one GPU per rank).

    python benchmarks/fsdp2_emulation_cost.py --ranks 2 --steps 20 --repeats 1
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import transformers as tf
from common import machine, print_result, run_ranks, write_results

import untie

ARMS = ("tied", "emulated", "measuring")


@dataclass
class BenchmarkArguments:
    ranks: int = field(default=2, metadata={"help": "Processes (CPU: gloo; GPU: one GPU each, NCCL)."})
    layers: int = field(default=2, metadata={"help": "GPT-2 blocks (GPT-2 small: 12)."})
    steps: int = field(default=20, metadata={"help": "Optimizer steps per arm (the first 3 are not timed)."})
    batch_size: int = 4
    sequence_length: int = 128
    metrics_every: int = field(default=5, metadata={"help": "The measuring arm's metrics_every."})
    repeats: int = 1
    output_dir: str = "runs/bench-fsdp2-emulation"
    arm: str | None = field(default=None, metadata={"help": "Internal: run this arm on this rank."})


def local_bytes(tensors) -> int:
    total = 0
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        total += local.numel() * local.element_size()
    return total


def peak_bytes(cuda: bool) -> int:
    return torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_rank(args: BenchmarkArguments) -> dict | None:
    from torch.distributed.fsdp import fully_shard

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // dist.get_world_size()))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    tf.set_seed(0)
    config = tf.GPT2Config(n_layer=args.layers, n_positions=args.sequence_length)
    model = tf.GPT2LMHeadModel(config).to(device)
    untier = None
    if args.arm != "tied":
        rule = dataclasses.replace(untie.RULES["cancellation"], warmup=10**9)  # measure, never fire
        untier = untie.Untier(
            model,
            untie_at=None,
            untie_when=rule if args.arm == "measuring" else None,
            metrics_every=args.metrics_every if args.arm == "measuring" else 0,
            pairs=[(2 * i, 2 * i + 1) for i in range(256)] if args.arm == "measuring" else None,
            tying_mode="emulated",
        )
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    for block in model.transformer.h:
        fully_shard(block)
    if args.arm == "tied":
        fully_shard([model.transformer.ln_f, embedding, head], reshard_after_forward=False)
    else:
        fully_shard(embedding)
        fully_shard([model.transformer.ln_f, head], reshard_after_forward=False)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if untier is not None:
        untier.start(optimizer)
    generator = torch.Generator().manual_seed(dist.get_rank())
    durations = []
    for _ in range(args.steps):
        ids = torch.randint(0, config.vocab_size, (args.batch_size, args.sequence_length), generator=generator)
        ids = ids.to(device)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if untier is not None:
            untier.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        durations.append(time.perf_counter() - start)
    params = {id(p): p for p in model.parameters()}.values()
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
    result = {
        "arm": args.arm,
        "median_step_s": statistics.median(durations[3:]),
        "parameter_mib": local_bytes(params) / 2**20,
        "optimizer_state_mib": local_bytes(state) / 2**20,
        "peak_mib": (
            torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        )
        / 2**20,
        "measurements": len(untier.history) if untier is not None else 0,
        "tied": untier.run.untied is False if untier is not None else True,
    }
    dist.destroy_process_group()
    return result if int(os.environ["RANK"]) == 0 else None


def main() -> None:
    (args,) = tf.HfArgumentParser(BenchmarkArguments).parse_args_into_dataclasses()
    if args.arm is not None:
        print_result(run_rank(args))
        return
    runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for _ in range(args.repeats):
        for arm in ARMS:
            result = run_ranks(__file__, args.ranks, *sys.argv[1:], "--arm", arm)
            print(json.dumps(result), flush=True)
            runs[arm].append(result)
    tied_s = statistics.median(r["median_step_s"] for r in runs["tied"])
    rows = [
        "| arm | step (median) | vs tied | parameter shards | AdamW state | peak memory | measurements |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm in ARMS:
        step = statistics.median(r["median_step_s"] for r in runs[arm])
        last = runs[arm][-1]
        rows.append(
            f"| {arm} | {step:.3f} s | x{step / tied_s:.3f} | {last['parameter_mib']:.0f} MiB "
            f"| {last['optimizer_state_mib']:.0f} MiB | {last['peak_mib']:.0f} MiB | {last['measurements']} |"
        )
    table = "\n".join(rows) + (
        f"\n\nPer rank (rank 0), {args.ranks} ranks. Machine: {machine()}; "
        f"`python benchmarks/fsdp2_emulation_cost.py {' '.join(sys.argv[1:])}`."
    )
    write_results(args.output_dir, runs, table)


if __name__ == "__main__":
    main()
