"""The tie-then-untie study (recipes/study.py), on tiny shapes: its schedule, its branches (exact against a live
untie), its trigger measured without acting, its resume, its held-out seeds, its pooling rule, its statistics and its
LR sweep's extension."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import untie
from untie_recipes.tasks.decision_map import corpus as corpus_module
from untie_recipes.tasks.decision_map.training import data_order, evaluate, train_steps
from untie_recipes.tasks.study import finetune, protocol, provenance, report, runs, stats, sweep, training, verdict
from untie_recipes.tasks.study.model import build_model
from untie_recipes.tasks.study.training import CurveRecorder, RunSpec, StudyRecord

pytestmark = pytest.mark.recipes  # a test of recipes/, scripts/ or the docs' tables (pytest -m 'not recipes')

ROOT = Path(__file__).resolve().parent.parent
WORDS = ("the", "The", "king", "King", "and", "And", "lord", "shall", "thee", "thou", "good", "night", "come", "go")
#: A tiny cell in place of A: budgets of a few steps at batch 4.
TINY = protocol.Cell("A", width=32, layers=1, tokens_per_parameter=0.12, lr_centre=3e-3, arms=protocol.CELLS["A"].arms)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The study's runs use one thread (as the recipe does): on a shared machine two threads spin, not compute."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def small_texts() -> list[str]:
    """Random sentences of a few words (some in two cases: the tokenizer's pairs)."""
    generator = torch.Generator().manual_seed(0)
    picks = torch.randint(len(WORDS), (300, 60), generator=generator)
    return [" ".join(WORDS[i] for i in row) + "." for row in picks.tolist()]


@pytest.fixture(scope="module")
def small_corpus():
    """`small_texts` cut into blocks."""
    return corpus_module.build_corpus(small_texts(), ("test",), vocab_size=300)


@pytest.fixture
def tiny_cell(monkeypatch):
    monkeypatch.setitem(protocol.CELLS, "A", TINY)


def _ctx(corpus, folder: Path, **overrides) -> runs.StudyContext:
    settings = dict(batch_size=4, warmup=2, curve_points=4, curve_blocks=8, resume_every=4,
                    trigger_config=untie.UntieConfig(metrics_every=2))  # fmt: skip
    settings.update(overrides)
    return runs.StudyContext(corpus, folder, {"cpu": "test CPU", "kernel_path": "X", "threads": 1}, "digest",
                             **settings)  # fmt: skip


def _without_time(record: StudyRecord) -> dict:
    return {k: v for k, v in dataclasses.asdict(record).items() if k not in ("wall_seconds", "cpu_seconds")}


def test_the_schedule_warms_up_holds_and_cools_down_linearly_to_zero_over_the_last_fifth():
    model = torch.nn.Linear(2, 2)
    setup = runs.TrainingSetup(8, 1, 1, 1, 1, learning_rate=1.0, warmup=10)
    optimizer, scheduler = training.build_optimizer(model, setup, budget=100)
    rates = []
    for _ in range(100):
        rates.append(optimizer.param_groups[0]["lr"])  # the rate optimizer step len(rates) uses
        optimizer.step()
        scheduler.step()
    assert rates[:10] == pytest.approx([(i + 1) / 10 for i in range(10)])
    assert rates[10:81] == pytest.approx([1.0] * 71)
    assert protocol.cooldown_start(100) == 80 and protocol.untie_step(0.8, 100) == 80
    assert rates[80:] == pytest.approx([(100 - done) / 20 for done in range(80, 100)])
    assert optimizer.param_groups[0]["lr"] == 0.0  # linear to 0 at the budget
    assert protocol.half_budget(101) == 51 and protocol.cooldown_start(51) == 41  # the sweep's own last 20%


def _live_untie(ctx: runs.StudyContext, spec: RunSpec) -> tuple[list[float], float]:
    """The arm as one live run: tied, `untie.Untier` unties at the branch step with the arm's optimizer state."""
    model = build_model(spec.setup.width, spec.setup.layers, spec.setup.seed, ctx.vocab, 128, None)
    optimizer, scheduler = training.build_optimizer(model, spec.setup, spec.budget)
    untier = untie.Untier(model, max_steps=spec.budget, untie_at=spec.branch_step, untie_when=None, metrics_every=0,
                          optimizer_state=spec.spec.optimizer_state)  # fmt: skip
    untier.start(optimizer)
    steps = training.curve_steps(spec.budget, ctx.curve_points)
    recorder = CurveRecorder(model, optimizer, scheduler, ctx.curve_validation, steps, {}, lambda *_: None)
    recorder.hooks.append(lambda step: untier.step())
    order = data_order(len(ctx.corpus.train), spec.setup.seed)
    train_steps(model, optimizer, scheduler, spec.setup, ctx.corpus.train, order, 0, spec.budget, recorder)
    assert untier.untie_step == spec.branch_step
    return [recorder.losses[str(s)] for s in steps], evaluate(model, ctx.corpus.validation)


def test_a_branched_arm_equals_a_live_untie_at_its_step(small_corpus, tmp_path, tiny_cell):
    ctx = _ctx(small_corpus, tmp_path)
    records = runs.run_seed(ctx, "A", 1, {"tied": 4e-3, "untied": 2e-3}, 15, lambda *_: None)
    for arm in ("untie@1/3", "untie@2/3-fresh", "untie@0.95"):
        record = records[arm]
        spec = RunSpec("A", arm, ctx.setup("A", 1, 4e-3), 15)
        assert record.untie_step == spec.branch_step and record.lr == 4e-3  # the tied arm's rate, kept
        curve, final = _live_untie(ctx, spec)
        assert record.curve_validation == pytest.approx(curve, abs=1e-6)
        assert record.final_validation_loss == pytest.approx(final, abs=1e-6)
    assert records["untied"].lr == 2e-3 and records["copy0"].lr == 2e-3
    assert records["untie@1/3"].final_validation_loss != records["tied"].final_validation_loss
    assert sorted(p.name for p in (tmp_path / "checkpoints" / "A-s1-tied").iterdir()) == ["final.pt"]


def test_the_untied_arm_is_what_the_library_does_to_a_fresh_model_it_unties_at_step_0():
    """The study's untied arm is the model the library trains where it unties a fresh model before the first step
    (policy "untie-at-start", and the default's untied share bands): the same draw of the same head."""
    drawn = build_model(32, 1, 5, 300, 128, "drawn")
    torch.manual_seed(5)
    fresh = build_model(32, 1, 5, 300, 128, None)
    untier = untie.Untier(fresh, max_steps=10, policy="untie-at-start")
    untier.start(torch.optim.AdamW(fresh.parameters()))
    assert untier.run.untie_step == 0 and not untie.is_tied(fresh)
    assert torch.equal(fresh.lm_head.weight, drawn.lm_head.weight)
    assert torch.equal(fresh.model.embed_tokens.weight, drawn.model.embed_tokens.weight)


def test_the_tied_run_measures_the_default_trigger_without_acting(small_corpus, tmp_path, tiny_cell):
    ctx = _ctx(small_corpus, tmp_path)
    spec = RunSpec("A", "tied", ctx.setup("A", 1, 4e-3), 24)
    record = runs.train_run(ctx, spec, lambda *_: None)
    quiet = runs.train_run(_ctx(small_corpus, tmp_path / "quiet", trigger_config=None), spec, lambda *_: None)
    assert record.curve_validation == quiet.curve_validation  # measuring does not change training
    trigger = record.trigger
    assert [m["step"] for m in trigger["measurements"]] == list(range(2, 25, 2))
    assert trigger["rule"]["signal"] == "gap" and trigger["rule"]["significance"] is not None  # the evidence rule

    model = build_model(32, 1, 1, ctx.vocab, 128, None)  # the library's own trigger, acting, on the same run
    optimizer, scheduler = training.build_optimizer(model, spec.setup, spec.budget)
    config = untie.UntieConfig(policy="off", untie_at=None, metrics_every=2)
    untier = untie.Untier(model, config=config, max_steps=spec.budget, tokenizer=small_corpus.tokenizer)
    untier.start(optimizer)
    order = data_order(len(small_corpus.train), 1)
    train_steps(model, optimizer, scheduler, spec.setup, small_corpus.train, order, 0, spec.budget,
                lambda step, loss: untier.step())  # fmt: skip
    history = [h for h in untier.history if "trigger" in h]
    live = [(h["step"], None if math.isnan(h["trigger"]) else h["trigger"]) for h in history]
    watched = [(m["step"], m["average"]) for m in trigger["measurements"]][: len(live)]
    assert [step for step, _ in watched] == [step for step, _ in live]  # pytest 9's approx takes no nested pairs
    assert [value for _, value in watched] == pytest.approx([value for _, value in live])
    assert trigger["first_would_fire_step"] == untier.untie_step  # None where neither fired
    assert trigger["deadline_step"] == round(0.3 * 24)


def test_an_interrupted_run_resumes_to_the_record_an_uninterrupted_run_writes(small_corpus, tmp_path, tiny_cell):
    ctx = _ctx(small_corpus, tmp_path / "cut")
    spec = RunSpec("A", "tied", ctx.setup("A", 2, 4e-3), 14)
    calls = []

    def dies_after_step_6(steps, loss):
        calls.append(steps)
        if len(calls) == 6:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        runs.run_or_reuse(ctx, spec, dies_after_step_6)
    assert (tmp_path / "cut" / "checkpoints" / spec.name / "resume.pt").exists()
    resumed = runs.run_or_reuse(ctx, spec, lambda *_: None)
    whole = runs.run_or_reuse(_ctx(small_corpus, tmp_path / "whole"), spec, lambda *_: None)
    assert _without_time(resumed) == _without_time(whole)
    assert resumed.steps_run == 14 and len(resumed.trigger["measurements"]) == 7
    assert not (tmp_path / "cut" / "checkpoints" / spec.name / "resume.pt").exists()


@pytest.fixture
def recipe(small_corpus, monkeypatch):
    spec = importlib.util.spec_from_file_location("study_recipe", ROOT / "recipes" / "study.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "study_recipe", module)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "load_corpus", lambda sources, cache_dir, vocab_size: small_corpus)
    monkeypatch.setattr(module, "fetch_target_documents", lambda cache_dir: (TARGET_DOCS, {"package": "test.deb"}))
    return module


#: The fine-tuning's target in the tests: other words than the corpus's (a shifted domain), one "fortune" per line.
TARGET_WORDS = ("fortune", "cookie", "wise", "the", "a", "luck", "day", "smile")
TARGET_DOCS = [" ".join(TARGET_WORDS[(i * 7 + j * 3) % len(TARGET_WORDS)] for j in range(40)) + "." for i in range(200)]


def _args(tmp_path: Path, *extra: str) -> list[str]:
    return ["--output_dir", str(tmp_path / "out"), "--records_dir", str(tmp_path / "committed"),
            "--corpus_pin", str(tmp_path / "pin.json"), "--finetune_pin", str(tmp_path / "target-pin.json"),
            "--batch_size", "4", "--warmup", "2", "--curve_points", "4",
            "--curve_blocks", "8", "--disable_tqdm", *extra]  # fmt: skip


@pytest.mark.parametrize("flags", [["--seeds", "1", "31"], ["--sweep_seed", "32"], ["--cells", "B", "--seeds", "33"]])
def test_the_held_out_seeds_are_refused_without_the_held_out_flag(recipe, tmp_path, flags):
    with pytest.raises(SystemExit, match="reserved for the independent held-out evaluation"):
        recipe.main(_args(tmp_path, *flags))
    assert not (tmp_path / "out").exists()
    protocol.check_seeds("A", (31,), held_out=True)  # the held-out evaluation's own command passes


def test_the_recipe_runs_sweep_then_arms_records_and_reuses_them(recipe, tmp_path, tiny_cell, monkeypatch):
    results = recipe.main(_args(tmp_path, "--cells", "A", "--seeds", "1"))
    (group,) = results["groups"]
    table = group["cells"]["A"]
    assert table["seeds"] == [1] and set(table["arms"]) == set(TINY.arms)
    assert set(table["sweep"]) == {"tied", "untied"}
    assert group["finetune"]["seeds"] == [1] and set(group["finetune"]["arms"]) == set(finetune.ALL_FINETUNE_ARMS)
    names = sorted(str(p.relative_to(tmp_path / "committed")) for p in (tmp_path / "committed").rglob("*.json"))
    assert names == sorted(str(p.relative_to(tmp_path / "out" / "records"))
                           for p in (tmp_path / "out" / "records").rglob("*.json"))  # fmt: skip
    assert len([n for n in names if n.startswith("finetune/")]) == len(finetune.ALL_FINETUNE_ARMS)
    assert len([n for n in names if "-sweep-" in n]) >= 6
    assert json.loads((tmp_path / "pin.json").read_text())["blocks_sha256"] == group["corpus_digest"]
    monkeypatch.setattr(runs, "train_run", lambda *a, **k: pytest.fail("a finished run ran again"))
    monkeypatch.setattr(finetune, "finetune_run", lambda *a, **k: pytest.fail("a finished fine-tuning ran again"))
    again = recipe.main(_args(tmp_path, "--cells", "A", "--seeds", "1"))
    assert json.dumps(again, sort_keys=True) == json.dumps(results, sort_keys=True)
    changed = tmp_path / "out" / "records" / "finetune" / "A-ft-s1-default.json"
    changed.write_text(changed.read_text().replace('"steps": 300', '"steps": 200'))
    with pytest.raises(pytest.fail.Exception, match="a finished fine-tuning ran again"):  # other settings: run again
        recipe.main(_args(tmp_path, "--cells", "A", "--seeds", "1"))


def _records_without_time(folder: Path) -> dict[str, dict]:
    return {str(p.relative_to(folder)): {k: v for k, v in json.loads(p.read_text()).items()
                                         if k not in ("wall_seconds", "cpu_seconds")}
            for p in folder.rglob("*.json")}  # fmt: skip


def test_two_processes_given_one_rate_each_write_the_records_one_process_writes(recipe, tmp_path, tiny_cell):
    """`--rates untied` runs the untied sweep and the arms untied at step 0 only; `--rates tied` the rest (the tied
    sweep, run, branches and fine-tuning), in the same folder: together, what one process with both writes."""
    split, whole = tmp_path / "split", tmp_path / "whole"
    recipe.main(_args(split, "--cells", "A", "--seeds", "1", "--rates", "untied"))
    untied_only = _records_without_time(split / "out" / "records")
    arms = {name for name in untied_only if "-sweep-" not in name}
    sweeps = {name for name in untied_only if "-sweep-" in name}
    assert arms == {"A-s1-untied.json", "A-s1-copy0.json"}  # the arms untied at step 0, nothing of the tied side
    assert {f"A-sweep-untied-lr{lr:g}-s1.json" for lr in TINY.sweep_values()} <= sweeps
    assert all(name.startswith("A-sweep-untied-") for name in sweeps)  # (a best at an edge adds a value)
    recipe.main(_args(split, "--cells", "A", "--seeds", "1", "--rates", "tied"))
    recipe.main(_args(whole, "--cells", "A", "--seeds", "1"))
    tied_only = tmp_path / "tied-only"
    recipe.main(_args(tied_only, "--cells", "A", "--seeds", "1", "--rates", "tied"))
    names = set(_records_without_time(tied_only / "out" / "records"))
    assert not any("untied" in name or "copy0" in name for name in names)  # nothing of the untied side
    assert {"A-s1-tied.json", "A-s1-untie@1of3.json"} <= names and any(n.startswith("finetune/") for n in names)
    together = _records_without_time(split / "out" / "records")
    assert any(name.startswith("finetune/") for name in together)
    assert together == _records_without_time(whole / "out" / "records")
    with pytest.raises(SystemExit, match="--rates"):
        recipe.main(_args(split, "--rates", "both"))


def test_a_second_process_given_a_rate_that_runs_in_the_folder_is_refused(recipe, tmp_path):
    with recipe.rate_locks(tmp_path, ["tied"]):
        with recipe.rate_locks(tmp_path, ["untied"]):  # the other rate, beside it: allowed
            pass
        with pytest.raises(SystemExit, match="another process runs the tied rate's runs there"):
            with recipe.rate_locks(tmp_path, ["tied", "untied"]):
                pass
    with recipe.rate_locks(tmp_path, ["tied", "untied"]):  # released when the first one ends
        pass


def _record(seed: int, arm: str, final: float, cpu: str = "CPU X", digest: str = "d1") -> StudyRecord:
    return StudyRecord(
        name=f"A-s{seed}-{arm}", cell="A", arm=arm, kind="arm", seed=seed, lr=1e-3, budget_steps=100,
        untie_step=None, head=None, optimizer_state="copy", curve_steps=[50, 100], curve_validation=[final + 1, final],
        curve_train=[0.0, 0.0], final_validation_loss=final, train_loss_tail=0.0, steps_run=100, tokens=100 * 1024,
        wall_seconds=1.0, cpu_seconds=1.0, setup={"batch_size": 8}, params=10, embedding_params=8,
        tokens_per_embedding_row=1.0,
        machine={"cpu": cpu, "kernel_path": "AVX2", "device": "cpu", "torch": "2", "threads": 1},
        corpus_digest=digest,
    )  # fmt: skip


def test_records_of_another_corpus_build_or_cpu_kind_are_not_pooled(tmp_path):
    base = [_record(1, "tied", 5.0), _record(1, "untied", 5.1)]
    other_cpu = _record(2, "tied", 4.0, cpu="CPU Y")
    other_corpus = _record(3, "tied", 4.5, digest="d2")
    groups = stats.pool_groups([*base, other_cpu, other_corpus])
    assert sorted(len(g) for g in groups.values()) == [1, 1, 2]
    stats.check_poolable(base)
    for stranger in (other_cpu, other_corpus):
        with pytest.raises(ValueError, match="cannot be pooled"):
            stats.check_poolable([*base, stranger])
    results = report.write_report(tmp_path, [*base, other_cpu, other_corpus])
    assert sorted(g["cpu"] for g in results["groups"]) == ["CPU X", "CPU X", "CPU Y"]
    assert {g["corpus_digest"] for g in results["groups"]} == {"d1", "d2"}


def test_the_paired_t_interval_matches_a_hand_computed_example():
    # mean -0.2, sd 0.1, n 3: t(0.975, 2) = 4.303, half-width 4.303 * 0.1 / sqrt(3) = 0.24843
    interval = stats.t_interval([-0.1, -0.2, -0.3])
    assert interval["mean"] == pytest.approx(-0.2) and interval["sd"] == pytest.approx(0.1)
    assert (interval["low"], interval["high"]) == pytest.approx((-0.44843, 0.04843), abs=1e-5)
    assert not stats.below_zero(interval) and not stats.above_zero(interval)
    # n 4: mean 2.5, sd 1.29099, t(0.975, 3) = 3.182: half-width 2.05397
    interval = stats.t_interval([1.0, 2.0, 3.0, 4.0])
    assert (interval["low"], interval["high"]) == pytest.approx((0.44603, 4.55397), abs=1e-5)
    assert stats.above_zero(interval)
    assert stats.t_interval([0.5])["low"] is None
    diverged = stats.t_interval([0.1, math.nan, 0.2])
    assert math.isnan(diverged["mean"]) and diverged["low"] is None and not stats.below_zero(diverged)


def test_tokens_to_reach_a_loss_interpolate_the_curve():
    steps, losses = [10, 20, 30], [5.0, 4.0, 3.0]
    assert stats.tokens_to_reach(steps, losses, 3.5, 100) == pytest.approx(2500.0)
    assert stats.tokens_to_reach(steps, losses, 5.5, 100) == pytest.approx(1000.0)
    assert stats.tokens_to_reach(steps, losses, 2.0, 100) is None


def test_the_lr_sweep_extends_one_value_beyond_an_edge(monkeypatch, tmp_path, small_corpus):
    assert protocol.next_sweep_value({1.0: 3.0, 2.0: 3.1, 4.0: 3.2}) == 0.5
    assert protocol.next_sweep_value({1.0: 3.2, 2.0: 3.1, 4.0: 3.0}) == 8.0
    assert protocol.next_sweep_value({1.0: 3.2, 2.0: 3.0, 4.0: 3.1}) is None
    assert protocol.next_sweep_value({1.0: 3.2, 2.0: 3.1, 4.0: math.nan}) is None  # a diverged run is the worst
    ran = []

    def fake_run(ctx, spec, progress, tied=None):  # the loss falls with the rate: the best is the largest
        ran.append((spec.arm, spec.setup.learning_rate, spec.budget))
        record = _record(1, spec.arm, 10.0 - spec.setup.learning_rate * 100)
        return dataclasses.replace(record, kind="sweep", lr=spec.setup.learning_rate)

    monkeypatch.setattr(sweep, "run_or_reuse", fake_run)
    summaries = sweep.run_sweep(_ctx(small_corpus, tmp_path), "A", 1, 100, lambda *_: None)
    assert [lr for arm, lr, _ in ran if arm == "tied"] == pytest.approx([1.5e-3, 3e-3, 6e-3, 1.2e-2])
    assert {budget for *_, budget in ran} == {50}  # half the budget
    assert summaries["tied"].best == pytest.approx(1.2e-2) and summaries["tied"].extended == [pytest.approx(1.2e-2)]
    assert summaries["tied"].at_edge  # one extension only: still at the edge, and the note says so
    assert "still sits at an edge" in summaries["tied"].note()
    one = dataclasses.replace(_record(1, "tied", 4.0), kind="sweep", lr=3e-3)
    assert sweep.summarize("A", "tied", [one]).note() == "in progress: 2 of the first 3 values to run"


def test_the_device_tier_stops_at_its_time_limit_and_the_next_call_continues_to_the_same_records(
    recipe, small_corpus, tmp_path, monkeypatch
):
    """The device preset on the CPU at tiny shapes, from an exported corpus, with a clock that ticks once per read:
    each call stops at its limit and the calls together write the records one unlimited call writes."""
    cell = dataclasses.replace(TINY, name="D64x2t4", tokens_per_parameter=1.2)
    monkeypatch.setitem(protocol.CELLS, "D64x2t4", cell)
    exported = tmp_path / "corpus"
    from untie_recipes.tasks.study import corpus_files, provenance

    corpus_files.export_corpus(small_corpus, exported, {"sources": ["test"], **{"blocks_sha256":
                               provenance.blocks_digest(small_corpus)}})  # fmt: skip
    ticks = iter(range(10**6))
    monkeypatch.setattr(training, "CLOCK", lambda: float(next(ticks)))

    def call(name: str, limit: str) -> None:
        recipe.main(["--preset", "device", "--device", "cpu", "--corpus_dir", str(exported), "--cells", "D64x2t4",
                     "--seeds", "1", "--batch_size", "16", "--warmup", "2", "--curve_points", "4", "--curve_blocks",
                     "8", "--time_limit", limit, "--output_dir", str(tmp_path / name), "--records_dir",
                     str(tmp_path / f"{name}-committed"), "--corpus_pin", str(tmp_path / "pin.json"),
                     "--disable_tqdm"])  # fmt: skip

    calls = 0
    while len(list((tmp_path / "cut-committed").glob("*-s1-*.json"))) < len(cell.arms):
        call("cut", "7")  # shorter than any run of the cell: every run stops and resumes
        calls += 1
        assert calls < 60
    call("whole", "0")
    cut = {p.name: _without_time(StudyRecord.load(p)) for p in (tmp_path / "cut" / "records").glob("*.json")}
    whole = {p.name: _without_time(StudyRecord.load(p)) for p in (tmp_path / "whole" / "records").glob("*.json")}
    assert calls > 3 and cut == whole
    tied = whole["D64x2t4-s1-tied.json"]
    assert tied["epochs"] > 1 and tied["setup"]["batch_size"] == 16  # a budget past the corpus reads it again
    assert small_corpus.train.shape == corpus_files.load_exported(exported)[0].train.shape


def test_fine_tuning_starts_from_the_checked_tied_checkpoint_and_each_arm_unties_where_it_says(
    recipe, tmp_path, tiny_cell, monkeypatch
):
    """Each fine-tuning arm starts from the tied run's final weights (its loss before is the tied record's final
    loss), trains on the target (its loss there falls) and unties where its arm says: never, before the first step,
    at half, or where the live default `Untier` decided (by its deadline at 30% at the latest)."""
    embeddings: list[tuple[torch.Tensor, torch.Tensor, bool]] = []  # per arm run: before, after, untied
    train = finetune.train_steps

    def watched(model, *args, **kwargs):
        before = model.get_input_embeddings().weight.detach().clone()
        train(model, *args, **kwargs)
        untied = model.get_output_embeddings().weight is not model.get_input_embeddings().weight
        embeddings.append((before, model.get_input_embeddings().weight.detach().clone(), untied))

    monkeypatch.setattr(finetune, "train_steps", watched)
    recipe.main(_args(tmp_path, "--cells", "A", "--seeds", "1"))
    tied = StudyRecord.load(tmp_path / "out" / "records" / "A-s1-tied.json")
    records = {r.arm: r for r in finetune.load_finetune_records(tmp_path / "out" / "records" / "finetune")}
    assert set(records) == set(finetune.ALL_FINETUNE_ARMS)
    moved = {arm: (after - before).norm().item() for arm, (before, after, _) in
             zip(finetune.ALL_FINETUNE_ARMS, embeddings, strict=True)}  # fmt: skip
    assert moved["untie-now-frozen"] == 0.0 and 0.0 < moved["untie-now-emb0.1"] < moved["untie-now"] / 3
    assert all(untied for _, _, untied in embeddings[-2:])  # round two's arms: untied, the embedding at its scale
    assert records["untie-now-frozen"].untie_step == records["untie-now-emb0.1"].untie_step == 0
    for record in records.values():
        assert record.source_before == pytest.approx(tied.final_validation_loss, abs=1e-6)
        assert record.target_loss < record.target_before - 0.5  # it learned the target
        assert record.lr == pytest.approx(tied.lr / finetune.LR_DIVISOR) and record.steps == finetune.FINETUNE_STEPS
    assert records["stay-tied"].untie_step is None and records["untie-now"].untie_step == 0
    assert records["untie@1/2"].untie_step == finetune.HALF_STEP == 150
    default = records["default"]
    assert default.untie_step is not None and 0 < default.untie_step <= 90  # tied first: the registered default
    assert default.untie_reason in ("trigger", "deadline")
    assert len({r.target_loss for r in records.values()}) == len(records)  # the arms differ


def test_a_lost_tied_checkpoint_is_trained_again_and_a_foreign_one_is_refused(recipe, tmp_path, tiny_cell, monkeypatch):
    """Where the final checkpoint is gone, the tied run is trained again and the fine-tuning records repeat; a
    checkpoint whose weights are not the tied run's final ones is refused before any fine-tuning."""
    recipe.main(_args(tmp_path, "--cells", "A", "--seeds", "1", "--records_dir", ""))
    folder = tmp_path / "out" / "records" / "finetune"
    first = {p.name: p.read_text() for p in folder.glob("*.json")}
    final = tmp_path / "out" / "checkpoints" / "A-s1-tied" / "final.pt"
    final.unlink()
    for path in folder.glob("*.json"):
        path.unlink()
    recipe.main(_args(tmp_path, "--cells", "A", "--seeds", "1", "--records_dir", ""))
    again = {p.name: p.read_text() for p in folder.glob("*.json")}

    def without_time(text: str) -> dict:
        return {k: v for k, v in json.loads(text).items() if k not in ("wall_seconds", "cpu_seconds")}

    assert {k: without_time(v) for k, v in again.items()} == {k: without_time(v) for k, v in first.items()}
    checkpoint = torch.load(final, weights_only=True)
    checkpoint["model"]["model.norm.weight"] += 0.01
    torch.save(checkpoint, final)
    (folder / "A-ft-s1-untie-now.json").unlink()
    with pytest.raises(RuntimeError, match="is not that run's final checkpoint"):
        recipe.main(_args(tmp_path, "--cells", "A", "--seeds", "1", "--records_dir", ""))
    # A record made on another kernel path: refused before the retraining (an AMD EPYC without AVX-512 trained cell
    # A's tied run again for 21 minutes, then refused it), not after it.
    final.unlink()
    tied_record = tmp_path / "out" / "records" / "A-s1-tied.json"
    record = json.loads(tied_record.read_text())
    tied_record.write_text(json.dumps({**record, "machine": {**record["machine"], "kernel_path": "ANOTHER"}}))
    trained = []
    monkeypatch.setattr(finetune, "evaluate", lambda *a: trained.append(a) or pytest.fail("it trained again"))
    with pytest.raises(RuntimeError, match="kernel_path 'ANOTHER' there"):
        recipe.main(_args(tmp_path, "--cells", "A", "--seeds", "1", "--records_dir", ""))
    assert not final.exists()


def test_a_kinds_own_fine_tuning_trains_its_tied_runs_here_and_leaves_the_studys_records_alone(
    recipe, tmp_path, tiny_cell, monkeypatch
):
    """Cell A's committed tied runs were made on a kind this machine is not (an AMD EPYC with AVX-512): refused for a
    retraining, so `--finetune_here` trains each seed's tied run on this kind (at the study's swept rate, its sweep
    reused), under kinds/<kind>/, then every fine-tuning arm from it; the study's own records stay as they were."""
    recipe.main(_args(tmp_path, "--cells", "A", "--seeds", "1"))
    committed = tmp_path / "committed"
    before = {p: p.read_text() for p in committed.rglob("*.json")}
    here = ["--cells", "A", "--seeds", "1", "--finetune_here", "--output_dir", str(tmp_path / "other")]
    with pytest.raises(SystemExit, match="was recorded on this machine's kind .* run it without --finetune_here"):
        recipe.main(_args(tmp_path, *here))  # the study's own kind: its fine-tuning is the study's, not a kind's
    machine = recipe.machine_facts
    monkeypatch.setattr(recipe, "machine_facts", lambda *a: {**machine(*a), "kernel_path": "OTHER"})
    trained: list[str] = []
    train_run = runs.train_run
    monkeypatch.setattr(runs, "train_run", lambda ctx, spec, *a: trained.append(spec.name) or train_run(ctx, spec, *a))
    results = recipe.main(_args(tmp_path, *here))
    assert trained == ["A-s1-tied"]  # the sweep reused, no branch, no untied arm
    assert {p: p.read_text() for p in before} == before
    kind = provenance.kind_folder({**machine(torch.device("cpu"), ROOT), "kernel_path": "OTHER"})
    own = committed / finetune.KINDS / kind
    assert sorted(p.name for p in own.glob("*.json")) == ["A-s1-tied.json"]
    tied = StudyRecord.load(own / "A-s1-tied.json")
    assert tied.machine["kernel_path"] == "OTHER" and not any(p.name.startswith("step") for p in
                                                              (tmp_path / "other").rglob("*.pt"))  # fmt: skip
    records = finetune.load_finetune_records(own / "finetune")
    assert sorted(r.arm for r in records) == sorted(finetune.ALL_FINETUNE_ARMS)
    assert all(r.source_before == pytest.approx(tied.final_validation_loss, abs=1e-6) for r in records)
    loaded = results["round_two"]["loaded"]["A"]
    assert loaded["groups"] == 2 and set(loaded["arms"]) == set(finetune.ALL_FINETUNE_ARMS)
    (group,) = results["groups"]  # the study's own pretraining group keeps its own fine-tuning table only
    own_seconds = sum(finetune.FineTuneRecord.load(p).cpu_seconds for p in committed.glob("finetune/*.json"))
    assert group["finetune"]["core_hours"] == pytest.approx(own_seconds / 3600)
    assert "| A (1; " in (tmp_path / "other" / "round-two.md").read_text()  # the kind beside the cell
    monkeypatch.setattr(runs, "train_run", lambda *a, **k: pytest.fail("a finished run ran again"))
    monkeypatch.setattr(finetune, "finetune_run", lambda *a, **k: pytest.fail("a finished fine-tuning ran again"))
    recipe.main(_args(tmp_path, *here))  # a rerun (another sitting) reuses every record
    with pytest.raises(SystemExit, match="--finetune_here fine-tunes the tied runs of cells"):
        recipe.main(_args(tmp_path, "--cells", "B", "--finetune_here"))


def _tuned(seed: int, arm: str, cpu: str) -> finetune.FineTuneRecord:
    return finetune.FineTuneRecord(
        name=finetune.finetune_name("A", seed, arm), cell="A", arm=arm, seed=seed, lr=1e-3, steps=300, batch_size=8,
        untie_step=None, untie_reason=None, pretrained_run=f"A-s{seed}-tied", target_before=6.0, source_before=5.0,
        target_loss=4.0 + seed / 100, source_loss=5.0, train_loss_tail=4.0, wall_seconds=1.0, cpu_seconds=1.0,
        machine={"cpu": cpu, "kernel_path": "AVX2", "device": "cpu", "torch": "2"}, corpus_digest="d",
        target_digest="t", epochs=0.3,
    )  # fmt: skip


def test_the_loaded_rule_reads_the_cpu_kind_whose_table_has_every_arm_not_merely_the_most_records():
    four = [_tuned(s, arm, "CPU X") for s in range(1, 6) for arm in finetune.FINETUNE_ARMS]  # 20 records, 4 arms
    six = [_tuned(s, arm, "CPU Y") for s in (1, 2, 3) for arm in finetune.ALL_FINETUNE_ARMS]  # 18 records, 6 arms
    chosen = report.loaded_group([*four, *six])
    assert (chosen["cpu"], chosen["groups"], chosen["seeds"]) == ("CPU Y", 2, [1, 2, 3])
    assert set(chosen["arms"]) == set(finetune.ALL_FINETUNE_ARMS)
    assert report.loaded_group(four)["cpu"] == "CPU X"  # one kind: its table, whatever it holds
    # A seed stopped between its arms (a sitting's time limit) takes nothing from its kind: seeds 1-2 whole beat one.
    partial = [_tuned(s, arm, "CPU Z") for s in (1, 2) for arm in finetune.ALL_FINETUNE_ARMS]
    partial += [_tuned(3, arm, "CPU Z") for arm in finetune.FINETUNE_ARMS]
    assert report.loaded_group([*partial, *six[:6]])["cpu"] == "CPU Z"
    # As a kind's seeds land one arm at a time beside a complete four-arm kind, the choice moves once and stays.
    landed, chosen_kinds = [], []
    for record in six:
        landed.append(record)
        chosen_kinds.append(report.loaded_group([*four, *landed])["cpu"])
    first = chosen_kinds.index("CPU Y")
    assert first == len(finetune.ALL_FINETUNE_ARMS) - 1 and set(chosen_kinds[first:]) == {"CPU Y"}


def test_a_kinds_own_fine_tuning_is_read_by_the_loaded_rule_only_never_by_a_pretraining_groups_table(tmp_path):
    """A kind with pretraining records of its own (cell B's on a Xeon) and cell A's fine-tuning made there by
    --finetune_here: the Xeon group's table and verdict must not take that fine-tuning in."""
    pretraining = [_record(1, "tied", 5.0, cpu="CPU Y"), _record(1, "untied", 5.1, cpu="CPU Y")]
    tuned = [dataclasses.replace(r, corpus_digest="d1") for r in
             (_tuned(s, arm, "CPU Y") for s in (1, 2, 3) for arm in finetune.ALL_FINETUNE_ARMS)]  # fmt: skip
    results = report.write_report(tmp_path, pretraining, (), tuned)
    (group,) = results["groups"]
    assert group["finetune"]["seeds"] == [] and group["finetune"]["arms"] == {}
    assert results["round_two"]["loaded"]["A"]["seeds"] == [1, 2, 3]
    machine = {"cpu": "AMD EPYC", "kernel_path": "AVX2", "device": "cpu", "torch": "2.13.0+cpu"}
    assert provenance.kind_folder(machine) == "amd-epyc-avx2-torch-2-13-0-cpu"
    assert provenance.kind_folder({**machine, "torch": "2.14.0+cpu"}) != provenance.kind_folder(machine)


def test_a_tied_run_recorded_on_another_kernel_path_is_refused_before_it_trains_again(monkeypatch):
    """Cell B's untie@0.9 needs its tied run again; on an AMD EPYC without AVX-512 (the record's had it) the run
    trained for 40 minutes before the final loss told. The machine facts tell at once."""
    kept = _record(1, "tied", 4.0)
    here = {**kept.machine, "kernel_path": "AVX512"}
    monkeypatch.setattr(runs, "train_run", lambda *a: pytest.fail("it trained again"))
    context = dataclasses.make_dataclass("Context", ["machine"])(here)
    spec = dataclasses.make_dataclass("Spec", ["name"])("A-s1-tied")
    with pytest.raises(RuntimeError, match="kernel_path 'AVX2' there, 'AVX512' here"):
        runs._tied_again(context, spec, kept, lambda *a: None)
    assert provenance.repeat_refusal(kept.machine, {**kept.machine, "git_commit": "x", "cores": 16}, "r") is None
    assert "threads 1 there, 2 here" in provenance.repeat_refusal(kept.machine, {**kept.machine, "threads": 2}, "r")


def _finetune_table(target: dict[str, list[float]], source: dict[str, list[float]]) -> dict:
    def row(values: dict[str, list[float]], arm: str) -> dict:
        diffs = [a - b for a, b in zip(values[arm], values["stay-tied"], strict=True)]
        return {"mean": sum(values[arm]) / 3, "vs_stay_tied": stats.t_interval(diffs)}

    arms = {arm: {"target": row(target, arm), "source": row(source, arm)} for arm in finetune.FINETUNE_ARMS}
    return {"seeds": [1, 2, 3], "arms": arms}


def test_the_loaded_model_rule_takes_the_best_target_among_arms_that_forget_no_more_than_staying_tied():
    same = [3.0, 3.1, 3.2]
    target = {"stay-tied": [3.0, 3.1, 3.2], "untie-now": [2.5, 2.6, 2.7], "default": [2.8, 2.9, 3.0],
              "untie@1/2": [2.9, 3.0, 3.1]}  # fmt: skip
    source = {arm: list(same) for arm in finetune.FINETUNE_ARMS}
    assert verdict.loaded_verdict(_finetune_table(target, source)).startswith("untie at once")
    source["untie-now"] = [3.3, 3.41, 3.5]  # forgets more than staying tied, at 95%: left out
    former = "the former default (tied, then the trigger"
    assert verdict.loaded_verdict(_finetune_table(target, source)).startswith(former)
    source = {arm: [4.0, 4.1, 4.2] for arm in finetune.FINETUNE_ARMS}
    source["stay-tied"] = list(same)  # every other arm forgets more: stay tied
    assert verdict.loaded_verdict(_finetune_table(target, source)).startswith("stay tied")
    assert verdict.loaded_verdict({"seeds": [1, 2]}).startswith("pending")


def _cell_table(cell: str, seeds: int, below: tuple[str, ...] = ()) -> dict:
    """A cell's table: every tied-phase arm (and the copy at step 0) above untied, save `below`."""
    arms = {}
    for arm in protocol.CELLS[cell].arms:
        shift = -0.1 if arm in below else 0.1
        arms[arm] = {"vs_untied": stats.t_interval([shift + 0.01 * i for i in range(seeds)])}
    return {"seeds": list(range(1, seeds + 1)), "arms": arms}


def test_the_fresh_model_rule_answers_as_soon_as_the_complete_cells_allow():
    """Rule 1 needs an interval below 0 in both cells: once complete cells leave no arm that could qualify, the
    answer is untied from step 0 whatever the cell in progress shows; the copy question reads cell A alone."""
    decided = verdict.verdict({"A": _cell_table("A", 3), "B": _cell_table("B", 1)})
    assert decided["fresh_model"].startswith("untied from step 0") and "decided by cell A" in decided["why"]
    assert decided["copy_at_step_0"].startswith("costly")  # copy0 above the drawn head in cell A
    only_a = verdict.verdict({"A": _cell_table("A", 3, below=("untie@2/3-fresh",)), "B": _cell_table("B", 0)})
    assert only_a["fresh_model"].startswith("untied from step 0")  # an arm cell B leaves out cannot qualify
    assert "no tied-phase arm that both cells run" in only_a["why"]
    diverged = _cell_table("A", 3)
    diverged["arms"]["untie@1/3"]["vs_untied"] = stats.t_interval([math.nan] * 3)
    del diverged["arms"]["copy0"]
    waiting = verdict.verdict({"A": diverged, "B": _cell_table("B", 1)})
    assert waiting["fresh_model"] == "pending" and waiting["copy_at_step_0"].startswith("pending")  # decides nothing
    assert verdict.verdict({"A": diverged, "B": _cell_table("B", 3)})["fresh_model"].startswith("untied from step 0")
    open_ = verdict.verdict({"A": _cell_table("A", 3, below=("untie@1/3", "copy0")), "B": _cell_table("B", 2)})
    assert open_["fresh_model"] == "pending" and open_["copy_at_step_0"].startswith("acceptable")
    both = verdict.verdict({c: _cell_table(c, 3, below=("untie@1/3", "untie@2/3")) for c in ("A", "B")})
    assert both["fresh_model"] == "a tied phase to 0.333 of the run (untie@1/3)"
    assert verdict.verdict({"A": _cell_table("A", 2), "B": {}})["copy_at_step_0"] == "pending"


def test_the_summary_gives_each_choice_against_untied_in_pretraining_and_against_staying_tied_in_fine_tuning(
    tmp_path,
):
    """The one-screen page's table: per choice, the paired difference (with its interval from 2 seeds on), the
    reference arms named, a cell without records pending, and fine-tuning's rows from its own records."""
    records = []
    for seed, shift in ((1, 0.0), (2, 0.02)):
        for offset, arm in enumerate(protocol.CELLS["A"].arms):
            records.append(dataclasses.replace(_record(seed, arm, 4.0 + offset * 0.1 + shift), arm=arm,
                                               name=f"A-s{seed}-{arm}"))  # fmt: skip
    tuned = [
        finetune.FineTuneRecord(
            name=f"ft-{seed}-{arm}", cell="A", arm=arm, seed=seed, lr=1e-3, steps=300, batch_size=8, untie_step=None,
            untie_reason=None, pretrained_run="A-s1-tied", target_before=6.0, source_before=4.0,
            target_loss=5.0 - index * 0.01 * seed, source_loss=4.1, train_loss_tail=5.0, wall_seconds=1.0,
            cpu_seconds=1.0, machine=records[0].machine, corpus_digest="d1", target_digest="t", epochs=0.4,
        )
        for seed in (1, 2) for index, arm in enumerate(finetune.FINETUNE_ARMS)
    ]  # fmt: skip
    report.write_report(tmp_path, records, tuned)
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ")[1:] for line in
            (tmp_path / "summary.md").read_text().splitlines() if line.startswith("| ")}  # fmt: skip
    assert rows["stay tied"][0] == "-0.100 [-0.100, -0.100]" and rows["stay tied"][1] == "pending"
    assert rows["untie at once, head drawn"][:2] == ["reference", "pending"]  # cell B has no seeds yet
    assert rows["untie at once, head a copy"][0].startswith("+0.100 [") and rows["untie at once, head a copy"][1] == "-"
    assert rows["stay tied"][2:] == ["reference", "reference |"]
    assert rows["untie at once, head a copy"][2].startswith("-0.015 [")  # untie-now: -0.01 then -0.02
    former = "the former default on a loaded tied model (the trigger, or the deadline at 30%)"
    assert rows[former][2].startswith("-0.030 [")
    assert "pending" in rows["a model trained from scratch"][0]  # cell B has no seeds: the rule waits


def test_a_cell_whose_sweep_has_begun_is_reported_beside_a_cell_whose_sweep_is_done(tmp_path):
    """Cell B's first sweep record beside cell A's whole sweep: each cell's sweep reads its own records only."""
    records = [dataclasses.replace(_record(1, arm, 4.0 + lr), kind="sweep", lr=lr * 1e-3, name=f"A-{arm}-{lr}")
               for arm in ("tied", "untied") for lr in (1.5, 3.0, 6.0)]  # fmt: skip
    records.append(dataclasses.replace(_record(1, "tied", 4.4), cell="B", kind="sweep", lr=1e-3, name="B-tied"))
    results = report.write_report(tmp_path, records)
    cells = results["groups"][0]["cells"]
    assert set(cells["A"]["sweep"]) == {"tied", "untied"} and set(cells["B"]["sweep"]) == {"tied"}
    assert cells["B"]["sweep"]["tied"]["note"] == "in progress: 2 of the first 3 values to run"


def test_the_device_tier_imports_without_datasets():
    """The lent GPU machines have no `datasets` (KINDS.md's package list): the study's recipe, run on an exported
    corpus, must not import it (the decision map's corpus reads the shipped plays through it only when it builds)."""
    code = (
        "import sys, runpy; sys.modules['datasets'] = None; "
        "runpy.run_path('recipes/study.py', run_name='imported')"
    )  # its imports, not its main()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]


def test_round_two_sweeps_the_embedding_scale_then_runs_its_arm_and_the_branch_at_0_9(recipe, tmp_path, monkeypatch):
    """Issue 77: the scale sweep (k = 1, 4, 16 at the untied rate, half budget, extended at an edge) through the
    library's role groups, the best k's arm per seed, and the tied run trained again (its record kept) for the new
    branch at 0.9; round one's report is unchanged by round two's records."""
    tiny = dataclasses.replace(TINY, round_two=("untie@0.9",), scale_sweep=True)
    monkeypatch.setitem(protocol.CELLS, "A", tiny)
    first = recipe.main(_args(tmp_path, "--cells", "A", "--seeds", "1", "--finetune", "false"))
    committed = {p.name: p.read_text() for p in (tmp_path / "committed").glob("*.json")}
    for path in (tmp_path / "out" / "checkpoints").rglob("step*.pt"):
        path.unlink()
    seen = []
    split = runs.RoleRates.split

    def spy(self, optimizer, *args, **kwargs):
        split(self, optimizer, *args, **kwargs)
        seen.append((self.scales["input_embedding"], [g.get("untie_role") for g in optimizer.param_groups]))

    monkeypatch.setattr(runs.RoleRates, "split", spy)
    second = recipe.main(_args(tmp_path, "--cells", "A", "--seeds", "1", "--finetune", "false", "--round_two"))
    records = {p.stem: StudyRecord.load(p) for p in (tmp_path / "committed").glob("*.json")}
    scales = sorted(float(name.split("-emb")[1].split("-lr")[0]) for name in records if "-sweep-untied-emb" in name)
    assert {1.0, 4.0, 16.0} <= set(scales) and len(scales) <= 4  # k = 1 run under its own name; one extension
    assert {k for k, _ in seen} >= {4.0, 16.0} and all(roles == [None, "input_embedding"] for _, roles in seen)
    assert records["A-s1-untie@0.9"].untie_step == protocol.untie_step(0.9, records["A-s1-tied"].budget_steps)
    untied_lr = first["groups"][0]["cells"]["A"]["sweep"]["untied"]["best"]
    losses = {k: records[f"A-sweep-untied-emb{k:g}-lr{untied_lr:g}-s1"].final_validation_loss for k in scales}
    k1 = records[f"A-sweep-untied-emb1-lr{untied_lr:g}-s1"].final_validation_loss  # trains as untied does
    assert k1 == records[f"A-sweep-untied-lr{untied_lr:g}-s1"].final_validation_loss
    best = protocol.best_value(losses)
    arm = [name for name in records if name.startswith("A-s1-untied-emb")]
    assert arm == ([] if best == 1.0 else [f"A-s1-untied-emb{best:g}"])
    for name, text in committed.items():  # round one's records stay as they were (the tied run's included)
        assert (tmp_path / "committed" / name).read_text() == text, name
    second["groups"][0]["cells"]["A"].pop("round_two_core_hours")
    assert json.dumps(second["groups"][0]["cells"], sort_keys=True) == json.dumps(first["groups"][0]["cells"],
                                                                                   sort_keys=True)  # fmt: skip


def test_cell_b_scale_sweep_chooses_k_for_the_other_cells_once_complete():
    def run(arm: str, lr: float, final: float) -> StudyRecord:
        return dataclasses.replace(_record(1, arm, final), cell="B", kind="sweep", lr=lr)

    records = [run("untied", 1e-3, 4.40), run("untied", 2e-3, 4.46), run("untied", 5e-4, 4.51)]
    records += [run("untied", 4e-3, 4.55), run("untied-emb1", 1e-3, 4.40), run("untied-emb4", 1e-3, 4.35)]
    assert sweep.scale_choice(records) is None  # 16 not run yet
    records.append(run("untied-emb16", 1e-3, 4.30))
    assert sweep.scale_choice(records) is None  # the best at an edge: 64 first
    records.append(run("untied-emb64", 1e-3, 4.38))
    assert sweep.scale_choice(records) == 16.0
    records[-1] = dataclasses.replace(records[-1], machine={**records[-1].machine, "cpu": "CPU Y"})
    assert sweep.scale_choice(records) is None  # one k on another CPU kind: not compared
    assert protocol.scaled_arm(16.0) == "untied-emb16" and protocol.arm_spec("untied-emb16").embedding_scale == 16.0
    assert protocol.CELLS["C"].arms == protocol.CELL_C_ARMS and protocol.CELL_VOCABS["C"] == 2048
    protocol.check_seeds("C", (1, 2, 3), held_out=False)
    with pytest.raises(SystemExit, match="reserved"):
        protocol.check_seeds("C", (31,), held_out=False)


# -- the device tier's share ladder (issue 77, item 6) -----------------------------------------------------------------
def test_the_ladders_cells_hold_about_25_57_and_84_percent_of_their_parameters_in_the_embedding():
    shares = [runs.cell_plan(cell, protocol.CELL_VOCABS[cell], 32)["embedding_share"] for cell in protocol.LADDER_CELLS]
    assert protocol.LADDER_CELLS[0] == "L4k"  # the most informative share first
    assert [round(share, 2) for share in shares] == [0.25, 0.57, 0.84]
    assert {protocol.CELLS[cell].width for cell in protocol.LADDER_CELLS} == {256}


def test_the_ladder_carries_its_text_once_and_each_vocabulary_cuts_the_blocks_it_pinned(tmp_path):
    from untie_recipes.tasks.study import corpus_files, provenance

    texts, calls = small_texts(), []

    def documents() -> list[str]:
        calls.append(1)
        return texts

    built = {}
    for vocab in (300, 320):
        corpus = corpus_module.build_corpus(texts, ("test",), vocab_size=vocab)
        built[vocab] = corpus
        pin = {"sources": ["test"], "blocks_sha256": provenance.blocks_digest(corpus)}
        corpus_files.export_ladder(documents, corpus, tmp_path / "ladder", pin, vocab)
    assert len(calls) == 1  # the text is written once, beside every vocabulary
    for vocab, corpus in built.items():
        cut, _ = corpus_files.load_ladder(tmp_path / "ladder", vocab)  # by the size asked for, as the device asks
        assert torch.equal(cut.train, corpus.train) and torch.equal(cut.validation, corpus.validation)
    with pytest.raises(SystemExit, match="no 999-token vocabulary"):
        corpus_files.load_ladder(tmp_path / "ladder", 999)
    other = corpus_module.build_corpus(texts[1:], ("test",), vocab_size=340)  # the carried text is another build's
    pin = {"sources": ["test"], "blocks_sha256": provenance.blocks_digest(other)}
    with pytest.raises(SystemExit, match="do not match its pin"):
        corpus_files.export_ladder(documents, other, tmp_path / "ladder", pin, 340)


def test_a_ladder_cell_trains_every_arm_from_the_carried_text(recipe, small_corpus, tmp_path, monkeypatch):
    """On the CPU at a tiny shape: the cell's text and tokenizer exported, then its one process per rate from them."""
    monkeypatch.setitem(protocol.CELLS, "L4k", dataclasses.replace(TINY, name="L4k", arms=protocol.LADDER_ARMS))
    monkeypatch.setattr(recipe, "documents", lambda sources, cache_dir: small_texts())
    common = ["--preset", "ladder", "--cells", "L4k", "--vocab_size", str(len(small_corpus.tokenizer)),
              "--corpus_pin", str(tmp_path / "pin.json")]  # fmt: skip
    recipe.main([*common, "--export_corpus", str(tmp_path / "ladder")])
    assert json.loads((tmp_path / "pin.json").read_text())["blocks_sha256"] == provenance_digest(small_corpus)
    for rate in ("tied", "untied"):
        recipe.main([*common, "--device", "cpu", "--corpus_dir", str(tmp_path / "ladder"), "--rates", rate,
                     "--seeds", "1", "--batch_size", "4", "--warmup", "2", "--curve_points", "4", "--curve_blocks",
                     "8", "--time_limit", "0", "--output_dir", str(tmp_path / "out"), "--records_dir",
                     str(tmp_path / "committed"), "--disable_tqdm"])  # fmt: skip
    names = {path.name for path in (tmp_path / "committed").glob("L4k-s1-*.json")}
    assert names == {f"L4k-s1-{arm.replace('/', 'of')}.json" for arm in protocol.LADDER_ARMS}
    report = ["--preset", "ladder", "--report_only", "--output_dir", str(tmp_path / "report"), "--records_dir",
              str(tmp_path / "committed")]  # fmt: skip
    recipe.main(report)  # what recipes/study_ladder.py runs last
    assert "L4k" in (tmp_path / "report" / "results.md").read_text()


def provenance_digest(corpus) -> str:
    from untie_recipes.tasks.study import provenance

    return provenance.blocks_digest(corpus)


def test_the_ladder_starts_one_process_per_cell_and_rate_the_4k_cell_first(capsys, monkeypatch):
    spec = importlib.util.spec_from_file_location("ladder_recipe", ROOT / "recipes" / "study_ladder.py")
    ladder = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "ladder_recipe", ladder)
    spec.loader.exec_module(ladder)
    assert ladder.main(["--dry_run", "--corpus_dir", "carried"]) == {}
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(protocol.LADDER_CELLS) * 2
    assert "--cells L4k --rates tied --seeds 1 2 --corpus_dir carried" in lines[0]
    assert all("--preset ladder" in line and "--time_limit 300" in line for line in lines)
    with pytest.raises(SystemExit, match="the ladder's cells"):
        ladder.main(["--dry_run", "--cells", "L8k"])


