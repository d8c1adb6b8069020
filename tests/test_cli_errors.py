"""`untie` on bad input: nothing is overwritten or half-written, every failure is one clear message and exit code."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import transformers as tf

import untie
from untie.checkpoints import conversion
from untie.checkpoints.checkpoint import checkpoint_is_untied
from untie.cli import main
from untie.testing import tiny_model


def _untied_checkpoint(path, arch: str = "gpt2"):
    model = tiny_model(arch)
    untie.untie_embeddings(model)
    with torch.no_grad():
        model.get_output_embeddings().weight.add_(0.1)  # a trained head, different from the embedding
    model.save_pretrained(path)
    return model


def _json_error(capsys, *args) -> dict:
    """Run with --json: stdout must hold exactly one JSON object with the error and the exit code returned."""
    code = main([*map(str, args), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert report["exit_code"] == code and code != 0 and report["error"]
    return report


# ---------------------------------------------------------------------------------------------------------------
# Data loss
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("link", ["output", "source"])
def test_convert_refuses_a_symlinked_same_folder_and_leaves_the_source_intact(link, tmp_path, capsys):
    real = tmp_path / "real"
    model = _untied_checkpoint(real)
    alias = tmp_path / "alias"
    alias.symlink_to(real, target_is_directory=True)
    source, output = (real, alias) if link == "output" else (alias, real)
    before = {p.name: p.read_bytes() for p in real.iterdir()}
    assert main(["convert", str(source), str(output), "--tie", "--init", "mean", "--overwrite"]) == 2
    assert "once links are resolved" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in real.iterdir()} == before
    reloaded = tf.GPT2LMHeadModel.from_pretrained(real)
    assert torch.equal(reloaded.get_output_embeddings().weight, model.get_output_embeddings().weight)


def test_convert_refuses_an_output_inside_the_source(tmp_path, capsys):
    _untied_checkpoint(tmp_path / "m")
    assert main(["convert", str(tmp_path / "m"), str(tmp_path / "m" / "tied"), "--tie"]) == 2
    assert not (tmp_path / "m" / "tied").exists()


def _snapshot(folder) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("overwrite", [True, False], ids=["overwrite", "no-overwrite"])
@pytest.mark.parametrize("spelling", ["parent", "symlink", "relative", "dotdot", "grandparent"])
def test_convert_refuses_an_output_that_contains_the_source_and_leaves_it_byte_identical(
    spelling, overwrite, tmp_path, capsys, monkeypatch
):
    """`convert parent/src parent --overwrite` used to replace the parent, deleting the source, and exit 0."""
    parent = tmp_path / "parent"
    _untied_checkpoint(parent / "src")
    (parent / "notes.txt").write_text("the user's other work")
    monkeypatch.chdir(parent / "src")
    (tmp_path / "link").symlink_to(parent, target_is_directory=True)
    output = {
        "parent": str(parent),
        "symlink": str(tmp_path / "link"),
        "relative": "..",
        "dotdot": str(parent / "src" / ".." / "."),
        "grandparent": str(tmp_path),
    }[spelling]
    before = _snapshot(tmp_path / "parent")
    code = main(["convert", ".", output, "--tie", *(["--overwrite"] if overwrite else [])])
    assert code == 2
    assert "contains the source" in capsys.readouterr().err
    assert _snapshot(tmp_path / "parent") == before
    assert not any(name.startswith(".") for name in os.listdir(tmp_path))


def _dead_pid() -> int:
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(finished.stdout)


def test_a_killed_converts_staging_folders_are_named_and_removed_by_the_next_convert(tmp_path, capsys):
    """A convert killed while writing leaves `.OUT.partial-*` (and, while replacing, `.OUT.old-*`); the next convert
    into that OUT removes them and says so; a folder of a convert still running here is kept."""
    import socket

    _untied_checkpoint(tmp_path / "m")
    host = socket.gethostname().replace("-", "_")
    dead = [tmp_path / f".out.partial-{host}-{_dead_pid()}-abc", tmp_path / f".out.old-{host}-{_dead_pid()}-def"]
    alive = tmp_path / f".out.partial-{host}-{os.getpid()}-ghi"
    other = tmp_path / f".other.partial-{host}-{_dead_pid()}-jkl"  # another OUT's: not this convert's business
    for folder in (*dead, alive, other):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"half written")
    assert main(["convert", str(tmp_path / "m"), str(tmp_path / "out"), "--tie"]) == 0
    out = capsys.readouterr().out
    assert not any(folder.exists() for folder in dead) and alive.exists() and other.exists()
    for folder in dead:
        assert f"removed {folder}" in out
    assert untie.is_tied(tf.GPT2LMHeadModel.from_pretrained(tmp_path / "out"))


def test_convert_writes_out_readable_by_others_under_the_usual_umask(tmp_path):
    """The staging folder comes from mkdtemp (0700); OUT must get the permissions any new folder gets."""
    _untied_checkpoint(tmp_path / "m")
    previous = os.umask(0o022)
    try:
        assert main(["convert", str(tmp_path / "m"), str(tmp_path / "out"), "--tie"]) == 0
    finally:
        os.umask(previous)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o755
    for path in (tmp_path / "out").iterdir():
        assert path.stat().st_mode & 0o077 == 0o044, path.name


def test_convert_tie_does_not_carry_the_source_runs_untied_state(tmp_path):
    _untied_checkpoint(tmp_path / "ckpt")
    run_state = {"format": 3, "attributes": {"untied": True, "untie_step": 4}}
    state = {"stateful_callbacks": {"UntieCallback": {"args": {}, "attributes": {"untie_state": run_state}}}}
    (tmp_path / "ckpt" / "trainer_state.json").write_text(json.dumps(state))
    assert checkpoint_is_untied(tmp_path / "ckpt") is True
    assert main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "tied"), "--tie"]) == 0
    assert not (tmp_path / "tied" / "trainer_state.json").exists()
    assert checkpoint_is_untied(tmp_path / "tied") is False
    model = tiny_model("gpt2")
    untie.prepare_for_resume(model, tmp_path / "tied")
    assert untie.is_tied(model)


def test_convert_writes_out_only_once_the_checks_pass(tmp_path, monkeypatch, capsys):
    _untied_checkpoint(tmp_path / "m")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("previous")

    def fail(*args, **kwargs):
        raise conversion.ConversionFailed("the reloaded model is tied (simulated)")

    monkeypatch.setattr(conversion, "verify_conversion", fail)
    assert main(["convert", str(tmp_path / "m"), str(tmp_path / "out"), "--tie", "--overwrite"]) == 5
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]  # the old OUT is untouched
    assert main(["convert", str(tmp_path / "m"), str(tmp_path / "new"), "--tie"]) == 5
    assert not (tmp_path / "new").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "out"]  # no staging folder left behind
    monkeypatch.undo()
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "m"), str(tmp_path / "out"), "--tie", "--overwrite"]) == 0
    assert not (tmp_path / "out" / "keep.txt").exists() and (tmp_path / "out" / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "out"]


def test_a_full_disk_exits_7_without_a_traceback_and_writes_no_out(tmp_path, monkeypatch, capsys):
    _untied_checkpoint(tmp_path / "m")

    def full_disk(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tf.PreTrainedModel, "save_pretrained", full_disk)
    report = _json_error(capsys, "convert", tmp_path / "m", tmp_path / "out", "--tie")
    assert report["exit_code"] == 7 and "No space left on device" in report["error"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_a_real_file_size_limit_exits_7_and_writes_no_out(tmp_path):
    """EFBIG from the kernel (RLIMIT_FSIZE) reaches convert through safetensors' writer as a SafetensorError, as a
    full disk's ENOSPC does; it exited 1 with "unexpected error: SafetensorError"."""
    _untied_checkpoint(tmp_path / "m")
    script = (
        "import resource, signal, sys\n"
        "from untie.cli import main\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing us\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))\n"
        f"sys.exit(main(['convert', {str(tmp_path / 'm')!r}, {str(tmp_path / 'out')!r}, '--tie']))\n"
    )
    finished = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert finished.returncode == 7, finished.stderr
    assert "could not write" in finished.stderr and "Traceback" not in finished.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_an_out_under_a_file_exits_7(tmp_path, capsys):
    _untied_checkpoint(tmp_path / "m")
    (tmp_path / "file").write_text("x")
    assert main(["convert", str(tmp_path / "m"), str(tmp_path / "file" / "out"), "--tie"]) == 7
    assert "is a file" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "m"), str(tmp_path / "file"), "--tie"]) == 7


