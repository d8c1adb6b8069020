"""Every example runs offline, end to end, on what it builds or the repo ships (shortened where it takes arguments)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers as tf

import untie

pytestmark = pytest.mark.recipes  # examples/ and the docs' code blocks, not the library

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


def test_accelerate_loop_resumes_from_save_state_to_the_same_weights(tmp_path):
    """examples/accelerate_loop.py: untie at 30% of 8 steps; resumed at step 4, after the untie: bit-identical."""
    _run("accelerate_loop.py", tmp_path, "--max_steps", "8", "--save_every", "4", "--output_dir", "whole")
    _run(
        "accelerate_loop.py", tmp_path, "--max_steps", "8", "--save_every", "4", "--output_dir", "resumed",
        "--resume_from", "whole/step-4",
    )  # fmt: skip
    state = json.loads((tmp_path / "whole" / "step-4" / "untie_state.json").read_text())
    assert state["attributes"]["untied"] and state["attributes"]["untie_step"] == 2
    whole, resumed = (tf.AutoModelForCausalLM.from_pretrained(tmp_path / run / "final") for run in ("whole", "resumed"))
    assert not untie.is_tied(whole) and not untie.is_tied(resumed)
    for (name, value), (_, other) in zip(whole.state_dict().items(), resumed.state_dict().items(), strict=True):
        assert torch.equal(value, other), name


@pytest.mark.parametrize("num_processes", [1, 2, 4])
def test_accelerate_loop_lr_reaches_zero_at_the_last_step_on_any_number_of_processes(num_processes, monkeypatch):
    """accelerate steps a prepared scheduler once per process per optimizer step: the example's LR schedule must
    reach 0 at max_steps, not at max_steps / num_processes (and never go negative)."""
    import importlib.util
    import types

    import accelerate.scheduler

    spec = importlib.util.spec_from_file_location("accelerate_loop", EXAMPLES / "accelerate_loop.py")
    example = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "accelerate_loop", example)  # its dataclasses look their module up
    spec.loader.exec_module(example)
    state = types.SimpleNamespace(num_processes=num_processes)
    monkeypatch.setattr(accelerate.scheduler, "AcceleratorState", lambda: state)
    weight = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([weight], lr=1.0)
    max_steps = 10
    scheduler = accelerate.scheduler.AcceleratedScheduler(
        example.linear_decay(optimizer, max_steps, num_processes),
        [types.SimpleNamespace(step_was_skipped=False)],
        step_with_optimizer=True,
        split_batches=False,
    )
    rates = []
    for _ in range(max_steps):
        scheduler.step()
        rates.append(optimizer.param_groups[0]["lr"])
    assert rates[max_steps // 2 - 1] == pytest.approx(0.5) and rates[-1] == 0.0
    assert all(a > b for a, b in zip(rates, rates[1:], strict=False)) and min(rates) >= 0.0
