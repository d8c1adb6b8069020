"""`untie inspect` and `untie convert`: reports, round trips across architectures, errors and exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import transformers as tf

import untie
from untie.checkpoints import inspection
from untie.cli import EXIT_CODES, main
from untie.testing import tiny_model

ROUND_TRIP_ARCHS = ["gpt2", "llama", "bert", "t5"]


def _inspect(capsys, *args) -> dict:
    assert main(["inspect", *map(str, args), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _save_untied(arch: str, path, *, noise: float = 0.05):
    """A checkpoint untied by this library whose head has moved away from the embedding (as training would)."""
    model = tiny_model(arch)
    untie.untie_embeddings(model)
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head.add_(noise * torch.randn(head.shape, generator=torch.Generator().manual_seed(1)))
        if getattr(model.get_output_embeddings(), "bias", None) is not None:
            model.get_output_embeddings().bias.add_(0.5)  # a "trained" output bias that must survive
    model.save_pretrained(path)
    return model


# ---------------------------------------------------------------------------------------------------------------
# inspect
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ROUND_TRIP_ARCHS)
def test_inspect_reports_a_tied_checkpoint(arch, tmp_path, capsys):
    model = tiny_model(arch)
    model.save_pretrained(tmp_path)
    report = _inspect(capsys, tmp_path, "--pairs", "1:2")
    layout = untie.embedding_layout(model)
    shared = model.get_input_embeddings().weight
    distance = torch.dist(shared[1], shared[2]).item()
    expected = {"ids": [1, 2], "input": pytest.approx(distance), "output": pytest.approx(distance)}
    assert report["pairs"]["1-2"] == expected
    assert report["tied"] is True and report["status"] == "tied" and "drift" not in report
    assert report["input_embedding"]["name"] == layout.input_weight
    assert report["output_embedding"]["name"] == layout.output_weight
    assert report["input_embedding"]["shape"] == list(model.get_input_embeddings().weight.shape)
    assert report["model_class"] == type(model).__name__ and report["loaded"] == "embeddings only"
    if arch == "bert":
        assert report["output_bias"] == {"name": "cls.predictions.decoder.bias", "tied_to": ["cls.predictions.bias"]}


@pytest.mark.parametrize("arch", ["gpt2", "llama", "bert"])
def test_inspect_reports_an_untied_checkpoint_with_drift(arch, tmp_path, capsys):
    model = _save_untied(arch, tmp_path)
    report = _inspect(capsys, tmp_path, "--pairs", "1:2", "3:4")
    assert report["tied"] is False and report["status"] == "untied"
    assert report["config"] == {"tie_word_embeddings": False, "untied_output_embeddings": True, "vocab_size": 48}
    drift = report["drift"]
    assert 0 <= drift["knn_overlap"] <= 1 and 0 <= drift["cka"] <= 1
    w_in, w_out = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert report["pairs"]["1-2"]["input"] == pytest.approx(torch.dist(w_in[1], w_in[2]).item(), rel=1e-6)
    assert report["pairs"]["3-4"]["output"] == pytest.approx(torch.dist(w_out[3], w_out[4]).item(), rel=1e-6)


def test_inspect_drift_is_one_for_identical_spaces_and_low_for_unrelated_ones(tmp_path, capsys):
    model = tiny_model("gpt2")
    untie.untie_embeddings(model)  # head is an exact copy: the two spaces are identical
    model.save_pretrained(tmp_path / "same")
    same = _inspect(capsys, tmp_path / "same")["drift"]
    assert same["knn_overlap"] == pytest.approx(1.0) and same["cka"] == pytest.approx(1.0)
    with torch.no_grad():
        model.lm_head.weight.copy_(torch.randn(model.lm_head.weight.shape, generator=torch.Generator().manual_seed(3)))
    model.save_pretrained(tmp_path / "unrelated")
    unrelated = _inspect(capsys, tmp_path / "unrelated")["drift"]
    assert unrelated["knn_overlap"] < 0.4 and unrelated["cka"] < 0.6
    assert unrelated["knn_overlap_chance"] == pytest.approx(untie.signals.metrics.knn_overlap_chance(10, 48))


@pytest.mark.parametrize("arch", ["gpt2", "bert", "t5"])
def test_inspect_reads_only_the_embeddings_and_agrees_with_a_full_load(arch, tmp_path, monkeypatch):
    _save_untied(arch, tmp_path)
    fast = inspection.describe(tmp_path)
    monkeypatch.setattr(inspection, "stored_keys", lambda checkpoint: None)  # force from_pretrained
    full = inspection.describe(tmp_path)
    assert fast["loaded"] == "embeddings only" and full["loaded"] == "full model"
    for key in ("tied", "status", "input_embedding", "output_embedding", "output_bias", "config", "drift"):
        assert fast[key] == full[key], key


def test_inspect_flags_fragile_and_missing_heads(tmp_path, capsys):
    model = _save_untied("gpt2", tmp_path / "fragile")
    model.config.tie_word_embeddings = True  # an untied head under a config that still says tied (peft#2777 style)
    delattr(model.config, "untied_output_embeddings")
    model.save_pretrained(tmp_path / "fragile")
    report = _inspect(capsys, tmp_path / "fragile")
    assert report["status"] == "untied-fragile" and "untie convert" in report["notes"][0]

    config = tiny_model("gpt2").config
    config.tie_word_embeddings = False
    headless = tf.GPT2LMHeadModel(config)
    sd = {k: v for k, v in headless.state_dict().items() if k != "lm_head.weight"}
    os.makedirs(tmp_path / "missing")
    config.save_pretrained(tmp_path / "missing")
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in sd.items()}, tmp_path / "missing" / "model.safetensors")
    report = _inspect(capsys, tmp_path / "missing")
    assert report["status"] == "head-missing" and "randomly" in report["notes"][0]


def _gemma3_multimodal() -> tf.Gemma3ForConditionalGeneration:
    """A tiny Gemma 3 multimodal model: `vocab_size` lives in its text_config only."""
    config = untie.testing.tiny_gemma3_multimodal_config()
    torch.manual_seed(0)
    return tf.Gemma3ForConditionalGeneration(config)


def test_inspect_reads_a_multimodal_vocabulary_from_its_text_config(tmp_path, capsys):
    """Issue 69: Gemma 3 multimodal keeps vocab_size in text_config only; inspect printed vocab_size=None."""
    _gemma3_multimodal().save_pretrained(tmp_path)
    report = _inspect(capsys, tmp_path)
    assert report["config"]["vocab_size"] == 64 and report["status"] == "tied"
    assert main(["inspect", str(tmp_path)]) == 0
    assert (
        "text_config.tie_word_embeddings=True, untied_output_embeddings=False, vocab_size=64" in capsys.readouterr().out
    )


def test_inspect_flags_config_levels_that_disagree_and_convert_writes_every_level(tmp_path, capsys):
    """Issue 69: a head stored apart under a top level that says untied and a text_config that still says tied (what
    PEFT's merge or a hand-copied head leaves on Gemma 3) read as plainly "untied", though an engine that reads
    text_config ties it again; `untie convert --untie` writes every level and says it did."""
    model = _gemma3_multimodal()
    untie.untie_embeddings(model)
    with torch.no_grad():
        model.lm_head.weight.add_(0.1)  # a trained head
    model.config.text_config.tie_word_embeddings = True  # only the top level was untied
    delattr(model.config, "untied_output_embeddings")
    delattr(model.config.text_config, "untied_output_embeddings")
    model.save_pretrained(tmp_path / "mixed")
    report = _inspect(capsys, tmp_path / "mixed")
    assert report["config"]["tie_word_embeddings"] is False and report["config"]["text_config.tie_word_embeddings"]
    assert report["status"] == "untied-fragile", report["notes"]
    assert "levels disagree" in report["notes"][0] and "untie convert PATH OUT --untie" in report["notes"][0]

    assert main(["convert", str(tmp_path / "mixed"), str(tmp_path / "fixed"), "--untie"]) == 0
    printed = capsys.readouterr().out
    assert "the source's config levels disagreed" in printed and "ok: every config level says untied" in printed
    saved = json.loads((tmp_path / "fixed" / "config.json").read_text())
    assert saved["tie_word_embeddings"] is False and saved["text_config"]["tie_word_embeddings"] is False
    report = _inspect(capsys, tmp_path / "fixed")
    assert report["status"] == "untied" and report["config"]["vocab_size"] == 64
    fixed = tf.Gemma3ForConditionalGeneration.from_pretrained(tmp_path / "fixed")
    assert torch.equal(fixed.lm_head.weight, model.lm_head.weight)


def test_inspect_text_output_is_readable(tmp_path, capsys):
    _save_untied("llama", tmp_path)
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "status:            untied" in out and "neighbour overlap" in out and "linear CKA" in out


# ---------------------------------------------------------------------------------------------------------------
# convert
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ROUND_TRIP_ARCHS)
def test_convert_untie_then_tie_round_trip(arch, tmp_path):
    original = tiny_model(arch)
    original.save_pretrained(tmp_path / "tied")
    shared = original.get_input_embeddings().weight.detach().clone()
    assert main(["convert", str(tmp_path / "tied"), str(tmp_path / "untied"), "--untie"]) == 0

    model_class = type(original)
    reloaded = model_class.from_pretrained(tmp_path / "untied")
    if arch == "t5":
        # Upstream (transformers 5.23): T5 keeps tie_word_embeddings=True, so a head still equal to the embedding is
        # re-tied by a plain from_pretrained; the untie marker lets untie_embeddings() restore it.
        assert untie.is_tied(reloaded) and untie.was_untied(reloaded)
        untie.untie_embeddings(reloaded)
    assert not untie.is_tied(reloaded)
    reloaded.tie_weights()
    reloaded.resize_token_embeddings(shared.shape[0] + 8, mean_resizing=False)
    assert not untie.is_tied(reloaded)
    assert torch.equal(reloaded.get_output_embeddings().weight[: shared.shape[0]], shared)
    assert torch.equal(reloaded.get_input_embeddings().weight[: shared.shape[0]], shared)

    assert main(["convert", str(tmp_path / "untied"), str(tmp_path / "tied-again"), "--tie"]) == 0
    back = model_class.from_pretrained(tmp_path / "tied-again")
    assert untie.is_tied(back)
    for (name, a), (_, b) in zip(original.state_dict().items(), back.state_dict().items(), strict=True):
        assert torch.equal(a, b), f"{name} changed in the round trip"


@pytest.mark.parametrize("arch", ROUND_TRIP_ARCHS)
@pytest.mark.parametrize("init", ["input", "output", "mean"])
def test_convert_tie_an_untied_checkpoint(arch, init, tmp_path):
    untied = _save_untied(arch, tmp_path / "untied")
    w_in = untied.get_input_embeddings().weight.detach().clone()
    w_out = untied.get_output_embeddings().weight.detach().clone()
    expected = {"input": w_in, "output": w_out, "mean": (w_in + w_out) / 2}[init]
    assert main(["convert", str(tmp_path / "untied"), str(tmp_path / "tied"), "--tie", "--init", init]) == 0
    reloaded = type(untied).from_pretrained(tmp_path / "tied")
    assert untie.is_tied(reloaded) and reloaded.config.tie_word_embeddings
    assert torch.equal(reloaded.get_input_embeddings().weight, expected)
    reloaded.tie_weights()
    reloaded.resize_token_embeddings(expected.shape[0] + 8, mean_resizing=False)
    assert untie.is_tied(reloaded) and torch.equal(reloaded.get_output_embeddings().weight[:48], expected)
    if arch == "bert":  # the trained output bias survives the re-tie
        assert torch.equal(reloaded.cls.predictions.decoder.bias[:48], untied.cls.predictions.decoder.bias)


def test_convert_copies_the_tokenizer_and_keeps_dtype(tmp_path):
    model = tiny_model("llama").to(torch.bfloat16)
    model.save_pretrained(tmp_path / "src")
    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "miller", "wheel"])}
    tf.BertTokenizer(vocab=vocab).save_pretrained(tmp_path / "src")
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "out"), "--untie", "--json"]) == 0
    assert tf.AutoTokenizer.from_pretrained(tmp_path / "out").get_vocab() == vocab
    reloaded = tf.LlamaForCausalLM.from_pretrained(tmp_path / "out")
    assert reloaded.dtype == torch.bfloat16 and not untie.is_tied(reloaded)


def test_convert_reports_an_already_converted_model(tmp_path, capsys):
    _save_untied("gpt2", tmp_path / "untied")
    assert main(["convert", str(tmp_path / "untied"), str(tmp_path / "out"), "--untie", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["before"] == summary["after"] == "untied" and "already untied" in summary["notes"][0]
    assert len(summary["checks"]) == 6


# ---------------------------------------------------------------------------------------------------------------
# errors and exit codes
# ---------------------------------------------------------------------------------------------------------------


def test_a_missing_relative_path_is_not_read_as_a_hub_id(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["inspect", "./nope"]) == 3
    err = capsys.readouterr().err
    assert "./nope: no such folder" in err and "Repo id" not in err


def test_a_hub_id_on_a_machine_that_cannot_reach_the_hub_fails_at_once_naming_it(capsys, monkeypatch):
    """No half minute of huggingface_hub's retries and warnings: one try to open a connection, then the cache."""
    from huggingface_hub import constants
    from launch import free_port

    from untie.checkpoints import loading

    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    assert not loading._hub_reachable()
    assert main(["inspect", "some-org/not-cached-model"]) == 3
    err = capsys.readouterr().err
    assert "not in the local Hugging Face cache" in err and "cannot be reached" in err and "Retrying" not in err


def test_missing_path_and_file_exit_3(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "nope")]) == 3
    assert "no such folder" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["inspect", str(tmp_path / "empty")]) == 3
    assert "no config.json" in capsys.readouterr().err
    tiny_model("gpt2").save_pretrained(tmp_path / "m")
    assert main(["convert", str(tmp_path / "m" / "config.json"), str(tmp_path / "o"), "--untie"]) == 3
    assert "pass the checkpoint folder" in capsys.readouterr().err


