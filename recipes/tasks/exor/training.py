"""EXor's training: one run of the grid (variant x model x arm x seed) with Trainer and its recorders, and the grid,
trained in parallel processes where allowed, its finished runs reused."""

from __future__ import annotations

import json
import math
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import torch
import transformers as tf

import untie
from untie_recipes.common import training_arguments, untie_outcome
from untie_recipes.kernels import check_portable
from untie_recipes.progress import JobProgress, StepReporter, quiet_trainer
from untie_recipes.schedules import periodic_cosine
from untie_recipes.tasks.exor.data import PAIRS, ExorDataset, vocabulary
from untie_recipes.tasks.exor.modeling import exor_model
from untie_recipes.tasks.exor.setup import ExorSetup


@dataclass(frozen=True)
class RunSpec:
    """One training run of the grid."""

    variant: str
    model: str
    arm: str
    seed: int

    @property
    def name(self) -> str:
        return f"{self.variant}-{self.model}-{self.arm}-{self.seed}"


def launch_rank() -> int:
    """This process's rank under torchrun / accelerate launch (0 when launched alone)."""
    return int(os.environ.get("RANK", "0"))


def launch_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


class GeometryRecorder(tf.TrainerCallback):
    """Records the paper's measure: Euclidean distances between rows of the input and output tables, per pair."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.history: list[dict] = []

    def record(self, step: int, model) -> None:
        def distances(weight: torch.Tensor) -> dict[str, float]:
            weight = weight.detach().float()
            return {f"{a}-{b}": float(torch.dist(weight[a], weight[b])) for a, b in PAIRS}

        self.history.append(
            {
                "step": step,
                "tied": untie.is_tied(model),
                "input": distances(model.get_input_embeddings().weight),
                "output": distances(model.get_output_embeddings().weight),
            }
        )

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.record(state.global_step, model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.every == 0 or state.global_step == state.max_steps:
            self.record(state.global_step, model)


class ReleaseFinishedEpochs(tf.TrainerCallback):
    """Work around an upstream slowdown of full-batch training (transformers 5.23 + accelerate 1.15).

    Trainer stops reading an epoch after its last step instead of exhausting the iterator, so accelerate's
    `DataLoaderShard` never reaches `end()`, and its `GradientState` keeps one more dataloader reference per epoch,
    which it dereferences on every step. With one step per epoch (EXor) a 150k-step run slows from ~5 to ~15 ms per
    step. accelerate PR #4248 (open) moves `end()` into a `finally`; until then, end the epoch here.
    """

    def on_epoch_end(self, args, state, control, train_dataloader=None, **kwargs):
        if hasattr(train_dataloader, "end"):
            train_dataloader.end()


def masked_accuracy(eval_pred: tf.EvalPrediction) -> dict[str, float]:
    predictions, labels = eval_pred.predictions, eval_pred.label_ids
    scored = labels != -100
    return {"accuracy": float((predictions[scored] == labels[scored]).mean())}


def arm_callbacks(arm: str, setup: ExorSetup) -> tuple[bool, list[tf.TrainerCallback]]:
    """Whether the arm's model starts tied, and the untie callback it trains with (the tied arm measures too)."""
    config = setup.arm_config(arm)
    return (False, []) if config is None else (True, [untie.UntieCallback(config)])


def _training_arguments(spec: RunSpec, setup: ExorSetup, runs_dir: str, train_size: int) -> tf.TrainingArguments:
    """One run's Trainer arguments: the parsed ones, with one full batch of the training strings per step (as in the
    paper), the run's seed and its own folder."""
    return training_arguments(
        setup.training,
        output_dir=os.path.join(runs_dir, spec.name),
        per_device_train_batch_size=math.ceil(train_size / launch_world_size()),
        run_name=spec.name,
        seed=spec.seed,
    )


