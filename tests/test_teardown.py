"""A closed run leaves nothing behind: after `on_train_end` / `Untier.close()`, the model, the optimizer, the Trainer
and the Accelerator carry no hook, wrapper, guard or replaced attribute of the library (`footprint.library_leftovers`
reads them off the objects), only the structure the run gave the model (an untied head, its config marker); and what
someone else installed before the run (a forward hook, a replaced `forward`) is still in place.

One process here (Trainer, `Untier` live and emulated, ZeRO's autograd tying without DeepSpeed, the run's own
registry); DDP and FSDP2 in tests/test_untier.py and tests/test_fsdp2.py (their workers check the same), DeepSpeed
in tests/test_deepspeed.py.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from footprint import foreign_installs, foreign_installs_kept, library_leftovers

import untie
from untie.core.run import UntieRun
from untie.registry import Registry
from untie.structure.surgery import UNTIED_MARKER
from untie.testing import ToyLMDataset, tiny_model

#: How each run is told: a fixed untie mid-run with measurements, the default trigger, a run that ends tied.
SCHEDULES = {
    "untie at 4": {"untie_at": 4, "untie_when": None, "metrics_every": 2, "pairs": [(3, 5)]},
    "trigger": {"untie_at": 8, "metrics_every": 1, "untie_when": {"signal": "cancellation", "warmup": 1}},
    "ends tied": {"untie_at": None, "untie_when": None, "metrics_every": 2},
}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_trainer_run_leaves_only_the_structure_and_the_train_entry(make_args, schedule):
    model = tiny_model("gpt2")
    foreign = foreign_installs(model)
    callback = untie.UntieCallback(**SCHEDULES[schedule])
    trainer = tf.Trainer(model=model, args=make_args(max_steps=8), train_dataset=ToyLMDataset(), callbacks=[callback])
    assert library_leftovers(model=model)  # the run is attached: its resume guard is on the model
    trainer.train()
    assert library_leftovers(model=model, optimizer=trainer.optimizer, accelerator=trainer.accelerator) == []
    # The Trainer keeps one thing for its life: its train() entry, where each later call (each hyperparameter_search
    # trial) is attached before Trainer builds or loads anything.
    assert library_leftovers(trainer=trainer) == ["trainer.train (replaced)"]
    assert all(foreign_installs_kept(foreign).values()), foreign_installs_kept(foreign)
    assert foreign["embedding"][3]  # the foreign forward hook was called during training, too
    untied = schedule != "ends tied"
    assert callback.untied == untied and untie.is_tied(model) == (not untied)
    assert getattr(model.config, UNTIED_MARKER, False) == untied  # the config marker: the intended structure
    trainer.remove_callback(untie.UntieCallback)
    trainer.train()  # the first call without the callback takes the entry off
    assert library_leftovers(trainer=trainer) == []


def test_a_train_call_that_raises_leaves_nothing_and_the_next_call_runs_afresh(make_args):
    class Interrupt(tf.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                raise KeyboardInterrupt

    model = tiny_model("gpt2")
    callback = untie.UntieCallback(untie_at=4, untie_when=None, metrics_every=1)
    trainer = tf.Trainer(
        model=model, args=make_args(max_steps=6), train_dataset=ToyLMDataset(), callbacks=[callback, Interrupt()]
    )
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert library_leftovers(model=model, optimizer=trainer.optimizer) == []  # on_train_end never ran
    trainer.remove_callback(Interrupt)
    trainer.train()
    assert (callback.untie_step, callback.untie_reason) == (4, "deadline")
    assert [h["step"] for h in callback.history] == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("tying_mode", ["live", "emulated"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_an_untier_run_leaves_only_the_structure(schedule, tying_mode):
    model = tiny_model("gpt2")
    foreign = foreign_installs(model)
    untier = untie.Untier(model, max_steps=8, tying_mode=tying_mode, **SCHEDULES[schedule])
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    untier.start(optimizer)
    data = ToyLMDataset(n=64).ids
    for step in range(8):
        ids = data[step * 8 : step * 8 + 8]
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        untier.step()
    assert library_leftovers(model=model, optimizer=optimizer)  # hooks are on while the run is open
    untier.close()
    assert library_leftovers(model=model, optimizer=optimizer) == []
    assert all(foreign_installs_kept(foreign).values()), foreign_installs_kept(foreign)
    assert untie.is_tied(model) == (tying_mode == "live" and schedule == "ends tied")
    untier.close()  # idempotent


def test_zero_tying_restores_a_forward_set_before_it_and_leaves_nothing():
    """ZeRO's autograd tying replaces the two modules' `forward`; its removal puts back the ones they held (here a
    foreign wrapper, as accelerate's `add_hook_to_module` sets), not the class's."""
    model = tiny_model("gpt2")  # tied: attaching under DeepSpeed gives the head its own parameter, tied in autograd
    foreign = foreign_installs(model)
    run = UntieRun(untie.UntieConfig(untie_at=3, untie_when=None, metrics_every=1))
    run.attach(model, engine="DEEPSPEED")
    assert type(run.structure.emulation).__name__ == "ZeroTying"
    assert not foreign_installs_kept(foreign)["embedding forward"]  # replaced while tied
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    run.start(optimizer, 0, 6)
    run.close()
    assert library_leftovers(model=model, optimizer=optimizer) == []
    assert all(foreign_installs_kept(foreign).values()), foreign_installs_kept(foreign)


def test_the_registry_undoes_every_install_newest_first_and_children_with_the_parent():
    class Holder:
        def step(self):
            return "class"

    holder, order = Holder(), []
    registry = Registry("run")
    registry.add("first", lambda: order.append("first"))
    registry.replace("step", holder, "step", lambda: "ours")
    child = registry.child("probe")
    child.add("child", lambda: order.append("child"))
    assert holder.step() == "ours" and registry.installed() == ["first", "step", "child"]
    child.close()
    assert order == ["child"] and registry.installed() == ["first", "step"]
    registry.child("again").add("grandchild", lambda: order.append("grandchild"))
    registry.close()
    assert order == ["child", "grandchild", "first"] and holder.step() == "class" and not registry
    registry.replace("step", holder, "step", lambda: "ours")
    holder.step = theirs = lambda: "theirs"  # someone replaced ours: the removal leaves theirs in place
    registry.close()
    assert holder.step is theirs
