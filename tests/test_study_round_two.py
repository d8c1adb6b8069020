"""Round two's tables and rule (issue 77; docs/recipes/study.md, "Round two"), on records the tests write."""

from __future__ import annotations

import dataclasses

import pytest

from untie.decision.share_bands import parse_bands
from untie_recipes.tasks.study import report, round_two
from untie_recipes.tasks.study.training import StudyRecord

pytestmark = pytest.mark.recipes


def _record(
    cell: str,
    arm: str,
    seed: int,
    final: float,
    cpu: str = "CPU X",
    kind: str = "arm",
    lr: float = 1e-3,
    digest: str = "d1",
    share: tuple[int, int] = (6, 10),
) -> StudyRecord:
    return StudyRecord(
        name=f"{cell}-s{seed}-{arm}-{kind}-{lr:g}", cell=cell, arm=arm, kind=kind, seed=seed, lr=lr, budget_steps=100,
        untie_step=None, head=None, optimizer_state="copy", curve_steps=[50, 100], curve_validation=[final + 1, final],
        curve_train=[0.0, 0.0], final_validation_loss=final, train_loss_tail=0.0, steps_run=100, tokens=100 * 1024,
        wall_seconds=1.0, cpu_seconds=1.0, setup={"batch_size": 8}, params=share[1], embedding_params=share[0],
        tokens_per_embedding_row=1.0, machine={"cpu": cpu, "kernel_path": "AVX2", "device": "cpu", "torch": "2"},
        corpus_digest=digest,
    )  # fmt: skip


def _scale_sweep(cpu: str = "CPU Y") -> list[StudyRecord]:
    """Cell B's LR sweep on CPU X and its scale sweep on `cpu`, choosing k = 16; the k = 1 run is the LR sweep's best
    run again, 0.002 higher on the other CPU kind."""
    rates = ((5e-4, 4.5), (1e-3, 4.4), (2e-3, 4.46))
    lrs = [_record("B", "untied", 1, loss, kind="sweep", lr=lr) for lr, loss in rates]
    ks = [_record("B", f"untied-emb{k:g}", 1, loss, cpu=cpu, kind="sweep") for k, loss in
          ((1, 4.402), (4, 4.35), (16, 4.30), (64, 4.38))]  # fmt: skip
    return lrs + ks


def _cell_b(scaled: tuple[float, ...], untie_2of3: tuple[float, ...] = (3.97, 3.96, 3.96)) -> list[StudyRecord]:
    """Cell B's round-one arms on CPU X and the scale arm on CPU Y, seeds 1 to len(scaled)."""
    records = []
    for seed in (1, 2, 3):
        records += [_record("B", "untied", seed, 4.0), _record("B", "tied", seed, 3.98)]
        records += [_record("B", arm, seed, 3.99) for arm in ("untie@1/3", "untie@0.8", "untie@0.95")]
        records.append(_record("B", "untie@2/3", seed, untie_2of3[seed - 1]))
    records += [_record("B", "untied-emb16", seed, final, cpu="CPU Y") for seed, final in enumerate(scaled, 1)]
    return records + _scale_sweep()


def test_the_scale_arm_is_chosen_only_a_hundredth_of_a_nat_below_the_best_arm_without_it():
    waiting = round_two.round_two_table("B", _cell_b((3.95, 3.95)))
    assert waiting["choice"] is None and "2 of 3" in waiting["why"] and "untied-emb16" in waiting["why"]

    short = round_two.round_two_table("B", _cell_b((3.96, 3.955, 3.955)))  # 0.0067 below untie@2/3: an option
    assert short["arms"]["T*"]["arm"] == "untie@2/3" and short["choice"] == "untie@2/3"
    assert short["margin"] == pytest.approx(0.00667, abs=1e-4) and "an option" in short["why"]
    assert short["arms"]["U_k"]["cpus"] == ["CPU Y"] and short["arms"]["U"]["cpus"] == ["CPU X"]  # paired across
    assert short["arms"]["tied"]["vs_untied"]["mean"] == pytest.approx(-0.02)

    chosen = round_two.round_two_table("B", _cell_b((3.95, 3.95, 3.95)))  # 0.0133 below: chosen
    assert chosen["choice"] == "untied-emb16" and chosen["margin"] == pytest.approx(0.01333, abs=1e-4)
    assert round_two.choice_text("untied-emb16").endswith("the input embedding at 16x the rate")

    no_scale = [r for r in _cell_b((3.95, 3.95, 3.95)) if r.kind == "arm"]  # the sweep unknown: U_k cannot be read
    assert round_two.round_two_table("B", no_scale)["choice"] is None