def _eval_history(log: list[dict], splits: list[str]) -> list[dict]:
    """Per evaluation step, each split's accuracy and loss, from Trainer's log history."""
    evals: dict[int, dict] = {}
    for entry in log:
        for split in splits:
            if f"eval_{split}_accuracy" in entry:
                row = evals.setdefault(entry["step"], {"step": entry["step"]})
                row[f"{split}_accuracy"] = entry[f"eval_{split}_accuracy"]
                row[f"{split}_loss"] = entry[f"eval_{split}_loss"]
    return list(evals.values())


def _run_record(spec: RunSpec, setup: ExorSetup, trainer: tf.Trainer, callback, recorder: GeometryRecorder,
                final: dict, splits: list[str], started: float) -> dict:  # fmt: skip
    """The run's record: its summary, its untie, and its histories (geometry, training loss, evaluations, signals)."""
    log = trainer.state.log_history
    last = recorder.history[-1]
    trigger = callback.divergence if callback else None
    return {
        "variant": spec.variant,
        "model": spec.model,
        "arm": spec.arm,
        "seed": spec.seed,
        **untie_outcome(trainer, callback),
        "trigger_pairs": trigger.fired_pairs if trigger else [],
        "final_loss": final["final_train_loss"],
        "heldout_loss": final["final_heldout_loss"],
        "train_accuracy": final["final_train_accuracy"],
        "heldout_accuracy": final["final_heldout_accuracy"],
        "input_distance": last["input"],
        "output_distance": last["output"],
        "bayes_accuracy": vocabulary(spec.variant).bayes_accuracy(),
        "runtime_s": round(time.perf_counter() - started, 1),
        "history": {
            "geometry": recorder.history,
            "train": [{"step": e["step"], "loss": e["loss"], "lr": e["learning_rate"]} for e in log if "loss" in e],
            "eval": _eval_history(log, splits),
            "signals": callback.history if callback else [],
        },
        "settings": _settings(setup),
    }


def _settings(setup: ExorSetup) -> dict:
    """What a record keeps of the settings: the recipe's (but the grid), the optimiser's, the untie settings."""
    settings = {k: v for k, v in asdict(setup.args).items() if k not in ("variants", "models", "arms", "seeds")}
    training = setup.training
    settings.update(max_steps=training.max_steps, learning_rate=training.learning_rate)
    settings.update(weight_decay=training.weight_decay, adam_epsilon=training.adam_epsilon)
    return {**settings, "max_grad_norm": training.max_grad_norm, "untie": setup.untie.to_json_dict()}


def train_run(spec: RunSpec, setup: ExorSetup, runs_dir: str, progress: JobProgress | Any | None = None) -> dict:
    """Train one run and write its record (summary + histories) to runs_dir/<name>.json. `progress` is the job's
    progress line (same process) or its queue (a worker process); None keeps Trainer's own bar or log printer."""
    check_portable(setup.args.kernels, on_cpu=setup.training.use_cpu)  # before this process computes anything
    torch.set_num_threads(1)  # the models are tiny: parallel runs beat intra-op threads
    tf.logging.set_verbosity_warning()
    started = time.perf_counter()
    args, training = setup.args, setup.training
    tied, callbacks = arm_callbacks(spec.arm, setup)
    tf.set_seed(spec.seed)
    model = exor_model(spec.model, tied=tied)
    # Each process draws its own surface forms: identical generators would give every rank the same draws.
    data_seed = spec.seed + 1000 * launch_rank()
    train_set = ExorDataset("train", spec.variant, seed=data_seed)
    eval_sets = {
        "train": ExorDataset("train", spec.variant, seed=data_seed + 1, repeats=args.eval_repeats),
        "heldout": ExorDataset("heldout", spec.variant, seed=data_seed + 2, repeats=8 * args.eval_repeats),
    }
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=training.learning_rate, weight_decay=training.weight_decay, eps=training.adam_epsilon
    )
    scheduler = periodic_cosine(optimizer, training.learning_rate, args.lr_min, args.cosine_steps)
    recorder = GeometryRecorder(args.record_every)
    trainer = tf.Trainer(
        model=model,
        args=_training_arguments(spec, setup, runs_dir, len(train_set)),
        train_dataset=train_set,
        eval_dataset=eval_sets,
        optimizers=(optimizer, scheduler),
        compute_metrics=masked_accuracy,
        preprocess_logits_for_metrics=lambda logits, labels: logits.argmax(-1),
        callbacks=[*callbacks, recorder, ReleaseFinishedEpochs()],
    )
    if progress is not None:
        quiet_trainer(trainer)
        direct = isinstance(progress, JobProgress)
        trainer.add_callback(progress.callback(spec.name) if direct else StepReporter(progress, spec.name))
    trainer.train()
    final_sets = {
        "train": ExorDataset("train", spec.variant, seed=data_seed + 3, repeats=4 * args.eval_repeats),
        "heldout": ExorDataset("heldout", spec.variant, seed=data_seed + 4, repeats=32 * args.eval_repeats),
    }
    final = {}
    for split, dataset in final_sets.items():
        final.update(trainer.evaluate(dataset, metric_key_prefix=f"final_{split}"))
    callback = next((cb for cb in callbacks if isinstance(cb, untie.UntieCallback)), None)
    record = _run_record(spec, setup, trainer, callback, recorder, final, list(eval_sets), started)
    if trainer.is_world_process_zero():  # write then rename: a reader never sees half a record
        path = Path(runs_dir, f"{spec.name}.json")
        path.with_suffix(".tmp").write_text(json.dumps(record))
        path.with_suffix(".tmp").replace(path)
    return record