def test_model_without_lm_head_exits_4_and_head_option_loads_it(tmp_path, capsys):
    encoder = tiny_model("bert").bert  # a BertModel, as sentence-transformers checkpoints are saved
    encoder.save_pretrained(tmp_path)
    assert main(["inspect", str(tmp_path)]) == 4
    assert "--head masked-lm" in capsys.readouterr().err
    report = _inspect(capsys, tmp_path, "--head", "masked-lm")
    assert report["model_class"] == "BertForMaskedLM" and report["status"] == "tied"
    assert any("cls.predictions.decoder.bias is not stored" in note for note in report["notes"])


def test_bad_command_lines_exit_2(tmp_path, capsys):
    tiny_model("gpt2").save_pretrained(tmp_path / "m")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("keep me")
    assert main(["convert", str(tmp_path / "m"), str(tmp_path / "busy"), "--untie"]) == 2
    assert "--overwrite" in capsys.readouterr().err and (tmp_path / "busy" / "x").read_text() == "keep me"
    assert main(["convert", str(tmp_path / "m"), str(tmp_path / "m"), "--untie"]) == 2
    assert main(["convert", str(tmp_path / "m"), str(tmp_path / "o"), "--untie", "--init", "mean"]) == 2
    assert main(["convert", str(tmp_path / "m"), str(tmp_path / "o")]) == 2  # neither --tie nor --untie
    assert main(["inspect", str(tmp_path / "m"), "--pairs", "1-2"]) == 2
    assert "write each pair as A:B" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path / "m"), "--pairs", "1:999"]) == 2
    assert "outside the vocabulary" in capsys.readouterr().err