def test_the_ladder_waits_for_every_process_and_brings_back_what_it_made_however_the_call_ends(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("ladder_recipe", ROOT / "recipes" / "study_ladder.py")
    ladder = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "ladder_recipe", ladder)
    spec.loader.exec_module(ladder)
    made = tmp_path / "made"
    args = ladder.LadderArguments(output_dir=str(made), out=str(tmp_path / "out"), disable_tqdm=True,
                                  extra="--curve_points 10 --seeds 3")  # fmt: skip
    assert ladder.commands(args)[0][1][-4:] == ["--curve_points", "10", "--seeds", "3"]  # flags with their values
    write = "import pathlib, sys; p = pathlib.Path(sys.argv[1]); p.parent.mkdir(parents=True); p.write_text('{}')"
    started = [
        ("L4k-tied", [sys.executable, "-c", f"{write}; print('trained')", str(made / "L4k" / "records" / "a.json")]),
        ("L4k-untied", [sys.executable, "-c", "import sys; print('broke'); sys.exit(3)"]),
    ]
    assert ladder.run_all(args, started) == {"L4k-tied": 0, "L4k-untied": 3}
    assert (made / "L4k-untied.log").read_text() == "broke\n"
    (made / "L4k" / "checkpoints").mkdir()
    (made / "L4k" / "checkpoints" / "resume.pt").write_text("large")

    def interrupted(args, started):
        raise KeyboardInterrupt  # the call's time ran out

    monkeypatch.setattr(ladder, "run_all", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ladder.main(["--output_dir", str(made), "--out", str(tmp_path / "out"), "--disable_tqdm"])
    brought = sorted(str(p.relative_to(tmp_path / "out")) for p in (tmp_path / "out").rglob("*") if p.is_file())
    assert brought == ["L4k-tied.log", "L4k-untied.log", "L4k/records/a.json"]  # no checkpoint, no partial file


def test_a_sigterm_ends_the_ladder_with_its_processes_and_still_brings_back_what_it_made(tmp_path):
    """How a device call's time limit ends it: the launcher stops its processes and copies what exists to --out."""
    script = tmp_path / "launch.py"
    script.write_text(
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('ladder', {str(ROOT / 'recipes' / 'study_ladder.py')!r})\n"
        "ladder = importlib.util.module_from_spec(spec); sys.modules['ladder'] = ladder\n"
        "spec.loader.exec_module(ladder)\n"
        "child = [sys.executable, '-c', 'import os, time; print(os.getpid(), flush=True); time.sleep(600)']\n"
        "ladder.commands = lambda args: [('L4k-tied', child)]\n"
        f"ladder.main(['--output_dir', {str(tmp_path / 'made')!r}, '--out', {str(tmp_path / 'out')!r}, "
        "'--disable_tqdm'])\n"
    )
    launcher = subprocess.Popen([sys.executable, str(script)])
    log = tmp_path / "made" / "L4k-tied.log"
    for _ in range(600):  # until the child has started and written its pid (no clock: a loaded machine waits)
        if log.exists() and log.read_text().strip():
            break
        launcher.poll()
        assert launcher.returncode is None, "the launcher ended before its process started"
        subprocess.run([sys.executable, "-c", "import time; time.sleep(0.5)"])
    child = int(log.read_text().split()[0])
    launcher.terminate()
    assert launcher.wait() == 128 + 15
    assert (tmp_path / "out" / "L4k-tied.log").read_text() == log.read_text()
    with pytest.raises(ProcessLookupError):  # the child was stopped and reaped, not left running
        os.kill(child, 0)
