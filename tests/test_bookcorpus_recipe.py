"""recipes/bookcorpus.py end to end on a few steps of the offline corpus: every arm, the report, reuse of finished
arms, the causal variant, local files, and the scheduled arm under 2-process DDP."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os

import pytest
import torch
from bookcorpus_ddp_run import ARGV as DDP_ARGV
from launch import torchrun

from untie_recipes import bookcorpus as recipe
from untie_recipes.tasks.bookcorpus.report import load_records
from untie_recipes.tasks.bookcorpus.setup import resolve
from untie_recipes.tasks.bookcorpus.training import prepare_data, train_arm

pytestmark = pytest.mark.recipes  # a test of recipes/, scripts/ or the docs' tables (pytest -m 'not recipes')

WITH_LINE = ["--max_steps", "12", "--eval_steps", "6", "--untie_at", "4", "--auto_deadline", "8", "--metrics_every",
             "2", "--batch_size", "16", "--max_train_samples", "400", "--max_eval_samples", "64",
             "--logging_steps", "3"]  # fmt: skip
SHORT = [*WITH_LINE, "--disable_tqdm"]  # each arm prints its logs instead of the job's progress line
ARM_KEYS = {"arm", "steps", "untie_step", "eval_loss", "perplexity", "accuracy", "distances", "tokens_per_second",
            "throughput_vs_tied"}  # fmt: skip


@pytest.fixture(scope="module")
def all_arms(tmp_path_factory):
    out = tmp_path_factory.mktemp("bookcorpus")
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        results = recipe.main(["--output_dir", str(out), *WITH_LINE])
    return out, results, stderr.getvalue()


def test_one_progress_line_covers_every_arm(all_arms):
    line = all_arms[2].replace("\r", "\n").splitlines()
    assert any("BookCorpus 4/4 runs" in text and "100%" in text and "48/48" in text for text in line), line[-3:]


def test_every_arm_trains_and_reports(all_arms):
    out, results, _ = all_arms
    arms = {a["arm"]: a for a in results["arms"]}
    assert list(arms) == ["tied", "untied", "scheduled", "auto"]
    for arm in arms.values():
        assert ARM_KEYS <= set(arm) and arm["steps"] == 12
        assert math.isfinite(arm["eval_loss"]) and 0 <= arm["accuracy"] <= 1
        assert arm["perplexity"] == pytest.approx(math.exp(arm["eval_loss"]))
        assert arm["tokens_per_second"] > 0
        assert set(arm["distances"]["input"]) == {"twin-dh", "twin-skewed", "random"}  # quick preset: mixed twins
    assert arms["tied"]["untie_step"] is None and arms["untied"]["untie_step"] is None
    assert (arms["scheduled"]["untie_step"], arms["scheduled"]["untie_reason"]) == (4, "deadline")
    assert arms["auto"]["untie_step"] <= 8 and arms["auto"]["untie_reason"] in ("trigger", "deadline")
    assert arms["tied"]["throughput_vs_tied"] == 1.0
    assert arms["tied"]["distances"]["input"] == arms["tied"]["distances"]["output"]  # one matrix
    for arm in ("untied", "scheduled", "auto"):
        assert arms[arm]["distances"]["input"] != arms[arm]["distances"]["output"], arm


def test_history_has_every_eval_and_arms_share_the_start(all_arms):
    out, *_ = all_arms
    records = {r["arm"]: r for r in load_records(str(out))}
    for record in records.values():
        assert [e["step"] for e in record["history"]["eval"]] == [0, 6, 12]
    start = {arm: r["history"]["eval"][0]["loss"] for arm, r in records.items()}
    assert start["tied"] == start["scheduled"] == start["auto"]  # same seed: same tied model, same data draws
    assert records["auto"]["history"]["signals"], "the auto arm measures role signals"
    assert records["scheduled"]["history"]["signals"] == []  # metrics off: the scheduled arm only unties


def test_table_and_figures_are_written(all_arms):
    out, *_ = all_arms
    table = (out / "results.md").read_text()
    assert "| scheduled | 4 (deadline) |" in table and "| tied | - |" in table
    for name in ("curves.png", "distances.png"):
        assert (out / "figures" / name).stat().st_size > 10_000, name
    assert json.loads((out / "results.json").read_text())["arms"][0]["arm"] == "tied"


def test_finished_arms_are_reused_and_reported_again(all_arms):
    out, *_ = all_arms
    record = out / "arms" / "tied.json"
    before = record.stat().st_mtime_ns
    os.remove(out / "results.md")
    results = recipe.main(["--output_dir", str(out), "--arms", "tied", *SHORT])  # already finished: not retrained
    assert record.stat().st_mtime_ns == before and len(results["arms"]) == 4
    assert (out / "results.md").exists()
    assert len(recipe.main(["--output_dir", str(out), "--report_only"])["arms"]) == 4


def test_causal_variant_on_local_text_files(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(f"the man and the dog went to the hill number {i} ." for i in range(600)))
    out = tmp_path / "clm"
    results = recipe.main(["--output_dir", str(out), "--objective", "clm", "--arms", "tied", "scheduled",
                           "--twins", "dh", "--data_files", str(text), "--max_length", "32", *SHORT])  # fmt: skip
    arms = {a["arm"]: a for a in results["arms"]}
    assert set(arms) == {"tied", "scheduled"} and arms["scheduled"]["untie_step"] == 4
    assert arms["tied"]["dataset"] == "local" and arms["tied"]["objective"] == "clm"
    assert set(arms["tied"]["distances"]["input"]) == {"twin-dh", "random"}
    assert 0 <= arms["scheduled"]["accuracy"] <= 1


def test_bad_arguments_fail_before_training(tmp_path):
    with pytest.raises(ValueError, match="Unknown arm 'sometimes'"):
        recipe.main(["--output_dir", str(tmp_path), "--arms", "tied", "sometimes"])
    with pytest.raises(ValueError, match="--objective"):
        recipe.main(["--output_dir", str(tmp_path), "--objective", "seq2seq"])
    with pytest.raises(ValueError, match="--max_steps"):
        recipe.main(["--output_dir", str(tmp_path), "--streaming", "--max_steps", "-1"])
    with pytest.raises(FileNotFoundError, match="No finished arms"):
        recipe.main(["--output_dir", str(tmp_path / "empty"), "--report_only"])


@pytest.fixture(scope="module")
def two_process_ranks(tmp_path_factory):
    """The scheduled arm of a small model under torchrun on CPU (gloo), 2 processes of batch 8: each rank's dump."""
    out = tmp_path_factory.mktemp("bookcorpus-ddp")
    torchrun("bookcorpus_ddp_run.py", out)
    return tuple(torch.load(out / f"rank{r}.pt") for r in (0, 1))