def test_installed_entry_point_and_module_share_help_and_exit_codes():
    for command in (["untie"], [sys.executable, "-m", "untie"]):
        result = subprocess.run([*command, "--help"], capture_output=True, text=True, check=True)
        assert "untie convert" in result.stdout and "exit codes" in result.stdout
        assert all(f"  {code}  " in result.stdout for code in EXIT_CODES)
    result = subprocess.run([sys.executable, "-m", "untie", "inspect", "/no/such/dir"], capture_output=True, text=True)
    assert result.returncode == 3 and "Traceback" not in result.stderr


def _hub_cache(root, repo_id: str, source) -> dict:
    """A Hugging Face cache holding `source`'s files as `repo_id` at main: the hub path, served offline."""
    snapshot = root / f"models--{repo_id.replace('/', '--')}" / "snapshots" / "0123456789abcdef"
    snapshot.mkdir(parents=True)
    for path in source.iterdir():
        (snapshot / path.name).write_bytes(path.read_bytes())
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0123456789abcdef")
    return {**os.environ, "HF_HUB_CACHE": str(root), "HF_HUB_OFFLINE": "1"}


def test_hub_ids_go_through_the_hub_and_fail_cleanly_offline(tmp_path):
    _save_untied("gpt2", tmp_path / "model")
    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "miller", "wheel"])}
    tf.BertTokenizer(vocab=vocab).save_pretrained(tmp_path / "model")
    env = _hub_cache(tmp_path / "hub", "someone/tiny-gpt2", tmp_path / "model")
    command = [sys.executable, "-m", "untie", "inspect", "someone/tiny-gpt2", "--json"]
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["status"] == "untied" and report["loaded"] == "embeddings only"

    result = subprocess.run([*command[:4], "someone/not-cached"], capture_output=True, text=True, env=env)
    assert result.returncode == 3 and "the hub could not provide it" in result.stderr

    out = tmp_path / "tied"
    convert = [sys.executable, "-m", "untie", "convert", "someone/tiny-gpt2", str(out), "--tie"]
    result = subprocess.run(convert, capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert untie.is_tied(tf.GPT2LMHeadModel.from_pretrained(out))
    assert tf.AutoTokenizer.from_pretrained(out).get_vocab() == vocab  # the hub tokenizer is saved alongside


def test_inspect_reads_sharded_checkpoints(tmp_path):
    model = _save_untied("llama", tmp_path / "single")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="2KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    single, sharded = inspection.describe(tmp_path / "single"), inspection.describe(tmp_path / "sharded")
    assert sharded["loaded"] == "embeddings only"
    for key in ("tied", "status", "input_embedding", "output_embedding", "drift"):
        assert single[key] == sharded[key], key


def test_help_and_usage_errors_answer_without_importing_torch():
    """`untie --help` took 8.7 s and 407 MB (torch, transformers and peft imported first); now only argparse runs."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from untie.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit as done:\n    assert done.code == 0\n"
        "assert main(['inspect', 'some/model', '--k', '-1']) == 2\n"
        "assert main(['inspect', 'some/model', '--queries', '0']) == 2\n"
        "assert main(['convert', 'a', 'b', '--untie', '--init', 'mean']) == 2\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'peft', 'accelerate') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    finished = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert finished.returncode == 0, finished.stderr
    assert "must be at least 1" in finished.stderr and "--init only applies with --tie" in finished.stderr


def test_the_cli_head_choices_and_the_lazy_exports_match_the_library():
    import importlib

    import untie
    from untie.checkpoints.loading import HEADS
    from untie.cli import HEAD_CHOICES

    assert tuple(HEADS) == HEAD_CHOICES
    assert sorted(untie.__all__) == sorted(untie._EXPORTS)
    for name in untie.__all__:
        assert getattr(untie, name) is getattr(importlib.import_module(untie._EXPORTS[name]), name)
