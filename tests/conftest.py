"""Shared fixtures: a Trainer factory on tiny models and toy data (CPU, no download)."""

from __future__ import annotations

import inspect
import os
import re

import launch
import pytest
import torch
import transformers as tf

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
tf.logging.set_verbosity_error()


#: The fixtures that build a `transformers.Trainer` run: a test taking one trains through Trainer (marker `trainer`).
TRAINER_FIXTURES = frozenset({"make_args"})


#: The markers of what the quick set (`-m quick`) leaves out: long runs, the recipes' and docs' tests, launches,
#: Trainer runs, tests that start a Python process of their own, and `torch.compile`.
NOT_QUICK = ("slow", "recipes", "distributed", "trainer", "process", "compile")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Record the collected tests by node id for tests/launch.py, which refuses a launch from an unmarked test; mark
    every test that takes a Trainer fixture (`TRAINER_FIXTURES`) or builds a Trainer in its own code `trainer`, every
    test whose own code starts a Python process (`subprocess`, `sys.executable`) `process` (its own code: with its
    module's helpers that it calls, `_own_source`), and every test none of
    `NOT_QUICK` marks `quick`: the library's unit tests a change is checked with (about a minute on 2 cores)."""
    launch.COLLECTED.update((item.nodeid, item) for item in items)
    for item in items:
        source = _own_source(item)
        if TRAINER_FIXTURES & set(getattr(item, "fixturenames", ())) or re.search(r"Trainer\(", source):
            item.add_marker(pytest.mark.trainer)
        if re.search(r"\bsubprocess\.|\bsys\.executable\b", source):
            item.add_marker(pytest.mark.process)
        if not any(item.get_closest_marker(name) for name in NOT_QUICK):
            item.add_marker(pytest.mark.quick)


def _own_source(item: pytest.Item) -> str:
    """The test function's code and that of the module's own helpers it calls by name (one level): where a Trainer is
    built (`transformers.Trainer`, TRL's `SFTTrainer`) or a process started. A helper imported from elsewhere is not
    read."""
    function = getattr(item, "function", None)
    try:
        source = inspect.getsource(function) if function is not None else ""
    except (OSError, TypeError):
        return ""
    module = getattr(item, "module", None)
    for name in sorted(set(re.findall(r"\b(_\w+)\(", source))):
        helper = getattr(module, name, None)
        if inspect.isfunction(helper) and helper.__module__ == getattr(module, "__name__", None):
            source += inspect.getsource(helper)
    return source


def training_args(default_dir, **overrides) -> tf.TrainingArguments:
    settings = dict(
        output_dir=str(overrides.pop("output_dir", default_dir)),
        max_steps=12,
        per_device_train_batch_size=8,
        learning_rate=5e-3,
        weight_decay=0.1,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
    )
    settings.update(overrides)
    return tf.TrainingArguments(**settings)


@pytest.fixture
def make_args(tmp_path):
    return lambda **overrides: training_args(tmp_path / "run", **overrides)


def assert_resumed_equals(model, final: dict, checkpoint: str, tolerance: float = 1e-6) -> None:
    """A resumed run's parameters equal the uninterrupted run's `final` ones (name -> tensor) within `tolerance`."""
    params = dict(model.named_parameters())
    assert params.keys() == final.keys()
    worst = max((params[name].detach() - final[name]).abs().max().item() for name in final)
    assert worst <= tolerance, (checkpoint, worst)


def assert_reloads_untied(folder, final: dict) -> None:
    """Plain transformers reloads the GPT-2 checkpoint in `folder` untied, with the trained head of `final`."""
    import untie

    reloaded = tf.GPT2LMHeadModel.from_pretrained(folder)
    assert not untie.is_tied(reloaded)
    assert torch.equal(reloaded.lm_head.weight, final["lm_head.weight"])


#: (steps, lr, freeze_embedding) -> the trained weights and torch's RNG state once training ended.
_STEP_LLAMAS: dict[tuple[int, float, bool], tuple[dict[str, torch.Tensor], torch.Tensor]] = {}


def trained_step_llama(steps: int, lr: float, freeze_embedding: bool = False) -> tf.LlamaForCausalLM:
    """A tied Llama trained `steps` AdamW steps on the step task from seed 0 (`untie.testing.train_on_step_task`).
    Each setting trains once per process; later calls build the model and load those weights, and leave torch's RNG
    where training left it, so a test that draws after this call draws what it would after training."""
    from untie.testing import step_llama_config, train_on_step_task

    key = (steps, lr, freeze_embedding)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(step_llama_config())
    if key not in _STEP_LLAMAS:
        train_on_step_task(model, steps, lr, freeze_embedding)
        state = {name: value.detach().clone() for name, value in model.state_dict().items()}
        _STEP_LLAMAS[key] = (state, torch.get_rng_state())
        return model
    state, rng = _STEP_LLAMAS[key]
    model.load_state_dict(state)
    torch.set_rng_state(rng)
    return model