# ---------------------------------------------------------------------------------------------------------------
# Incomplete and damaged checkpoints
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["inspect", "convert"])
def test_a_config_without_weights_exits_6(command, tmp_path, capsys):
    tiny_model("gpt2").config.save_pretrained(tmp_path / "m")
    extra = [str(tmp_path / "out"), "--untie"] if command == "convert" else []
    assert main([command, str(tmp_path / "m"), *extra]) == 6
    assert "no weights" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["inspect", "convert"])
def test_a_truncated_safetensors_file_exits_6(command, tmp_path, capsys):
    _untied_checkpoint(tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])
    extra = [str(tmp_path / "out"), "--untie"] if command == "convert" else []
    assert main([command, str(tmp_path / "m"), *extra]) == 6
    assert "truncated or damaged" in capsys.readouterr().err


def test_a_missing_shard_exits_6_even_when_the_embeddings_are_readable(tmp_path, capsys):
    model = _untied_checkpoint(tmp_path / "single", "llama")
    model.save_pretrained(tmp_path / "m", max_shard_size="2KB")
    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())["weight_map"]
    embedding_files = {index["model.embed_tokens.weight"], index["lm_head.weight"]}
    other = sorted(set(index.values()) - embedding_files)[0]
    (tmp_path / "m" / other).unlink()
    assert main(["inspect", str(tmp_path / "m")]) == 6
    assert f"lists the shard {other}, which is missing" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "m"), str(tmp_path / "out"), "--tie"]) == 6