def test_a_late_branch_enters_its_cells_table_only_once_every_development_seed_has_it():
    """Cell B's untie@0.9 lands a seed at a time: one or two seeds of it must not turn the complete cell pending (and
    the library's default with it); the report says how many it has. With all three it competes for T*."""
    records = _cell_b((3.95, 3.95, 3.95))
    complete = round_two.round_two_table("B", records)
    part = round_two.round_two_table("B", records + [_record("B", "untie@0.9", 1, 3.90)])
    assert part["choice"] == complete["choice"] == "untied-emb16" and part["seeds"] == [1, 2, 3]
    assert part["arms"]["T*"]["arm"] == "untie@2/3" and part["waiting"] == {"untie@0.9": 1}
    assert "untie@0.9 enters T* once all 3 seeds have it (1 so far)" in round_two.round_two_markdown(
        {"cells": {"B": part}, "cross_kind": [], "share_default": round_two.share_bands({"B": part})}
    )
    every = round_two.round_two_table("B", records + [_record("B", "untie@0.9", s, 3.90) for s in (1, 2, 3)])
    assert every["arms"]["T*"]["arm"] == "untie@0.9" and every["waiting"] == {}
    assert every["choice"] == "untie@0.9"  # 0.05 below U_k: more than the 0.01 bar the scale must clear


def test_only_records_of_one_corpus_build_pair_and_the_noise_between_cpu_kinds_is_measured():
    records = _cell_b((3.95, 3.95, 3.95))
    foreign = [dataclasses.replace(r, corpus_digest="d2") for r in records if r.arm == "untied-emb16"]
    mixed = [r for r in records if r.arm != "untied-emb16"] + foreign
    assert round_two.round_two_table("B", mixed)["choice"] is None  # another corpus build's U_k does not pair
    (noise,) = round_two.cross_kind_noise(records)
    assert noise["cpus"] == ["CPU X", "CPU Y"] and noise["difference"] == pytest.approx(0.002)
    same_kind = [dataclasses.replace(r, machine={**r.machine, "cpu": "CPU X"}) for r in records]
    assert round_two.cross_kind_noise(same_kind) == []


def test_each_cells_choice_holds_to_the_midpoint_with_its_neighbour_and_neighbours_that_agree_merge():
    tables = {
        "A": {"choice": "untied", "embedding_share": 0.84},
        "B": {"choice": "untie@2/3", "embedding_share": 0.56},
        "C": {"choice": None, "embedding_share": 0.25},
    }
    pending = round_two.share_bands(tables)
    assert pending["status"] == "pending: cell C has no choice yet"
    assert [(b["from"], b["to"], b["choice"]) for b in pending["bands"]] == [
        (0.0, pytest.approx(0.70), "untie@2/3"), (pytest.approx(0.70), 1.0, "untied")]  # fmt: skip
    tables["C"]["choice"] = "untie@2/3"
    merged = round_two.share_bands(tables)
    assert merged["status"] == "complete" and [b["cells"] for b in merged["bands"]] == [["C", "B"], ["A"]]
    assert merged["bands"][0]["to"] == pytest.approx(0.70)  # no threshold between C and B
    tables["C"]["choice"] = "untied"
    three = round_two.share_bands(tables)["bands"]
    assert [(round(b["from"], 3), round(b["to"], 3)) for b in three] == [(0.0, 0.405), (0.405, 0.70), (0.70, 1.0)]


