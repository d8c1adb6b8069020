"""`benchmarks/gpu_check.py`, the device check, on the CPU at tiny shapes: what a CPU can show of it (bf16 end to end,
the report's parts); on a lent GPU the same script runs bf16 and fp16 at the shapes of real tied models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from script_modules import load_script

pytestmark = pytest.mark.recipes  # a test of recipes/, scripts/ or the docs' tables (pytest -m 'not recipes')

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def gpu_check(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return load_script("benchmarks", "gpu_check")


def test_a_bf16_run_unties_mid_run_and_reloads_exactly(gpu_check, tmp_path):
    args = gpu_check.CheckArguments(tiny=True)
    bf16 = gpu_check.precision_run("bf16", args, tmp_path)
    assert bf16["untie_step"] == 3 and bf16["losses_finite"] and bf16["head_moved_after_untie"]
    assert bf16["reload_max_parameter_difference"] == 0 and bf16["reload_max_logit_difference"] == 0
    assert bf16["reloaded_untied"]
    if not torch.cuda.is_available():
        assert "needs CUDA" in gpu_check.precision_run("fp16", args, tmp_path)["skipped"]


@pytest.mark.slow
def test_the_device_check_runs_tiny_on_the_cpu_and_reports_every_part(gpu_check, tmp_path):
    report = gpu_check.main(["--tiny", "--output_dir", str(tmp_path)])
    assert [run["precision"] for run in report["precision"]] == ["bf16", "fp16"]
    (shape,) = report["shapes"]
    assert shape["measuring"][0]["ratio"] > 0 and shape["untie"][0]["ratio"] > 0
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["device"] == report["device"] and "| tiny | 1,024 x 64 |" in (tmp_path / "results.md").read_text()


@pytest.mark.parametrize("shape", range(2))
def test_the_real_shapes_batches_hold_the_tokens_their_pairs_need(gpu_check, shape):
    """At each real shape the measuring step's batch (Zipf-drawn, as `measurement_scale.py` draws it) holds at least
    the 2 x pairs distinct tokens its pairs are read from (one sequence of 512 did not: the first lent GPU's call)."""
    measuring = load_script("benchmarks", "measurement_scale")
    _, vocab, hidden = gpu_check.REAL_SHAPES[shape]
    flags = gpu_check.measuring_flags(vocab, hidden, "bfloat16", tiny=False)
    value = {flags[i]: flags[i + 1] for i in range(0, len(flags), 2)}
    ids = measuring._zipf_batch(vocab, (int(value["--batch_size"]), int(value["--sequence_length"])))
    assert measuring._pairs(ids, int(value["--pairs"]), "batch", vocab)  # raises where too few tokens