def run_grid(setup: ExorSetup) -> list[dict]:
    """Train every missing run of the grid (none with --report_only) and load the finished runs' records."""
    args = setup.args
    runs_dir = os.path.join(setup.output_dir, "runs")
    os.makedirs(runs_dir, exist_ok=True)
    specs = [
        RunSpec(variant, model, arm, seed)
        for variant in args.variants
        for model in args.models
        for arm in args.arms
        for seed in args.seeds
    ]
    todo = [s for s in specs if args.overwrite or not Path(runs_dir, f"{s.name}.json").exists()]
    if args.report_only:
        missing = {s.name for s in todo}
        print(f"EXor: {len(specs)} runs, {len(missing)} not trained yet (left out): {', '.join(sorted(missing))}")
        if len(missing) == len(specs):
            raise FileNotFoundError(f"--report_only: no finished run of this grid in {runs_dir}; train some first.")
        specs = [s for s in specs if s.name not in missing]
    else:
        train_missing(todo, len(specs), setup, runs_dir)
        if launch_rank() != 0:
            return []  # only rank 0 writes records and the report
    return [json.loads(Path(runs_dir, f"{spec.name}.json").read_text()) for spec in specs]


def train_missing(todo: list[RunSpec], total: int, setup: ExorSetup, runs_dir: str) -> None:
    """Train the runs in `todo` (of `total` in the grid), in parallel processes where allowed."""
    workers = setup.args.workers or min(os.cpu_count() or 1, 8)
    workers = 1 if launch_world_size() > 1 else max(1, min(workers, len(todo)))
    print(f"EXor: {total} runs, {total - len(todo)} already done, training {len(todo)} with {workers} workers")
    if setup.training.disable_tqdm:  # no line: each run's Trainer prints its logs
        progress = None
    else:
        progress = JobProgress(len(todo), setup.training.max_steps, description="EXor", disable=launch_rank() != 0)
    try:
        # Portable kernels need a process that has computed nothing yet: each run gets a fresh worker unless this
        # process is one already (a rank of a multi-process launch, started in the portable environment).
        fresh_processes = setup.args.kernels == "portable" and launch_world_size() == 1
        if workers == 1 and not fresh_processes:
            for spec in todo:
                train_run(spec, setup, runs_dir, progress)
        else:
            context = get_context("spawn")
            with ProcessPoolExecutor(workers, mp_context=context) as pool:
                queue = progress.queue(context) if progress else None
                futures = [pool.submit(train_run, spec, setup, runs_dir, queue) for spec in todo]
                if progress:
                    progress.follow(futures)
                for future in futures:
                    future.result()
    finally:
        if progress:
            progress.close()
