"""`UntieConfig` as a first-class object: parsed from a command line next to TrainingArguments, round-tripped through
JSON with the library version, and taken as it is by both adapters (`config=` and settings by name)."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys

import pytest
import torch
import transformers as tf

import untie
from untie.decision.settings import VERSION_KEY, UntieConfig
from untie.testing import ToyLMDataset, tiny_model


def _parse(*argv: str) -> tuple[untie.UntieConfig, tf.TrainingArguments]:
    parser = tf.HfArgumentParser((untie.UntieConfig, tf.TrainingArguments))
    return parser.parse_args_into_dataclasses(["--output_dir", "unused", *argv])


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], {}),
        (["--untie_at", "500"], {"untie_at": 500}),
        (["--untie_at", "0"], {"untie_at": 0}),
        (["--untie_at", "0.25"], {"untie_at": 0.25}),
        (["--untie_at", "inf"], {"untie_at": None}),
        (["--untie_when", "none"], {"untie_when": None}),
        (["--untie_when", "evidence"], {"untie_when": "evidence"}),
        (["--untie_when", '{"signal": "gap", "threshold": 0.3}'], {"untie_when": untie.UntieWhen("gap", 0.3)}),
        (["--pairs", "auto"], {"pairs": "auto"}),
        (["--pairs", "none"], {"pairs": []}),
        (["--pairs", "[[3, 5], [7, 9]]"], {"pairs": [(3, 5), (7, 9)]}),
        (["--optimizer_state", "fresh", "--tie_init", "mean"], {"optimizer_state": "fresh", "tie_init": "mean"}),
        (["--tying_mode", "emulated", "--metrics_every", "10"], {"tying_mode": "emulated", "metrics_every": 10}),
        (["--save_at_untie", "false"], {"save_at_untie": False}),
    ],
)
def test_the_command_line_parses_every_setting_next_to_training_arguments(argv, expected):
    config, args = _parse(*argv, "--max_steps", "7", "--use_cpu")
    assert config == untie.UntieConfig(**expected)
    assert args.max_steps == 7 and args.use_cpu  # TrainingArguments' flags parse beside them


def test_a_pairs_file_is_read_into_the_config(tmp_path):
    path = tmp_path / "pairs.json"
    path.write_text("[[3, 5], [7, 9]]")
    config, _ = _parse("--pairs", str(path))
    assert config.pairs == [(3, 5), (7, 9)]
    assert json.loads(config.to_json())["pairs"] == [[3, 5], [7, 9]]  # the config holds the pairs, not the path


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--untie_at", "2.5"], "neither a whole step nor a fraction"),
        (["--untie_at", "-3"], "untie_at=-3 is negative"),  # as typed, not "-3.0" (issue 78)
        (["--untie_when", "evidense"], "evidense"),
        (["--untie_when", '{"signal": "gap"'], "not valid JSON"),
        (["--pairs", "the/The"], "neither 'auto', 'none', a JSON list"),
        (["--untie_when", "divergence", "--metrics_every", "0"], "metrics_every=0 takes none"),
    ],
)
def test_bad_command_line_values_are_refused_by_name(argv, message):
    with pytest.raises(ValueError, match=message):
        _parse(*argv)


def test_choices_are_checked_by_the_parser_and_help_shows_each_setting(capsys):
    with pytest.raises(SystemExit):
        _parse("--optimizer_state", "keep")
    assert "invalid choice: 'keep'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _parse("--help")
    shown = " ".join(capsys.readouterr().out.split())
    percent = 0
    for field in untie.UntieConfig.__dataclass_fields__.values():
        text = field.metadata["help"].replace("%%", "%")  # argparse %-formats help: a literal % is stored doubled
        assert f"--{field.name}" in shown and text[:50] in shown, field.name
        if "%" in text:  # a help text with a percent sign (it raised in argparse before it was doubled)
            percent += 1
            at = text.index("%")
            assert text[max(0, at - 8) : at + 2] in shown, field.name
    assert percent, "no help text has a % sign now (policy's had one): this check no longer runs; drop it"


def test_json_round_trip_records_the_version_and_refuses_unknown_keys(tmp_path):
    config = untie.UntieConfig(
        untie_at=250, untie_when={"signal": "gap/3-5", "patience": 2}, pairs=[(3, 5)], optimizer_state="reset"
    )
    text = config.to_json()
    assert json.loads(text)[VERSION_KEY] == untie.__version__
    assert untie.UntieConfig.from_json(text) == config
    config.to_json_file(tmp_path / "untie_config.json")
    assert untie.UntieConfig.from_json_file(tmp_path / "untie_config.json") == config
    with pytest.raises(ValueError, match=r"Unknown UntieConfig keys \['untie_step'\]"):
        untie.UntieConfig.from_dict({"untie_step": 3})
    with pytest.warns(UserWarning, match="written by untie 99.0.0, newer than this one"):
        untie.UntieConfig.from_dict({VERSION_KEY: "99.0.0", "untie_at": 5})


def test_both_adapters_take_a_config_and_settings_by_name_over_it():
    config = untie.UntieConfig(untie_at=6, untie_when=None, metrics_every=3)
    callback = untie.UntieCallback(config, untie_at=4)
    assert callback.config == untie.UntieConfig(untie_at=4, untie_when=None, metrics_every=3)
    assert config.untie_at == 6  # the config passed in is not changed
    assert untie.UntieCallback.from_config(config).config == config
    assert untie.Untier.from_config(tiny_model("gpt2"), config).config == config
    assert untie.Untier(tiny_model("gpt2"), config=config, metrics_every=0).config.metrics_every == 0
    with pytest.raises(TypeError, match=r"Unknown untie settings \['untie_step'\]; the settings are the fields"):
        untie.UntieCallback(untie_step=4)
    with pytest.raises(TypeError, match=r"config is an untie.UntieConfig; pass single settings by name"):
        untie.UntieCallback(500)
    assert untie.UntieCallback().config == untie.UntieConfig()  # Trainer(callbacks=[UntieCallback]) builds this


def test_a_parsed_command_line_runs_the_same_schedule_under_trainer_and_untier(tmp_path):
    """The Done-when of the config: one command line, parsed once, drives a Trainer run and a custom loop alike."""
    config, args = _parse(
        "--untie_at", "4", "--untie_when", "none", "--metrics_every", "2", "--max_steps", "8", "--use_cpu",
        "--per_device_train_batch_size", "8", "--report_to", "none", "--save_strategy", "no",
    )  # fmt: skip
    args.output_dir = str(tmp_path)
    callback = untie.UntieCallback(config)
    tf.Trainer(model=tiny_model("gpt2"), args=args, train_dataset=ToyLMDataset(), callbacks=[callback]).train()
    model = tiny_model("gpt2")
    untier = untie.Untier(model, config=config, max_steps=args.max_steps)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    untier.start(optimizer)
    ids = ToyLMDataset(n=8).ids
    for _ in range(args.max_steps):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        untier.step()
    untier.close()
    for adapter in (callback, untier):
        assert (adapter.untie_step, adapter.untie_reason) == (4, "deadline")
        assert [h["step"] for h in adapter.history] == [2, 4, 6, 8]


def test_importing_the_config_imports_neither_torch_nor_transformers():
    roots = "('torch', 'transformers')"
    code = f"import sys, untie.decision.settings; print(sorted(m for m in sys.modules if m.split('.')[0] in {roots}))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("pairs", "says"),
    [
        ("[[1.5, 2]]", "holds 1.5, not a whole-number token id"),
        ('["12", "34"]', "'12' is not a pair of token ids"),
        ('{"12": 1}', "pairs={'12': 1}: pass a list"),
        ("[[true, false]]", "holds True, a bool"),
        ("[[3, 3]]", "measures a symbol against itself"),
        ("[[1, -2]]", "holds a negative id"),
        ("[[1, 2, 3]]", "is not a pair of token ids"),
    ],
)
def test_pairs_are_two_different_whole_number_ids_or_refused_by_name(pairs, says):
    """Before: [[1.5, 2]] read as (1, 2), ["12", "34"] as (1, 2), (3, 4), [[true, false]] as (1, 0): other symbols."""
    with pytest.raises(ValueError, match=re.escape(says)):
        UntieConfig(pairs=pairs)


def test_pairs_take_numpy_and_torch_integers():
    import numpy as np
    import torch

    assert UntieConfig(pairs=[(np.int64(12), torch.tensor(345))]).pairs == [(12, 345)]


def test_a_rule_field_of_the_wrong_type_is_named():
    with pytest.raises(ValueError, match=re.escape("untie_when.threshold='high': pass a number")):
        UntieConfig(untie_when='{"signal": "gap", "threshold": "high"}')


@pytest.mark.parametrize(("content", "says"), [("", "not valid JSON"), ('{"untie_at": ', "not valid JSON"),
                                               ("[1, 2]", "holds list"), ("null", "holds NoneType")])  # fmt: skip
def test_a_damaged_or_non_object_json_file_is_refused_naming_it(content, says, tmp_path):
    path = tmp_path / "untie.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=re.escape(f"UntieConfig.from_json_file('{path}'): the file ")) as error:
        UntieConfig.from_json_file(path)
    assert says in str(error.value)


def test_the_defaults_survive_a_round_trip_through_to_dict_and_to_json():
    """Issue 67: `UntieConfig(**config.to_dict())` keeps the default plan (the unset schedule stays unset), and so do
    the JSON forms (`to_json_dict` leaves an unset schedule setting out); a schedule written out counts as asked for."""
    default = untie.UntieConfig()
    for again in (
        untie.UntieConfig(**default.to_dict()),
        untie.UntieConfig(**copy.deepcopy(default.to_dict())),
        untie.UntieConfig.from_json(default.to_json()),
        untie.UntieConfig(**default.to_json_dict()),
    ):
        policy = again.chosen_policy()[0]
        assert again == default and policy == untie.decision.settings.DEFAULT_POLICY == "by-share"
    written = untie.UntieConfig(**json.loads(json.dumps(default.to_dict())))  # the values, written out by hand
    assert written != default and written.chosen_policy()[0] == "off"


def test_the_settings_former_module_still_answers_and_names_their_new_place():
    with pytest.warns(FutureWarning, match="moved to untie.decision.settings.UntieConfig"):
        from untie.config import UntieConfig
    assert UntieConfig is untie.UntieConfig
    with pytest.raises(ImportError):
        from untie.config import NoSuchSetting  # noqa: F401


def test_the_decision_package_answers_its_modules_by_attribute_in_a_fresh_process():
    script = "import untie; print(untie.decision.settings.UntieConfig is untie.UntieConfig)"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "True", result.stderr[-2000:]


def test_the_settings_hold_plain_values_and_record_what_was_given_beside_them():
    """Issue 79, item 1: no sentinel subclasses (what `torch.compile` tripped on): an unset schedule setting holds its
    plain default, and whether it was given is recorded beside the values; `replace` keeps it unset."""
    default = untie.UntieConfig()
    assert type(default.untie_at) is float and type(default.untie_when) is str
    assert all(type(value) in (int, float, str, bool, type(None)) for value in default.values().values())
    assert not default.was_set("untie_at") and not default.was_set("untie_when")
    later = default.replace(metrics_every=10)
    assert not later.was_set("untie_at") and later.chosen_policy() == default.chosen_policy()
    given = untie.UntieConfig(untie_at=0.3)
    assert given.untie_at == default.untie_at and given.was_set("untie_at") and given != default
    assert given.replace(metrics_every=10).was_set("untie_at")
