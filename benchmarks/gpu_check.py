"""The library's mechanics on one CUDA GPU, in one call of under 8 minutes: mixed precision end to end, and the cost of
measuring and untying at the shapes of real tied models (random weights).

    python benchmarks/gpu_check.py --output_dir docs/data/gpu-check          # on a lent GPU (bf16 and fp16)
    python benchmarks/gpu_check.py --tiny --output_dir runs/gpu-check-cpu      # what a CPU can show (tests)

1. **Precision**: for bf16 and fp16 (Trainer's `bf16=True` / `fp16=True`), a Qwen3-shaped model with tied
   embeddings trains with `UntieCallback(untie_at=<half>, untie_when=None)`: tied, untied mid-run, saved, reloaded by
   plain transformers. Checked: the untie step, a finite loss, the head moved away from the embedding after the untie,
   and the reload equal to the trained model (every parameter, and the logits, max difference 0). On a CPU fp16 is
   left out (Trainer's fp16 needs CUDA) and said so.
2. **Shapes**: Gemma 3 270M's 262,144 x 640 and Qwen3 0.6B's 151,936 x 1,024 embeddings, in bf16:
   `benchmarks/measurement_scale.py` (a measuring step against a plain one: time ratio and extra peak memory) and
   `benchmarks/untie_latency.py` (an untie against one copy of the matrix and its AdamW state), each in fresh
   processes as those scripts do.

Writes `results.json` and `results.md` (the device, the versions, each part) into `--output_dir`, and prints the
Markdown. Nothing in the test suite needs a GPU: `tests/test_gpu_check.py` runs `--tiny` on the CPU.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers as tf

import untie

HERE = Path(__file__).resolve().parent
#: (name, vocabulary, width) of the tied models whose embedding shapes are measured.
REAL_SHAPES = (("gemma-3-270m", 262_144, 640), ("qwen3-0.6b", 151_936, 1_024))
TINY_SHAPES = (("tiny", 1_024, 64),)
#: Trainer's mixed-precision flags and the autocast dtype each runs in.
_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


@dataclass
class CheckArguments:
    output_dir: str = "runs/gpu-check"
    tiny: bool = field(default=False, metadata={"help": "Tiny shapes and few steps: what a CPU can run in seconds."})
    steps: int = field(default=40, metadata={"help": "Optimizer steps of each precision run (untie at half)."})
    vocab: int = field(default=32_768, metadata={"help": "Vocabulary of the precision runs' model."})
    hidden: int = field(default=256, metadata={"help": "Width of the precision runs' model."})


def _model(vocab: int, hidden: int) -> tf.PreTrainedModel:
    config = tf.Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                            tie_word_embeddings=True, max_position_embeddings=256)  # fmt: skip
    torch.manual_seed(0)
    return tf.Qwen3ForCausalLM(config)


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, vocab: int, n: int = 64, length: int = 64) -> None:
        self.ids = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def precision_run(precision: str, args: CheckArguments, workdir: Path) -> dict:
    """Train tied, untie at half, save, reload with plain transformers; what held."""
    if precision == "fp16" and not torch.cuda.is_available():
        return {"precision": precision, "skipped": "Trainer's fp16 mixed precision needs CUDA"}
    steps = 6 if args.tiny else args.steps
    vocab, hidden = (512, 32) if args.tiny else (args.vocab, args.hidden)
    model = _model(vocab, hidden)
    callback = untie.UntieCallback(untie_at=steps // 2, untie_when=None, policy="off")
    training = tf.TrainingArguments(
        output_dir=str(workdir / precision), max_steps=steps, per_device_train_batch_size=8, learning_rate=1e-3,
        logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, use_cpu=not torch.cuda.is_available(),
        bf16=precision == "bf16", fp16=precision == "fp16",
    )  # fmt: skip
    trainer = tf.Trainer(model=model, args=training, train_dataset=_Tokens(vocab), callbacks=[callback])
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    model.save_pretrained(workdir / f"{precision}-saved")
    reloaded = type(model).from_pretrained(workdir / f"{precision}-saved").to(model.device)
    parameters = dict(model.named_parameters())
    worst = max((parameters[n].detach() - p.detach()).abs().max().item() for n, p in reloaded.named_parameters())
    ids = _Tokens(vocab, n=2).ids.to(model.device)
    model.eval()
    with torch.no_grad(), torch.autocast(model.device.type, dtype=getattr(torch, _DTYPES[precision])):
        logit_difference = (model(input_ids=ids).logits - reloaded(input_ids=ids).logits).abs().max().item()
    head, embedding = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    return {
        "precision": precision,
        "untie_step": callback.untie_step,
        "losses_finite": all(math.isfinite(loss) for loss in losses),
        "head_moved_after_untie": not torch.equal(head, embedding),
        "reload_max_parameter_difference": worst,
        "reload_max_logit_difference": logit_difference,
        "reloaded_untied": not untie.is_tied(reloaded),
    }


def _script(name: str, *arguments: str) -> dict | list:
    """Run one of the benchmarks in a fresh process; its results.json."""
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, str(HERE / name), *arguments, "--output_dir", out]
        result = subprocess.run(command, capture_output=True, text=True, cwd=HERE)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
        return json.loads(Path(out, "results.json").read_text())


def measuring_flags(vocab: int, hidden: int, dtype: str, tiny: bool) -> list[str]:
    """`benchmarks/measurement_scale.py`'s flags at one shape: 256 pairs (the tokenizer default's count) of the
    batch's most frequent tokens, from 4 sequences of 512 (one sequence of 512 Zipf-drawn tokens holds about 340
    distinct ones, fewer than 256 pairs need: the first lent GPU's call failed there)."""
    steps, length, batch, pairs = ("2", "64", "1", "8") if tiny else ("4", "512", "4", "256")
    return ["--vocabs", str(vocab), "--hidden", str(hidden), "--dtype", dtype, "--steps", steps,
            "--sequence_length", length, "--batch_size", batch, "--pairs", pairs]  # fmt: skip


