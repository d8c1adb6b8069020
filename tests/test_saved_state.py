"""A custom loop's untie state and its weights belong together: `accelerator.save_state` writes the state last, and
`load_state` / `load_state_dict` refuse, by name, a state next to weights of another step or run, or a damaged one."""

from __future__ import annotations

import json
import shutil

import accelerate.checkpointing
import pytest
import torch
from accelerate import Accelerator

import untie
import untie.adapters.untier
from untie.checkpoints.saved_state import STATE_FILE, UntieStateError
from untie.testing import ToyLMDataset, tiny_model

STEPS, UNTIE_AT = 10, 6


class Killed(BaseException):
    """Stands for the process being killed part way through a save (nothing catches it)."""


def _run(*, saves=None, resume_from=None, seed=0, stop=STEPS):
    """The accelerate loop of the docs on one process: one full batch a step, untie at UNTIE_AT. `saves` maps a step
    to the folder `save_state` writes after it; returns the final parameters and the Untier."""
    accelerator = Accelerator(cpu=True)
    model = tiny_model("llama", seed=seed)
    untier = untie.Untier(model, max_steps=STEPS, untie_when=None, untie_at=UNTIE_AT, accelerator=accelerator)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / (2 * STEPS))
    prepared, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    untier.start(optimizer)
    try:
        if resume_from is not None:
            accelerator.load_state(str(resume_from))
        data = ToyLMDataset(n=8, seed=seed)
        batch = {"input_ids": data.ids, "labels": data.ids.clone()}
        for step in range(untier.global_step + 1, stop + 1):
            accelerator.backward(prepared(**batch).loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            untier.step()
            if step in (saves or {}):
                accelerator.save_state(str(saves[step]))
        return {name: value.detach().clone() for name, value in model.state_dict().items()}, untier
    finally:
        untier.close()
        accelerator.free_memory()


@pytest.fixture(scope="module")
def uninterrupted():
    params, untier = _run()
    assert (untier.untie_step, untier.untie_reason) == (UNTIE_AT, "deadline")
    return params


def _assert_same_run(params, expected):
    assert params.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(params[name], value, rtol=0, atol=1e-6, msg=name)


def test_a_complete_in_place_save_resumes_to_the_uninterrupted_run(tmp_path, uninterrupted):
    folder = tmp_path / "ckpt"
    _run(saves={4: folder, 7: folder}, stop=7)  # the second save overwrites the first in place, after the untie
    state = json.loads((folder / STATE_FILE).read_text())
    assert state["global_step"] == 7 and state["attributes"]["untied"] and state["weights"]["separate_head"]
    params, resumed = _run(resume_from=folder)
    assert (resumed.untie_step, resumed.untie_reason) == (UNTIE_AT, "deadline")
    _assert_same_run(params, uninterrupted)


# Points of accelerate's save_state a kill can fall on: before the model file, between the model and the optimizer,
# between the optimizer and the scheduler/RNG files, and once accelerate is done but the untie state is not written.
KILL_POINTS = ["before-weights", "after-weights", "after-optimizer", "before-untie-state"]


@pytest.fixture(scope="module")
def tied_save(tmp_path_factory):
    """A complete save at step 4 (tied), made once: each killed save below overwrites its own copy of it."""
    folder = tmp_path_factory.mktemp("tied") / "ckpt"
    _run(saves={4: folder}, stop=4)
    return folder


@pytest.mark.parametrize("save_step", [UNTIE_AT, UNTIE_AT + 2], ids=["at-the-untie", "after-the-untie"])
@pytest.mark.parametrize("point", KILL_POINTS)
def test_a_save_killed_while_overwriting_a_folder_is_refused_by_name_or_resumes_exactly(
    point, save_step, tmp_path, monkeypatch, uninterrupted, tied_save
):
    folder = tmp_path / "ckpt"
    shutil.copytree(tied_save, folder)  # a complete save at step 4, tied
    writes = {"count": 0}
    save = accelerate.checkpointing.save

    def killed_save(obj, f, *args, **kwargs):  # accelerate's writer of the model, optimizer and scheduler files
        if (point, writes["count"]) in {("before-weights", 0), ("after-weights", 1), ("after-optimizer", 2)}:
            raise Killed
        writes["count"] += 1
        return save(obj, f, *args, **kwargs)

    def killed_write(*args, **kwargs):
        raise Killed

    monkeypatch.setattr(accelerate.checkpointing, "save", killed_save)
    if point == "before-untie-state":
        monkeypatch.setattr(untie.adapters.untier, "write_state_file", killed_write)
    with pytest.raises(Killed):
        _run(saves={save_step: folder}, stop=save_step)
    monkeypatch.undo()
    try:
        params, resumed = _run(resume_from=folder)
    except (FileNotFoundError, UntieStateError) as refused:
        assert str(folder) in str(refused) and "did not finish" in str(refused)
        return
    _assert_same_run(params, uninterrupted)


@pytest.fixture(scope="module")
def saves(tmp_path_factory):
    """Complete saves at steps 5 (tied) and 7, 9 (untied) of one run, and at 9 of a run with another seed."""
    root = tmp_path_factory.mktemp("saves")
    _run(saves={step: root / f"step-{step}" for step in (5, 7, 9)})
    _run(saves={9: root / "other-run-9"}, seed=1)
    return root


@pytest.mark.parametrize(
    ("weights", "state", "says"),
    [
        ("step-5", "step-7", "head that is its own tensor"),  # reproduced: loaded as "step 7, untied" before
        ("step-9", "step-7", "values differ"),
        ("step-7", "step-9", "values differ"),
        ("step-9", "other-run-9", "values differ"),
    ],
)
def test_a_state_file_from_another_step_or_run_is_refused_before_anything_loads(weights, state, says, saves, tmp_path):
    folder = tmp_path / "mixed"
    shutil.copytree(saves / weights, folder)
    shutil.copy(saves / state / STATE_FILE, folder / STATE_FILE)
    with pytest.raises(UntieStateError, match=says) as refused:
        _run(resume_from=folder)
    assert str(folder) in str(refused.value) and "not saved together" in str(refused.value)


DAMAGED = {
    "half-written": lambda text: text[: len(text) // 2],
    "empty": lambda text: "",
    "random-bytes": lambda text: b"\x8f\x00\xff\xfe\x13garbage\x9c".decode("latin-1"),
    "a-list": lambda text: "[1, 2, 3]",
    "missing-keys": lambda text: json.dumps({k: v for k, v in json.loads(text).items() if k != "attributes"}),
    "string-step": lambda text: json.dumps({**json.loads(text), "global_step": "7"}),
    "no-weights-record": lambda text: json.dumps({k: v for k, v in json.loads(text).items() if k != "weights"}),
    "bad-untied": lambda text: json.dumps({**json.loads(text), "attributes": {"untied": "yes"}}),
}


@pytest.mark.parametrize("damage", list(DAMAGED))
def test_a_damaged_state_file_gets_the_librarys_message_naming_the_file(damage, saves, tmp_path):
    folder = tmp_path / "damaged"
    shutil.copytree(saves / "step-7", folder)
    path = folder / STATE_FILE
    damaged = DAMAGED[damage](path.read_text())
    path.write_bytes(damaged.encode("latin-1") if damage == "random-bytes" else damaged.encode())
    with pytest.raises(UntieStateError, match="is damaged") as refused:
        _run(resume_from=folder)
    assert str(path) in str(refused.value) and "resume from an earlier complete checkpoint" in str(refused.value)


def test_a_folder_with_the_untie_state_but_no_weights_is_named_incomplete(saves, tmp_path):
    folder = tmp_path / "no-weights"
    shutil.copytree(saves / "step-7", folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="is incomplete") as refused:
        _run(resume_from=folder)
    assert str(folder) in str(refused.value)


def _plain_run(steps: int, saved_at=None):
    model = tiny_model("llama")
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    untier = untie.Untier(model, optimizer, max_steps=12, untie_when=None, untie_at=UNTIE_AT)
    data = ToyLMDataset(n=8)
    batch = {"input_ids": data.ids, "labels": data.ids.clone()}
    saved = {}
    for step in range(1, steps + 1):
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        untier.step()
        saved[step] = {
            "model": {k: v.clone() for k, v in model.state_dict().items()},
            "optimizer": optimizer.state_dict(),
            "untie": json.loads(json.dumps(untier.state_dict())),
        }
    return saved


def test_plain_loop_weights_of_another_step_than_the_untie_state_are_refused_before_the_next_step():
    saved = _plain_run(9)
    model = tiny_model("llama")
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    untier = untie.Untier(model, max_steps=12, untie_when=None, untie_at=UNTIE_AT)
    untier.start(optimizer)
    untier.load_state_dict(saved[7]["untie"])
    model.load_state_dict(saved[9]["model"])  # the weights of a later step
    before = model.get_input_embeddings().weight.detach().clone()
    model(input_ids=torch.tensor([[3, 4, 5]]), labels=torch.tensor([[3, 4, 5]])).loss.backward()
    with pytest.raises(UntieStateError, match="values differ.*load_state_dict"):
        optimizer.step()
    assert torch.equal(model.get_input_embeddings().weight, before)  # refused before the step changed anything


@pytest.mark.parametrize(
    ("state", "says"),
    [
        ([1, 2], "holds a JSON list"),
        ({"format": 3}, "'global_step' is missing"),
        ("format-1", "format 1"),
        ("string-step", "'global_step' is '7', not an int"),
    ],
)
def test_plain_loop_damaged_states_are_refused_with_the_librarys_message(state, says):
    good = _plain_run(2)[2]["untie"]
    if isinstance(state, str):
        state = {"format-1": {**good, "format": 1}, "string-step": {**good, "global_step": "7"}}[state]
    model = tiny_model("llama")
    untier = untie.Untier(model, max_steps=12, untie_when=None, untie_at=UNTIE_AT)
    untier.start(torch.optim.AdamW(model.parameters()))
    with pytest.raises(UntieStateError, match=says) as refused:
        untier.load_state_dict(state)
    assert "Untier.load_state_dict" in str(refused.value)


def test_plain_loop_resume_that_unties_at_once_under_a_new_deadline_still_accepts_its_own_weights():
    """A tied checkpoint resumed with an earlier untie_at unties at the resume step, before its first forward (the
    optimizer state loads first, into the tied structure it was saved from): the head is then a copy of the
    checkpoint's matrix, which the weights check must accept (and it must still refuse other weights)."""
    import warnings

    saved = _plain_run(4)
    for weights, refused in ((saved[4]["model"], False), (saved[3]["model"], True)):
        model = tiny_model("llama")
        optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
        untier = untie.Untier(model, max_steps=12, untie_when=None, untie_at=2)
        untier.start(optimizer)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "resumed with changed settings"
            untier.load_state_dict(saved[4]["untie"])
        assert not untier.untied and untier.run.pending_untie == 4  # at the first forward, once the state loaded
        model.load_state_dict(weights)
        model(input_ids=torch.tensor([[3, 4, 5]]), labels=torch.tensor([[3, 4, 5]])).loss.backward()
        assert untier.untied and untier.untie_step == 4
        if refused:
            with pytest.raises(UntieStateError, match="values differ"):
                optimizer.step()
        else:
            optimizer.step()
            untier.step()
