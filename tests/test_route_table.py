"""`scripts/route_table.py` at its smallest settings: the facts the tied-checkpoints guide's route table rests on."""

from __future__ import annotations

import json

import pytest
from script_modules import load_script

pytestmark = pytest.mark.recipes  # a test of recipes/, scripts/ or the docs' tables (pytest -m 'not recipes')

pytest.importorskip("peft")

SMALLEST = ["--pretrain_steps", "10", "--steps", "3", "--lines", "300", "--hidden_size", "32"]


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    out = tmp_path_factory.mktemp("route-table")
    load_script("scripts", "route_table").main([*SMALLEST, "--output_dir", str(out)])
    return json.loads((out / "results.json").read_text()), (out / "results.md").read_text()


def test_the_manual_copy_equals_the_library_bit_for_bit_and_the_flag_at_load_draws_a_far_head(measured):
    full = measured[0]["full_finetune"]
    assert full["library_vs_copy_parameters"] == 0.0 and full["library_vs_copy_logits"] == 0.0
    assert not full["checkpoint_stores_head"], "a tied checkpoint stores the embedding alone"
    assert not full["drawn_head_equals_embedding"]
    assert full["drawn_vs_copy_logits_at_load"] > 0.5, full  # tiny settings: 1.43
    first = full["first_loss"]
    assert first["library"] == first["copy"] and first["drawn"] > first["copy"] + 0.3, first  # +0.77


def test_untying_before_lora_changes_no_byte_of_the_merged_model(measured):
    for run in measured[0]["lora"].values():
        assert run["merged_parameters"] == 0.0 and run["merged_logits"] == 0.0, run
    assert measured[0]["lora"]["attention"]["merged_tied_without_untie"]


def test_new_ids_land_on_old_padding_rows_with_a_plain_resize_and_at_the_mean_with_the_guide(measured):
    padded, exact = (measured[0]["new_tokens"][name] for name in ("qwen3-padded", "llama-3.2-exact"))
    assert padded["plain_rows_after"] < padded["rows_before"] and padded["plain_from_old_rows"] == 0.0, padded
    assert exact["plain_rows_after"] == exact["rows_before"] + 2 and exact["plain_from_old_rows"] is None
    for tokens in (padded, exact):
        assert tokens["guide_rows_after"] >= tokens["rows_before"] and tokens["guide_known_rows_kept"], tokens
        assert tokens["guide_from_mean"] == 0.0 and tokens["guide_untied"], tokens


def test_inspect_flags_the_fragile_folders_and_convert_repairs_them(measured):
    fragile = measured[0]["fragile"]
    assert fragile["levels"] == {"top": True} and fragile["head_stored"]
    assert fragile["fragile"]["inspect"] == "untied-fragile" and fragile["fragile"]["plain_reload"] == 0.0
    assert fragile["fragile"]["after_tie_weights"] > 1e-3, fragile  # the trained head overwritten
    assert fragile["convert"] == "untied" and fragile["converted"]["inspect"] == "untied"
    assert fragile["converted"]["after_tie_weights"] == 0.0
    for route, run in measured[0]["multimodal"].items():  # Gemma 3: a level that still says tied is flagged
        if route == "peft_merge" and _peft_merge_keeps_the_tie():
            # peft 0.18: the merge leaves the config tied at every level, so a reload re-ties the trained head (the
            # reason UntieCallback refuses modules_to_save there: untie/structure/peft_support.py)
            assert run["inspect"] == "untied-fragile" and set(run["levels"].values()) == {True}, (route, run)
            assert run["plain_reload_and_tie_weights"] > 1e-3, (route, run)
            continue
        disagree = len(set(run["levels"].values())) > 1
        assert run["inspect"] == ("untied-fragile" if disagree else "untied"), (route, run)
        assert run["plain_reload_and_tie_weights"] == 0.0, (route, run)
    assert measured[0]["multimodal"]["untie_embeddings"]["levels"] == {"top": False, "text_config": False}


def test_the_serving_cost_is_the_published_shapes_arithmetic_and_the_table_holds_every_route(measured):
    qwen = measured[0]["serving"]["Qwen3-0.6B"]
    assert qwen["head_parameters"] == 151936 * 1024 and round(qwen["head_bf16_mb"]) == 311
    assert qwen["parameters_tied"] == 596_049_920  # Qwen3-0.6B's published 0.6B (0.44B without the embedding)
    rows = [line for line in measured[1].splitlines() if line.startswith("| ")][1:]
    routes = ("full fine-tune", "LoRA", "new tokens", "multimodal", "a fragile folder", "serving")
    assert len(rows) == 9 and all(any(row.startswith(f"| {r}") for row in rows) for r in routes), rows


def _peft_merge_keeps_the_tie() -> bool:
    """Whether the installed PEFT's merge_and_unload leaves tie_word_embeddings=True (peft 0.18; 0.19 and later write
    False: scripts/peft_tied_merge.py)."""
    import peft
    from packaging.version import Version

    return Version(peft.__version__) < Version("0.19")