def shape_costs(args: CheckArguments) -> list[dict]:
    """The measuring step and the untie at each shape (bf16 on a GPU; float32 on a CPU, whose bf16 matmuls are
    emulated)."""
    dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    rows = []
    for name, vocab, hidden in TINY_SHAPES if args.tiny else REAL_SHAPES:
        measuring = _script("measurement_scale.py", *measuring_flags(vocab, hidden, dtype, args.tiny))
        latency = _script("untie_latency.py", "--vocab", str(vocab), "--hidden", str(hidden), "--dtype", dtype,
                          "--repeats", "1" if args.tiny else "2")  # fmt: skip
        rows.append({"shape": name, "vocab": vocab, "hidden": hidden, "dtype": dtype, "measuring": measuring,
                     "untie": latency})  # fmt: skip
    return rows


def device_name() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda})"
    return f"CPU, {os.cpu_count()} cores"


def markdown(report: dict) -> str:
    lines = [f"Device: {report['device']}; torch {report['torch']}, transformers {report['transformers']}; "
             f"{report['seconds']:.0f} s.", "", "| precision | untie step | finite loss | head moved | reload: max "
             "parameter / logit difference | reloaded untied |", "|---|---|---|---|---|---|"]  # fmt: skip
    for run in report["precision"]:
        if "skipped" in run:
            lines.append(f"| {run['precision']} | skipped: {run['skipped']} | | | | |")
            continue
        lines.append(f"| {run['precision']} | {run['untie_step']} | {run['losses_finite']} | "
                     f"{run['head_moved_after_untie']} | {run['reload_max_parameter_difference']:.3g} / "
                     f"{run['reload_max_logit_difference']:.3g} | {run['reloaded_untied']} |")  # fmt: skip
    lines += ["", "| shape | V x d | dtype | measuring step / plain | extra peak memory (share of the matrix) | "
              "untie / copy |", "|---|---|---|---|---|---|"]  # fmt: skip
    for row in report["shapes"]:
        measured = row["measuring"][0] if isinstance(row["measuring"], list) else row["measuring"]
        untie_runs = row["untie"] if isinstance(row["untie"], list) else [row["untie"]]
        ratio = measured.get("ratio", float("nan"))
        memory = measured.get("extra_share_of_embedding", float("nan"))
        untie_ratio = sorted(run.get("ratio", float("nan")) for run in untie_runs)[len(untie_runs) // 2]
        lines.append(f"| {row['shape']} | {row['vocab']:,} x {row['hidden']:,} | {row['dtype']} | {ratio:.3f} | "
                     f"{memory:.3f} | {untie_ratio:.2f} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    (args,) = tf.HfArgumentParser(CheckArguments).parse_args_into_dataclasses(args=argv)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as workdir:
        precision = [precision_run(p, args, Path(workdir)) for p in ("bf16", "fp16")]
    report = {
        "device": device_name(),
        "torch": torch.__version__,
        "transformers": tf.__version__,
        "precision": precision,
        "shapes": shape_costs(args),
    }
    report["seconds"] = time.perf_counter() - started
    os.makedirs(args.output_dir, exist_ok=True)
    Path(args.output_dir, "results.json").write_text(json.dumps(report, indent=2) + "\n")
    table = markdown(report)
    Path(args.output_dir, "results.md").write_text(table + "\n")
    print(table)
    return report


if __name__ == "__main__":
    main()