def test_the_report_writes_round_twos_tables_and_the_librarys_bands(tmp_path):
    report.write_report(tmp_path, _cell_b((3.95, 3.95, 3.95)))
    text = (tmp_path / "round-two.md").read_text()
    tables = [block for block in text.split("\n\n") if block.startswith("|")]
    assert len(tables) == 6
    cells, noise, bands, loaded, library, trigger = tables
    assert "| B | 60.0% | 1, 2, 3 | untied-emb16: -0.050 [-0.050, -0.050]" in cells
    assert "untied from step 0, head drawn, the input embedding at 16x the rate (0.0133 nat below" in cells
    assert "| C | - | none |" in cells and "+0.0020" in noise
    assert "| 0.0% to 100.0% | untied from step 0, head drawn, the input embedding at 16x the rate | B |" in bands
    assert "| - | none fine-tuned | - | - | - | - | - |" in loaded
    # the library reads its default from this one (untie.decision.share_bands): U_k's scale is named, pending until C
    parsed = parse_bands(library)
    assert [(b.low, b.high, b.arm, b.untie_at, b.embedding_lr_scale) for b in parsed.bands] == [
        (0.0, 1.0, "untied-emb16", 0.0, 16.0)]  # fmt: skip
    assert parsed.status.startswith("pending: cell") and parsed.band(0.3) is None
    assert trigger.splitlines()[-1].endswith("| pending: not every cell is complete |")  # item 5 waits for every cell


def _finetune_table(target: dict[str, float], source: dict[str, float], seeds: int = 3) -> dict:
    interval = {"mean": 0.0, "low": 0.0, "high": 0.0}
    arms = {arm: {"target": {"mean": target[arm], "vs_stay_tied": interval},
                  "source": {"mean": source[arm], "vs_stay_tied": interval}} for arm in target}  # fmt: skip
    return {"seeds": list(range(1, seeds + 1)), "arms": arms}


def test_a_loaded_model_takes_the_least_forgotten_arm_within_a_hundredth_of_the_best_target():
    target = {"stay-tied": 4.80, "untie-now": 4.767, "untie-now-emb0.1": 4.772, "untie-now-frozen": 4.790}
    source = {"stay-tied": 5.30, "untie-now": 5.33, "untie-now-emb0.1": 5.31, "untie-now-frozen": 5.29}
    four = {arm: target[arm] for arm in ("stay-tied", "untie-now")} | {"default": 4.79, "untie@1/2": 4.80}
    waiting = round_two.loaded_choice(_finetune_table(four, source | {"default": 5.3, "untie@1/2": 5.3}))
    assert waiting["choice"] is None and "untie-now-emb0.1, untie-now-frozen not run" in waiting["why"]
    target |= {"default": 4.79, "untie@1/2": 4.80}
    source |= {"default": 5.28, "untie@1/2": 5.28}
    chosen = round_two.loaded_choice(_finetune_table(target, source))
    assert chosen["choice"] == "untie-now-emb0.1"  # 0.005 from the best target, forgets less than untie-now
    assert chosen["standing"]["untie-now"] == "target within 0.01, forgets more"
    assert chosen["standing"]["untie-now-frozen"] == "target 0.023 above the lowest"  # forgets least, but too far
    target["untie-now-emb0.1"] = 4.778  # 0.011 from the best: out
    assert round_two.loaded_choice(_finetune_table(target, source))["choice"] == "untie-now"
    assert round_two.loaded_choice(_finetune_table(target, source, seeds=2))["choice"] is None
    target["untie-now"] = float("nan")  # a diverged arm never wins, and says so
    diverged = round_two.loaded_choice(_finetune_table(target, source))
    assert diverged["choice"] == "untie-now-emb0.1" and diverged["standing"]["untie-now"] == "diverged"


