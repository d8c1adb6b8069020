"""Run each case of issue 59 ("a default users can predict") on tiny offline models and print what the run said: the
line `UntieCallback()` / `Untier()` logs at train begin, the warnings, and the losses where weights were loaded by
hand, so that a reader can check the documented behaviour case by case.

    python scripts/default_cases.py
"""

from __future__ import annotations

import copy
import logging
import math
import tempfile
import warnings
from pathlib import Path

import torch
import transformers as tf

import untie
from untie.testing import ToyLMDataset, tiny_model

VOCAB = 300


class StepTask(torch.utils.data.Dataset):
    """Sequences that follow x -> (7x + 3) mod 300 from a start symbol drawn uniformly or from a Zipf law: every
    symbol equally frequent (uniform) or a few frequent ones (Zipf). A learnable task: its loss falls far below
    chance (log 300 = 5.70)."""

    def __init__(self, zipf: bool, size: int = 64, length: int = 24, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        if zipf:
            weights = 1 / torch.arange(1, VOCAB + 1).float()
            starts = torch.multinomial(weights, size, replacement=True, generator=generator)
        else:
            starts = torch.randint(VOCAB, (size,), generator=generator)
        rows = [starts]
        for _ in range(length - 1):
            rows.append((rows[-1] * 7 + 3) % VOCAB)
        self.ids = torch.stack(rows, 1)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def small_config() -> tf.GPT2Config:
    """A one-layer GPT-2 over the task's 300 symbols, without dropout."""
    return tf.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2, n_positions=32, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip


def trained_state(steps: int, lr: float, zipf: bool) -> dict:
    """The state dict of `small_config()`'s tied model after `steps` AdamW steps at `lr` on the task (seed 0)."""
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(small_config())
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    data = StepTask(zipf).ids
    for step in range(steps):
        batch = data[(step * 16) % 64 :][:16]
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict()


def task_loss(model, zipf: bool) -> float:
    """`model`'s loss on the whole task."""
    data = StepTask(zipf).ids
    with torch.no_grad():
        return float(model(input_ids=data, labels=data).loss)


def _args(folder: str, **overrides) -> tf.TrainingArguments:
    settings = dict(output_dir=folder, max_steps=10, per_device_train_batch_size=8, learning_rate=1e-6,
                    logging_steps=100, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
                    seed=0, log_level="error")  # fmt: skip
    return tf.TrainingArguments(**{**settings, **overrides})


class _Said(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("untie: "):
            self.lines.append(record.getMessage())


def _run(title: str, make, said: _Said) -> None:
    """Print `title`, then what `make()` made the run say (its plan line and warnings) and what it returns."""
    said.lines.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = make()
    print(f"\n## {title}")
    for line in said.lines:
        if line.startswith(("untie: trains", "untie: resumed")):
            print(f"  said: {line}")
    for warning in caught:
        if "untie" in str(warning.message).lower() and "metrics_every" not in str(warning.message):
            print(f"  warning: {warning.message}")
    if result:
        print(f"  {result}")


def main() -> None:
    tf.logging.set_verbosity_error()
    tf.utils.logging.disable_progress_bar()
    said = _Said()
    logging.getLogger("untie").addHandler(said)
    logging.getLogger("untie").setLevel(logging.INFO)
    folder = tempfile.mkdtemp(prefix="untie-cases-")

    for steps, lr, zipf, resize in [(300, 1e-3, False, False), (50, 1e-2, False, False), (100, 1e-3, False, False),
                                    (300, 1e-3, True, False), (300, 1e-3, False, True)]:  # fmt: skip

        def loaded_by_hand(steps=steps, lr=lr, zipf=zipf, resize=resize) -> str:
            model = tf.GPT2LMHeadModel(small_config())
            model.load_state_dict(trained_state(steps, lr, zipf))
            if resize:
                model.resize_token_embeddings(VOCAB + 8)
            before = task_loss(model, zipf)
            trainer = tf.Trainer(model=model, args=_args(folder), train_dataset=StepTask(zipf),
                                 callbacks=[untie.UntieCallback()])  # fmt: skip
            trainer.train()
            after = task_loss(model, zipf)
            return f"loss {before:.3f} loaded, {after:.3f} after 10 steps at lr 1e-6 (chance {math.log(VOCAB):.3f})"

        kind = "Zipfian" if zipf else "uniform"
        title = f"loaded by hand: {steps} AdamW steps at lr {lr:g}, {kind}{', resized +8' if resize else ''}"
        _run(title, loaded_by_hand, said)

    config_dir = Path(folder) / "config"
    tiny_model("gpt2").config.save_pretrained(config_dir)

    def from_saved_config() -> str:
        model = tf.AutoModelForCausalLM.from_config(tf.AutoConfig.from_pretrained(config_dir))
        trainer = tf.Trainer(model=model, args=_args(folder), train_dataset=ToyLMDataset(),
                             callbacks=[untie.UntieCallback()])  # fmt: skip
        trainer.train()
        return f"config names {model.name_or_path!r}"

    _run("from_config(AutoConfig.from_pretrained(dir)): built fresh", from_saved_config, said)
    for settings in ({"untie_at": 0.3}, {"untie_at": 0.3, "untie_when": "divergence"}, {"metrics_every": 10},
                     {"pairs": "auto"}):  # fmt: skip

        def with_settings(settings=settings) -> str:
            trainer = tf.Trainer(model=tiny_model("gpt2"), args=_args(folder), train_dataset=ToyLMDataset(),
                                 processing_class=untie.testing.tiny_tokenizer(),
                                 callbacks=[untie.UntieCallback(**settings)])  # fmt: skip
            trainer.train()
            return ""

        written = ", ".join(f"{k}={v!r}" for k, v in settings.items())
        _run(f"UntieCallback({written}) on a fresh model", with_settings, said)

    run_dir = str(Path(folder) / "run")

    def trainer_resume() -> str:
        args = _args(run_dir, max_steps=20, save_strategy="steps", save_steps=4, learning_rate=5e-3)
        tf.Trainer(model=tiny_model("gpt2"), args=args, train_dataset=ToyLMDataset(),
                   callbacks=[untie.UntieCallback(policy="off")]).train()  # fmt: skip
        said.lines.clear()
        model = tiny_model("gpt2")
        callback = untie.UntieCallback()
        trainer = tf.Trainer(model=model, args=args, train_dataset=ToyLMDataset(), callbacks=[callback])
        trainer.train(resume_from_checkpoint=str(Path(run_dir) / "checkpoint-4"))
        return f"untied at step {callback.untie_step} ({callback.untie_reason})"

    _run("Trainer resume of a tied-phase checkpoint under UntieCallback()", trainer_resume, said)

    def untier_resume() -> str:
        model = tiny_model("gpt2")
        first = untie.Untier(model, policy="off", max_steps=20)
        optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
        first.start(optimizer)
        data = ToyLMDataset()
        for step in range(4):
            batch = data[step]
            model(input_ids=batch["input_ids"][None], labels=batch["labels"][None]).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            first.step()
        state, weights = copy.deepcopy(first.state_dict()), copy.deepcopy(model.state_dict())
        said.lines.clear()  # what the first run said
        first.close()
        resumed_model = tiny_model("gpt2")
        resumed = untie.Untier(resumed_model, max_steps=20)
        resumed.start(torch.optim.AdamW(resumed_model.parameters(), lr=5e-3))
        resumed.load_state_dict(state)
        resumed_model.load_state_dict(weights)
        said_plan = resumed.policy_choice.reason
        resumed.close()
        return f"plan {resumed.policy_choice.plan!r} ({said_plan}); tied: {untie.is_tied(resumed_model)}"

    _run("a default Untier loading a tied-phase state saved at step 4 (policy='off')", untier_resume, said)


if __name__ == "__main__":
    main()
