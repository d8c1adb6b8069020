"""DeepSpeed ZeRO 1-3 on 2 CPU ranks (gloo): the tied phase in autograd (`untie.engines.zero_tying`), the untie through
DeepSpeed's API, resume before and after it, and the saved model, through Trainer (`deepspeed=`) and through `Untier` in
an accelerate loop.

They need DeepSpeed (`pip install -e ".[deepspeed]"`, with `DS_BUILD_OPS=0` on a machine without CUDA) and are skipped
without it, except where UNTIE_REQUIRE_DEEPSPEED is set (CI's DeepSpeed step), where a missing DeepSpeed fails them.
The references are a really tied run under the same ZeRO stage (the tied phase) and the same run under DDP, where the
untie is live (the steps after it).
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from launch import torchrun

import untie
from untie.signals.pairs import tokenizer_pairs
from untie.testing import VOCAB, tiny_tokenizer

pytestmark = pytest.mark.distributed  # every test here launches processes (pytest -m 'not distributed')

if not os.environ.get("UNTIE_REQUIRE_DEEPSPEED"):
    pytest.importorskip("deepspeed")

STAGES = (1, 2, 3)
UNTIE_AT, MAX_STEPS = 6, 10
#: DeepSpeed's accelerator on a machine without a GPU; one thread per rank.
DS_ENV = {"DS_ACCELERATOR": "cpu"}
HERE = os.path.dirname(__file__)


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("deepspeed-trainer")
    for stage in (0, *STAGES):  # 0: the DDP reference
        torchrun(os.path.join(HERE, "deepspeed_trainer_run.py"), out, stage, env=DS_ENV)
    return out, {stage: [torch.load(out / f"z{stage}-rank{r}.pt") for r in (0, 1)] for stage in (0, *STAGES)}


@pytest.mark.parametrize("stage", STAGES)
def test_trainer_tied_phase_under_zero_equals_a_really_tied_run(trainer_runs, stage):
    _, runs = trainer_runs
    tied, run = runs[stage][0]["tied"], runs[stage][0]["untie"]
    assert tied["tied_parameter"] and not run["tied_parameter"]
    for rank in (0, 1):
        untied = runs[stage][rank]["untie"]
        assert (untied["tying_mode"], untied["untie_step"], untied["reason"]) == ("emulated", UNTIE_AT, "deadline")
    before = slice(0, UNTIE_AT)
    assert min(tied["norms"][before]) > 0.3  # max_grad_norm=0.3 bites: clipping must see the tied norm
    torch.testing.assert_close(run["losses"][before], tied["losses"][before], rtol=0, atol=1e-5)
    torch.testing.assert_close(run["norms"][before], tied["norms"][before], rtol=1e-5, atol=0)
    assert run["warnings"] == []  # untie_when=None: nothing to warn about


@pytest.mark.parametrize("stage", STAGES)
def test_trainer_untie_under_zero_copies_the_tied_optimizer_state_on_every_rank(trainer_runs, stage):
    _, runs = trainer_runs
    tied = runs[stage][0]["tied"]["at_untie"]
    for rank in (0, 1):
        after = runs[stage][rank]["untie"]["at_untie"]  # right after the untie step: fp32 masters and Adam moments
        for key in ("", ".exp_avg", ".exp_avg_sq"):
            assert torch.equal(after["head" + key], after["embedding" + key]), key  # the fork is an exact copy
        # ... of the live tied run's moments (autograd tying hands each matrix g / sqrt(2); the untie rescales): a
        # missing rescale is off by a factor 1/sqrt(2) or 1/2.
        torch.testing.assert_close(after["embedding.exp_avg"], tied["embedding.exp_avg"], rtol=5e-3, atol=1e-9)
        torch.testing.assert_close(after["embedding.exp_avg_sq"], tied["embedding.exp_avg_sq"], rtol=5e-3, atol=1e-12)


@pytest.mark.parametrize("stage", STAGES)
def test_trainer_under_zero_after_the_untie_equals_a_live_untie_under_ddp(trainer_runs, stage):
    _, runs = trainer_runs
    reference, run = runs[0][0]["untie"], runs[stage][0]["untie"]
    assert reference["tying_mode"] == "live" and reference["untie_step"] == UNTIE_AT
    torch.testing.assert_close(run["losses"], reference["losses"], rtol=0, atol=1e-5)
    rank0, rank1 = runs[stage][0]["untie"]["final"], runs[stage][1]["untie"]["final"]
    assert not torch.equal(rank0["head"], rank0["embedding"])  # the head trained on its own
    for name in ("head", "embedding"):
        assert torch.equal(rank0[name], rank1[name])
        # Within 2.6e-5 measured: eps acts sqrt(2) larger in the tied phase (untie.engines.zero_tying), on rarely seen
        # rows.
        torch.testing.assert_close(rank0[name], reference["final"][name], rtol=0, atol=1e-4)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("checkpoint", [4, 8])
def test_trainer_resume_under_zero_before_and_after_the_untie_equals_the_uninterrupted_run(
    trainer_runs, stage, checkpoint
):
    # checkpoint-4 is before the untie (the resumed run unties at 6), checkpoint-8 after it.
    _, runs = trainer_runs
    for rank in (0, 1):
        run, reference = runs[stage][rank][f"resume-{checkpoint}"], runs[stage][rank]["untie"]
        assert (run["untie_step"], run["reason"]) == (UNTIE_AT, "deadline")
        resumed_steps = MAX_STEPS - checkpoint
        torch.testing.assert_close(run["losses"], reference["losses"][-resumed_steps:], rtol=0, atol=1e-6)
        for name, value in reference["final"].items():
            torch.testing.assert_close(run["final"][name], value, rtol=0, atol=1e-6)


@pytest.mark.parametrize("checkpoint", [4, 8])
def test_trainer_resumes_zero3_checkpoints_that_hold_only_deepspeeds_folder(trainer_runs, checkpoint):
    # Without stage3_gather_16bit_weights_on_model_save (ZeRO-3's default) checkpoint-N has no model.safetensors:
    # it is complete all the same (its `latest` names global_stepN/), and resumes.
    out, runs = trainer_runs
    assert not (out / "z3" / "nogather" / f"checkpoint-{checkpoint}" / "model.safetensors").exists()
    for rank in (0, 1):
        run, reference = runs[3][rank][f"nogather-resume-{checkpoint}"], runs[3][rank]["nogather"]
        assert (run["untie_step"], run["reason"]) == (UNTIE_AT, "deadline")
        torch.testing.assert_close(run["losses"], reference["losses"][checkpoint:], rtol=0, atol=1e-6)
        for name, value in reference["final"].items():
            torch.testing.assert_close(run["final"][name], value, rtol=0, atol=1e-6)
    # ... and the run itself is the one with the gathered saves.
    torch.testing.assert_close(runs[3][0]["nogather"]["losses"], runs[3][0]["untie"]["losses"], rtol=0, atol=0)


@pytest.mark.parametrize("stage", STAGES)
def test_trainer_under_zero_saves_a_model_that_reloads_untied_in_plain_transformers(trainer_runs, stage):
    from transformers import AutoModelForCausalLM

    out, runs = trainer_runs
    final = runs[stage][0]["untie"]["final"]
    model = AutoModelForCausalLM.from_pretrained(out / f"z{stage}" / "saved")
    assert not model.config.tie_word_embeddings
    assert model.get_output_embeddings().weight is not model.get_input_embeddings().weight
    torch.testing.assert_close(model.get_output_embeddings().weight.detach(), final["head"], rtol=0, atol=0)
    torch.testing.assert_close(model.get_input_embeddings().weight.detach(), final["embedding"], rtol=0, atol=0)


@pytest.mark.parametrize("stage", STAGES)
def test_zero_checkpoints_reload_through_zero_to_fp32_with_both_matrices(trainer_runs, stage):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file

    out, _ = trainer_runs
    folder = out / f"z{stage}" / "untie"
    tied_phase = get_fp32_state_dict_from_zero_checkpoint(folder / "checkpoint-4")
    assert torch.equal(tied_phase["lm_head.weight"], tied_phase["transformer.wte.weight"])  # both stored, equal
    untied = get_fp32_state_dict_from_zero_checkpoint(folder / "checkpoint-8")
    assert not torch.equal(untied["lm_head.weight"], untied["transformer.wte.weight"])
    saved = load_file(folder / "checkpoint-8" / "model.safetensors")  # Trainer's own save of the same step
    for name in ("lm_head.weight", "transformer.wte.weight"):
        assert torch.equal(untied[name], saved[name]), name


@pytest.mark.parametrize("stage", STAGES)
def test_trainer_trigger_under_zero_reads_the_role_signals_of_a_live_tie_and_unties_every_rank(trainer_runs, stage):
    _, runs = trainer_runs
    reference = runs[0][0]["trigger"]  # DDP, live tying and the live probe
    assert (reference["untie_step"], reference["reason"]) == (4, "trigger")
    rank0, rank1 = runs[stage][0]["trigger"], runs[stage][1]["trigger"]
    for run in (rank0, rank1):
        assert (run["tying_mode"], run["untie_step"], run["reason"]) == ("emulated", 4, "trigger")
    assert json.dumps(rank0["history"]) == json.dumps(rank1["history"])  # identical on the ranks, NaN included
    assert [h["step"] for h in rank0["history"]] == [h["step"] for h in reference["history"]] == [2, 4, 6, 8, 10]
    for mine, live in zip(rank0["history"][:2], reference["history"][:2], strict=True):  # the tied phase
        assert {"cosine", "cancellation", "agreement", "gap/3-5", "tension/7-40"} <= mine.keys()
        for key, value in live.items():
            assert mine[key] == pytest.approx(value, rel=1e-4, abs=1e-6, nan_ok=True), key
    torch.testing.assert_close(rank0["losses"], reference["losses"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("stage", STAGES)
def test_trainer_defaults_under_zero_measure_and_untie_at_the_deadline(trainer_runs, stage):
    _, runs = trainer_runs
    for rank in (0, 1):
        run = runs[stage][rank]["default"]
        assert (run["untie_step"], run["reason"]) == (int(0.3 * MAX_STEPS), "deadline")
        # The defaults on a 10-step run under any engine: the trigger has too few measurements to fire, and the
        # model unties at the deadline its plan line names: a logged note, no warning (issue 69).
        assert run["warnings"] == []
        assert [h["step"] for h in run["history"]] == [2, 4, 6, 8, 10]  # the tied phase measured, then drift
        assert all(math.isfinite(run["history"][0][key]) for key in ("cosine", "cancellation", "agreement"))
        assert torch.isfinite(run["losses"]).all() and run["losses"][-1] < run["losses"][0]
    assert json.dumps(runs[stage][0]["default"]["history"]) == json.dumps(runs[stage][1]["default"]["history"])
    # Under ZeRO-3 this run's model was built partitioned (zero.Init, as from_pretrained builds it): the head is
    # created from the gathered embedding before the engine partitions it with the rest.
    assert runs[stage][0]["default"]["partitioned_at_construction"] == (stage == 3)
    # The tokenizer's pairs, read from the embedding's whole row count (a zero.Init partition holds none locally):
    # those of the same model loaded plainly, and the evidence rule that reads them.
    plain = [pair.ids for pair in tokenizer_pairs(tiny_tokenizer(), max_id=VOCAB)]
    assert plain
    for rank in (0, 1):
        assert runs[stage][rank]["default"]["pairs"] == plain
        assert runs[stage][rank]["default"]["rule"] == repr(untie.RULES["evidence"])


@pytest.mark.parametrize("stage", STAGES)
def test_trainer_default_policy_under_zero_trains_a_fresh_model_untied_from_the_first_step(trainer_runs, stage):
    """`UntieCallback()` on a model built fresh (under ZeRO-3 partitioned at construction, zero.Init): untied before
    the engine wraps it, the head a parameter of its own that trains apart from the embedding, on every rank."""
    _, runs = trainer_runs
    for rank in (0, 1):
        run = runs[stage][rank]["fresh"]
        assert (run["untie_step"], run["reason"], run["plan"]) == (0, "start", "untied from the start")
        assert not run["tied_parameter"]
        assert torch.isfinite(run["losses"]).all() and run["losses"][-1] < run["losses"][0]
        assert not torch.equal(run["final"]["head"], run["final"]["embedding"])
        assert run["final"]["head.exp_avg_sq"].abs().sum() > 0  # the head is in the optimizer and trains
    torch.testing.assert_close(runs[stage][0]["fresh"]["losses"], runs[stage][1]["fresh"]["losses"], rtol=0, atol=0)
    torch.testing.assert_close(runs[stage][0]["fresh"]["final"]["head"], runs[stage][1]["fresh"]["final"]["head"])


# -- Untier in an accelerate loop (DeepSpeedPlugin) ------------------------------------------------------------------
@pytest.fixture(scope="module")
def untier_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("deepspeed-untier")
    runs = ("tied", "full", "resume-4", "resume-8", "reset", "fresh", "late", "trigger")  # resumes read full's saves
    for stage in STAGES:
        for run in runs:
            torchrun(os.path.join(HERE, "deepspeed_untier_run.py"), out, stage, run, env=DS_ENV)
    return out, {
        (stage, run): [torch.load(out / f"untier-z{stage}-{run}-rank{r}.pt") for r in (0, 1)]
        for stage in STAGES
        for run in runs
    }


@pytest.mark.parametrize("stage", STAGES)
def test_untier_under_zero_ties_as_a_really_tied_run_and_unties_at_its_step_with_the_state_copied(untier_runs, stage):
    _, untier_runs = untier_runs
    tied = untier_runs[stage, "tied"][0]
    for rank in (0, 1):
        run = untier_runs[stage, "full"][rank]
        assert (run["tying_mode"], run["untie_step"], run["reason"]) == ("emulated", UNTIE_AT, "deadline")
        torch.testing.assert_close(run["losses"][:UNTIE_AT], tied["losses"][:UNTIE_AT], rtol=0, atol=1e-5)
        after = run["at_untie"]
        for key in ("", ".exp_avg", ".exp_avg_sq"):
            assert torch.equal(after["head" + key], after["embedding" + key]), key
        for key in ("exp_avg", "exp_avg_sq"):
            reference = tied["at_untie"][f"embedding.{key}"]
            torch.testing.assert_close(after[f"embedding.{key}"], reference, rtol=5e-3, atol=1e-12)
        assert not torch.equal(run["final"]["head"], run["final"]["embedding"])
    assert torch.equal(untier_runs[stage, "full"][0]["final"]["head"], untier_runs[stage, "full"][1]["final"]["head"])


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("checkpoint", [4, 8])
def test_untier_under_zero_resumes_from_save_state_before_and_after_the_untie(untier_runs, stage, checkpoint):
    _, untier_runs = untier_runs
    for rank in (0, 1):
        run, reference = untier_runs[stage, f"resume-{checkpoint}"][rank], untier_runs[stage, "full"][rank]
        assert (run["untie_step"], run["reason"]) == (UNTIE_AT, "deadline")
        torch.testing.assert_close(run["losses"], reference["losses"][checkpoint:], rtol=0, atol=1e-6)
        for name in ("head", "embedding"):
            torch.testing.assert_close(run["final"][name], reference["final"][name], rtol=0, atol=1e-6)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("optimizer_state", ["reset", "fresh"])
def test_untier_under_zero_resets_the_moments_optimizer_state_names(untier_runs, stage, optimizer_state):
    _, untier_runs = untier_runs
    tied = untier_runs[stage, "tied"][0]["at_untie"]
    for rank in (0, 1):
        run = untier_runs[stage, optimizer_state][rank]
        assert run["untie_step"] == UNTIE_AT
        after = run["at_untie"]
        zeroed = ("head", "embedding") if optimizer_state == "fresh" else ("head",)
        for key in ("exp_avg", "exp_avg_sq"):
            for role in ("head", "embedding"):
                if role in zeroed:
                    assert not after[f"{role}.{key}"].any(), (role, key)
                else:  # the embedding keeps the live tied run's moments
                    torch.testing.assert_close(after[f"{role}.{key}"], tied[f"embedding.{key}"], rtol=5e-3, atol=1e-12)
        assert torch.isfinite(run["losses"]).all()


@pytest.mark.parametrize("stage", STAGES)
def test_untier_under_zero_final_model_reloads_untied_in_plain_transformers(untier_runs, stage):
    from transformers import AutoModelForCausalLM

    out, runs = untier_runs
    final = runs[stage, "full"][0]["final"]
    model = AutoModelForCausalLM.from_pretrained(out / f"z{stage}-saved")
    assert not model.config.tie_word_embeddings
    assert torch.equal(model.get_output_embeddings().weight.detach(), final["head"])
    assert torch.equal(model.get_input_embeddings().weight.detach(), final["embedding"])


@pytest.mark.parametrize("stage", STAGES)
def test_untier_created_after_deepspeed_prepared_the_model_refuses_instead_of_adding_a_head_that_never_trains(
    untier_runs, stage
):
    _, runs = untier_runs
    for rank in (0, 1):
        message = runs[stage, "late"][rank]["error"]
        assert message is not None and "DeepSpeed" in message and "before" in message, message


def test_untier_trigger_under_zero_measures_the_same_signals_on_every_stage_and_rank(untier_runs):
    # The role signals come from the autograd tie's captured gradient, whatever ZeRO then partitions: the stages
    # measure the same numbers (float summation order aside), both ranks the same bits, and the trigger fires.
    _, runs = untier_runs
    reference = runs[1, "trigger"][0]
    assert reference["reason"] == "trigger" and reference["untie_step"] is not None
    tied_phase = [h for h in reference["history"] if h["step"] <= reference["untie_step"]]
    assert tied_phase and all(math.isfinite(h["cosine"]) for h in tied_phase)
    for stage in STAGES:
        rank0, rank1 = runs[stage, "trigger"]
        assert json.dumps(rank0["history"]) == json.dumps(rank1["history"])
        assert (rank0["untie_step"], rank0["reason"]) == (reference["untie_step"], "trigger")
        for mine, first in zip(rank0["history"], reference["history"], strict=True):
            for key, value in first.items():
                assert mine[key] == pytest.approx(value, rel=1e-4, abs=1e-6, nan_ok=True), (stage, key)


@pytest.mark.parametrize("stage", STAGES)
def test_untier_close_under_zero_leaves_only_the_structure(untier_runs, stage):
    """After close(), the DeepSpeed engine, its optimizer wrappers and the Accelerator carry nothing of the library's
    (no step wrapper, no replaced forward, no ZeRO-3 external parameter, no save / load hook), and a forward hook and
    a forward someone set before the run are still in place."""
    _, runs = untier_runs
    for run in ("full", "resume-4", "resume-8", "reset", "fresh", "trigger"):
        for rank in runs[stage, run]:
            assert rank["leftovers"] == [], (run, rank["leftovers"])
    for rank in runs[stage, "trigger"]:
        assert rank["foreign_kept"] and all(rank["foreign_kept"].values()), rank["foreign_kept"]