def test_a_diverged_run_never_wins_and_only_development_seeds_enter():
    records = _cell_b((3.95, 3.95, 3.95))
    nan_t = [dataclasses.replace(r, final_validation_loss=float("nan")) if (r.arm, r.seed) == ("untie@1/3", 2) else r
             for r in records]  # fmt: skip
    table = round_two.round_two_table("B", nan_t)
    assert table["arms"]["T*"]["arm"] == "untie@2/3" and table["diverged"] == ["untie@1/3"]
    assert table["choice"] == "untied-emb16" and table["margin"] == pytest.approx(0.01333, abs=1e-4)
    nan_u = [dataclasses.replace(r, final_validation_loss=float("nan")) if (r.arm, r.seed) == ("untied", 2) else r
             for r in records]  # fmt: skip
    assert round_two.round_two_table("B", nan_u)["choice"] != "untied"
    extra = [
        *records,
        *(
            dataclasses.replace(r, seed=31, final_validation_loss=9.0)
            for r in records
            if r.seed == 1 and r.kind == "arm"
        ),
    ]
    assert round_two.round_two_table("B", extra)["seeds"] == [1, 2, 3]  # held-out seeds never enter the choice


def test_the_report_gives_each_fine_tuned_cells_arms_under_the_loaded_model_rule(tmp_path):
    from untie_recipes.tasks.study.finetune import FineTuneRecord

    def record(arm: str, seed: int, target: float, source: float) -> FineTuneRecord:
        return FineTuneRecord(
            name=f"C-ft-s{seed}-{arm}", cell="C", arm=arm, seed=seed, lr=1e-3, steps=300, batch_size=8, untie_step=0,
            untie_reason="fixed", pretrained_run=f"C-s{seed}-tied", target_before=6.0, source_before=4.0,
            target_loss=target, source_loss=source, train_loss_tail=0.0, wall_seconds=1.0, cpu_seconds=1.0,
            machine={"cpu": "CPU Y", "kernel_path": "AVX2", "device": "cpu", "torch": "2"}, corpus_digest="c",
            target_digest="t", epochs=0.5,
        )  # fmt: skip

    arms = {"stay-tied": (4.8, 4.1), "untie-now": (4.7, 4.3), "default": (4.75, 4.2), "untie@1/2": (4.76, 4.2),
            "untie-now-emb0.1": (4.705, 4.15), "untie-now-frozen": (4.9, 4.0)}  # fmt: skip
    tuned = [record(arm, seed, t + 0.001 * seed, s) for arm, (t, s) in arms.items() for seed in (1, 2, 3)]
    results = report.write_report(tmp_path, _cell_b((3.95, 3.95, 3.95)), tuned)
    assert results["round_two"]["loaded"]["C"]["choice"] == "untie-now-emb0.1"
    text = (tmp_path / "round-two.md").read_text()
    assert "| C (1, 2, 3; CPU Y, AVX2) | untie-now-emb0.1 | 4.7070 | -0.095 [-0.095, -0.095] | 4.1500 |" in text
    assert "| C (1, 2, 3; CPU Y, AVX2) | stay-tied | 4.8020 | reference |" in text


def test_the_trigger_statement_holds_only_once_every_cell_fires_early_and_unties_best_late():
    """Item 5: per cell, the tied runs' would-fire steps beside T*; the verdict waits for every cell, and fails where
    one tied run fires late or one cell's T* is earlier than 1/3."""

    def timing(fire_step: int, t_star: str, cells=("A", "B", "C")) -> str:
        records, tables = [], {}
        for cell in cells:
            for seed in (1, 2, 3):
                tied = _record(cell, "tied", seed, 4.0)
                records.append(dataclasses.replace(tied, trigger={"first_would_fire_step": fire_step}))
            tables[cell] = {"choice": "untied", "arms": {"T*": {"arm": t_star}}}
        return round_two.trigger_timing(records, tables)["verdict"]

    assert timing(5, "untie@2/3") == "holds"  # 5% of a 100-step run
    assert timing(10, "untie@2/3") == "does not hold"  # at 10%: not within the first 10%
    assert timing(5, "untie@0.8") == "holds"
    assert timing(5, "untie@2/3", cells=("A", "B")).startswith("pending")  # cell C has no table yet