def test_inspect_reads_model_safetensors_before_a_stale_index_as_from_pretrained_does(tmp_path, capsys):
    model = _untied_checkpoint(tmp_path / "m")
    stale = {"weight_map": {"transformer.wte.weight": "model-00001-of-00002.safetensors"}}
    (tmp_path / "m" / "model.safetensors.index.json").write_text(json.dumps(stale))
    assert main(["inspect", str(tmp_path / "m"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["status"] == "untied" and report["loaded"] == "embeddings only"
    assert report["input_embedding"]["shape"] == list(model.get_input_embeddings().weight.shape)


def test_a_stale_index_alone_exits_6(tmp_path, capsys):
    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "m", max_shard_size="2KB")
    index_file = tmp_path / "m" / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    index["weight_map"]["model.not_a_tensor"] = first
    index_file.write_text(json.dumps(index))
    assert main(["inspect", str(tmp_path / "m")]) == 6
    assert "is stale" in capsys.readouterr().err


def test_a_malformed_config_names_the_file_not_a_missing_folder(tmp_path, capsys):
    tiny_model("gpt2").save_pretrained(tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text('{"model_type": "gpt2",')
    assert main(["inspect", str(tmp_path / "m")]) == 6
    err = capsys.readouterr().err
    assert "config.json is not valid JSON" in err and "no such folder" not in err


def test_remote_code_is_refused_without_a_prompt(tmp_path):
    tiny_model("gpt2").save_pretrained(tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilModel"}
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    (tmp_path / "m" / "modeling_evil.py").write_text("raise SystemExit('the folder code ran')\n")
    command = [sys.executable, "-m", "untie", "inspect", str(tmp_path / "m"), "--json"]
    result = subprocess.run(command, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    assert result.returncode == 8, result.stderr[-2000:]
    report = json.loads(result.stdout)  # nothing but the JSON object on stdout: no prompt
    assert report["exit_code"] == 8 and "trust_remote_code=True" in report["error"]
    assert "the folder code ran" not in result.stderr


# ---------------------------------------------------------------------------------------------------------------
# --json always answers in JSON
# ---------------------------------------------------------------------------------------------------------------


def test_json_prints_one_object_on_every_kind_of_error(tmp_path, capsys, monkeypatch):
    assert _json_error(capsys, "inspect", tmp_path / "nope")["exit_code"] == 3
    assert _json_error(capsys, "inspect", tmp_path, "--pairs", "1-2")["exit_code"] == 2  # argparse
    assert _json_error(capsys, "convert", tmp_path, tmp_path / "o", "--json")["exit_code"] == 2  # no --tie/--untie
    _untied_checkpoint(tmp_path / "m")
    assert _json_error(capsys, "convert", tmp_path / "m", tmp_path / "m", "--untie")["exit_code"] == 2

    def bug(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr("untie.checkpoints.inspection.describe", bug)
    report = _json_error(capsys, "inspect", tmp_path / "m")
    assert report["exit_code"] == 1 and "RuntimeError: a bug" in report["error"]


# ---------------------------------------------------------------------------------------------------------------
# Reports that say what is true
# ---------------------------------------------------------------------------------------------------------------


def test_inspect_does_not_call_an_untied_bias_tied(tmp_path, capsys):
    model = tiny_model("bert")
    untie.untie_embeddings(model)
    with torch.no_grad():
        model.get_output_embeddings().bias.add_(0.5)
    model.save_pretrained(tmp_path / "m")
    assert main(["inspect", str(tmp_path / "m"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["output_bias"] == {"name": "cls.predictions.decoder.bias", "tied_to": None}
    assert main(["inspect", str(tmp_path / "m")]) == 0
    assert "tied to" not in capsys.readouterr().out
    reloaded = tf.BertForMaskedLM.from_pretrained(tmp_path / "m")
    assert reloaded.cls.predictions.bias is not reloaded.cls.predictions.decoder.bias
    tied = tiny_model("bert")
    tied.save_pretrained(tmp_path / "tied")
    assert main(["inspect", str(tmp_path / "tied"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["output_bias"]["tied_to"] == ["cls.predictions.bias"]


def test_convert_output_is_exactly_what_plain_transformers_loads(tmp_path):
    """The staged write renames into place: OUT is a normal folder whose files reload, with no leftovers."""
    _untied_checkpoint(tmp_path / "m")
    assert main(["convert", str(tmp_path / "m"), str(tmp_path / "out"), "--tie"]) == 0
    assert untie.is_tied(tf.GPT2LMHeadModel.from_pretrained(tmp_path / "out"))
    assert not any(name.startswith(".") for name in os.listdir(tmp_path))


@pytest.mark.parametrize("damage", ["vocab-rows", "int32"])
def test_inspect_refuses_with_exit_6_what_from_pretrained_would_not_load_as_trained(damage, tmp_path, capsys):
    """A header whose embedding disagrees with config.json (from_pretrained raises), or an integer embedding
    (from_pretrained casts it to float): inspect used to report on either as if it were a trained model."""
    from safetensors.torch import load_file, save_file

    tiny_model("gpt2").save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    if damage == "vocab-rows":
        weights["transformer.wte.weight"] = torch.zeros(weights["transformer.wte.weight"].shape[0] + 5, 16)
        with pytest.raises(RuntimeError):
            save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
            tf.GPT2LMHeadModel.from_pretrained(tmp_path)
    else:
        weights["transformer.wte.weight"] = (weights["transformer.wte.weight"] * 100).to(torch.int32)
        save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    assert main(["inspect", str(tmp_path)]) == 6
    error = capsys.readouterr().err
    assert "transformer.wte.weight" in error and ("config.json builds" in error or "I32 integers" in error)


def test_inspect_pairs_auto_without_a_tokenizer_exits_2_naming_the_fix(tmp_path, capsys):
    """transformers 5 builds an empty tokenizer of the model type for a folder without tokenizer files; inspect read
    "0 most frequent pairs" off it and exited 0 (silent on an untied model)."""
    _untied_checkpoint(tmp_path / "m")
    report = _json_error(capsys, "inspect", tmp_path / "m", "--pairs", "auto")
    assert report["exit_code"] == 2 and "has no tokenizer to read the pairs" in report["error"]


def test_surgery_on_a_dynamically_quantized_model_is_refused_with_the_reason():
    """quantize_dynamic packs the head's weight behind a method: untie_embeddings returned without untying."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation notices
        model = torch.ao.quantization.quantize_dynamic(tiny_model("gpt2"), {torch.nn.Linear}, dtype=torch.qint8)
    with pytest.raises(TypeError, match="quantize_dynamic.*floating-point model first"):
        untie.untie_embeddings(model)
    with pytest.raises(TypeError, match="cannot be tied"):
        untie.tie_embeddings(model)


# ---------------------------------------------------------------------------------------------------------------
# convert refuses what inspect flags, and never writes a matrix from_pretrained made up
# ---------------------------------------------------------------------------------------------------------------


def _headless_untied_checkpoint(path, arch: str):
    """An untied config whose safetensors hold no LM head: from_pretrained initialises the head randomly."""
    from safetensors.torch import load_file, save_file

    model = tiny_model(arch)
    model.config.tie_word_embeddings = False
    model.save_pretrained(path)
    weights = load_file(path / "model.safetensors")
    head = untie.embedding_layout(model).output_weight
    weights = {key: value for key, value in weights.items() if key != head}
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return model.get_input_embeddings().weight.detach().clone()


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("request_", [["--untie"], ["--tie", "--init", "output"], ["--tie", "--init", "mean"]])
def test_convert_refuses_an_untied_checkpoint_without_its_head(arch, request_, tmp_path, capsys):
    _headless_untied_checkpoint(tmp_path / "src", arch)
    assert main(["inspect", str(tmp_path / "src")]) == 0
    assert "head-missing" in capsys.readouterr().out
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "out"), *request_]) == 6
    error = capsys.readouterr().err
    assert "is not stored" in error and "head-missing" in error and "--tie --init input" in error
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_convert_tie_from_the_input_keeps_the_trained_embedding_of_a_headless_checkpoint(arch, tmp_path, capsys):
    embedding = _headless_untied_checkpoint(tmp_path / "src", arch)
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "out"), "--tie"]) == 0
    assert "is not stored in the source; in OUT it is the trained input embedding" in capsys.readouterr().out
    reloaded = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert untie.is_tied(reloaded) and torch.equal(reloaded.get_input_embeddings().weight, embedding)


@pytest.mark.parametrize("request_", [["--untie"], ["--tie", "--init", "mean"]])
@pytest.mark.parametrize("damage", ["vocab-rows", "int32"])
def test_convert_refuses_with_exit_6_a_stored_embedding_inspect_refuses(damage, request_, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    tiny_model("gpt2").save_pretrained(tmp_path / "src")
    weights = load_file(tmp_path / "src" / "model.safetensors")
    key = "transformer.wte.weight"
    if damage == "vocab-rows":
        weights[key] = torch.zeros(weights[key].shape[0] + 5, weights[key].shape[1])
    else:
        weights[key] = (weights[key] * 100).to(torch.int32)
    save_file(weights, tmp_path / "src" / "model.safetensors", metadata={"format": "pt"})
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "out"), *request_]) == 6
    error = capsys.readouterr().err
    assert key in error and ("config.json builds" in error or "I32 integers" in error)
    assert not (tmp_path / "out").exists()


def test_convert_of_a_headless_encoder_says_which_head_layers_are_new_without_transformers_noise(tmp_path):
    """As a user runs it (a process of its own): transformers' load report ("MISSING", "corrupted") and progress bars
    stay out of convert's output, and convert says itself which head layers are new."""
    config = tf.BertConfig(vocab_size=48, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=32)  # fmt: skip
    tf.BertModel(config).save_pretrained(tmp_path / "src")
    command = [sys.executable, "-m", "untie", "convert", str(tmp_path / "src"), str(tmp_path / "out"), "--untie"]
    done = subprocess.run([*command, "--head", "masked-lm"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "are not in the source and start newly initialised" in done.stdout
    assert "cls.predictions.transform.dense.weight" in done.stdout
    noise = ("LOAD REPORT", "corrupted", "MISSING", "Loading weights", "Writing model shards")
    assert not [word for word in noise if word in done.stdout + done.stderr], done.stdout + done.stderr
