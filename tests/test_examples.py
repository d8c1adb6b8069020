"""Every example runs offline, end to end, on what it builds or the repo ships (shortened where it takes arguments)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import transformers as tf

import untie

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run(script: str, cwd: Path, *args: str) -> str:
    # No timeout: the suite must pass on a loaded machine (examples state their measured times in their docstrings).
    result = subprocess.run([sys.executable, str(EXAMPLES / script), *args], cwd=cwd, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.parametrize("untie_at", [0, 3])
def test_finetune_tied_checkpoint(untie_at, tmp_path):
    out = tmp_path / "run"
    _run(
        "finetune_tied_checkpoint.py",
        tmp_path,
        "--output_dir",
        str(out),
        "--max_steps",
        "6",
        "--base_pretrain_steps",
        "2",
        "--untie_at",
        str(untie_at),
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["untie_step"] == untie_at
    assert summary["reloaded_untied"] and summary["reloaded_head_intact"]
    assert untie.is_tied(tf.AutoModelForCausalLM.from_pretrained(out / "base"))  # the starting point was tied
    assert 0 <= summary["drift"]["knn_overlap"] <= 1


@pytest.mark.parametrize("untie_at", [None, 3])
def test_tie_untied_checkpoint(untie_at, tmp_path):
    out = tmp_path / "run"
    extra = [] if untie_at is None else ["--untie_at", str(untie_at)]
    _run(
        "tie_untied_checkpoint.py",
        tmp_path,
        "--output_dir",
        str(out),
        "--max_steps",
        "6",
        "--base_pretrain_steps",
        "2",
        *extra,
    )
    summary = json.loads((out / "summary.json").read_text())
    assert not untie.is_tied(tf.AutoModelForCausalLM.from_pretrained(out / "base"))  # the starting point was untied
    assert summary["untie_step"] == untie_at
    assert summary["reloaded_tied"] is (untie_at is None) and summary["reloaded_embedding_intact"]


def test_pretrain_minimal(tmp_path):
    _run("pretrain_minimal.py", tmp_path)
    model = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "runs" / "pretrain_minimal" / "final")
    assert not untie.is_tied(model) and untie.was_untied(model)


def test_tie_then_untie(tmp_path):
    out = tmp_path / "run"
    _run("tie_then_untie.py", tmp_path, "--output_dir", str(out), "--max_steps", "20")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["untie_step"] == 6 and summary["reloaded_untied"] and summary["reloaded_head_intact"]