@pytest.mark.distributed
def test_scheduled_arm_under_two_process_ddp(two_process_ranks):
    """Both ranks untie at the same step and end with identical weights."""
    rank0, rank1 = two_process_ranks
    assert rank0["distributed_type"] == "MULTI_CPU"
    assert rank0["untie_step"] == rank1["untie_step"] == 4
    assert not rank0["tied"] and not rank1["tied"]
    assert not torch.equal(rank0["input"], rank0["output"])  # the head trained on its own after the untie
    assert rank0["params"].keys() == rank1["params"].keys()
    for name, value in rank0["params"].items():
        assert torch.equal(value, rank1["params"][name]), name


@pytest.mark.distributed
def test_two_processes_report_the_losses_of_one(two_process_ranks, tmp_path):
    """The same arm on one process of batch 16 (the same 16 sequences a step): every eval and training loss agrees
    with the 2-process run's within what other masks and batches move (0.2 nat), where Trainer once scaled a plain
    mean by the number of processes (about 18 nat against 9)."""
    setup = resolve(["--output_dir", str(tmp_path), "--batch_size", "16", *DDP_ARGV])
    record, _ = train_arm("scheduled", setup, prepare_data(setup))
    two = two_process_ranks[0]
    one_eval = [e["loss"] for e in record["history"]["eval"]]
    one_train = [e["loss"] for e in record["history"]["train"]]
    assert len(one_eval) == len(two["eval_loss"]) == 3 and len(one_train) == len(two["train_loss"]) == 2
    assert two["eval_loss"] == pytest.approx(one_eval, abs=0.2)
    assert two["train_loss"] == pytest.approx(one_train, abs=0.2)


def test_the_quick_preset_sizes_a_causal_lm_as_the_documented_run_and_flags_still_win():
    def sizes(*argv: str) -> tuple:
        setup = resolve(list(argv))
        training = setup.training
        return (training.max_steps, setup.args.batch_size, setup.args.cosine_steps, setup.untie.metrics_every), setup

    mlm, mlm_setup = sizes()
    assert mlm == (1_800, 64, 600, 50)
    clm, clm_setup = sizes("--objective", "clm")
    assert clm == (400, 16, 400, 25)
    assert clm_setup.training.learning_rate == mlm_setup.training.learning_rate
    assert (clm_setup.training.eval_steps, clm_setup.args.twins) == (
        mlm_setup.training.eval_steps,
        mlm_setup.args.twins,
    )
    flags, flags_setup = sizes("--objective", "clm", "--max_steps", "1000", "--metrics_every", "10")
    assert (flags[0], flags[3], flags[1]) == (1_000, 10, 16)
    assert flags_setup.training.per_device_train_batch_size == 16  # --batch_size, from the preset
    paper, _ = sizes("--preset", "paper", "--objective", "clm")
    assert (paper[0], paper[1], paper[3]) == (-1, 128, 50)
    # Trainer's flags work as they are: they win over the recipe's defaults and its preset.
    _, trainer_flags = sizes("--per_device_train_batch_size", "4", "--logging_steps", "7", "--report_to", "none")
    assert (trainer_flags.training.per_device_train_batch_size, trainer_flags.training.logging_steps) == (4, 7)
