"""BookCorpus's training: the corpus prepared once for every arm, the measurements (masked-token accuracy, the
word-twin distances, training throughput), and one arm trained with Trainer and recorded."""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import datasets
import evaluate
import numpy as np
import torch
import transformers as tf
from accelerate import PartialState

import untie
from untie.signals.metrics import pair_distances
from untie_recipes.common import training_arguments, untie_outcome
from untie_recipes.progress import JobProgress, quiet_trainer
from untie_recipes.schedules import periodic_cosine
from untie_recipes.tasks.bookcorpus.data import (
    TwinTable,
    build_twins,
    lm_collator,
    load_corpus,
    load_tokenizer,
    tokenize_corpus,
)
from untie_recipes.tasks.bookcorpus.modeling import paper_mlm_model, small_gpt2
from untie_recipes.tasks.bookcorpus.setup import BookCorpusArguments, BookCorpusSetup

# -- Data --


@dataclass
class PreparedData:
    """What every arm shares: tokenizer, twins, tokenised splits."""

    tokenizer: tf.PreTrainedTokenizerBase
    twins: TwinTable
    train: datasets.Dataset | datasets.IterableDataset
    validation: datasets.Dataset | datasets.IterableDataset

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer) + len(self.twins.twin_ids)


def prepare_data(setup: BookCorpusSetup) -> PreparedData:
    """Load, tokenise and twin the corpus. The main process goes first: it trains and caches a `--tokenizer train`
    vocabulary and fills the datasets cache, which the other processes then reuse."""
    args, seed = setup.args, setup.training.seed
    state = PartialState()  # under torchrun / accelerate launch this starts the process group Trainer will use
    with state.main_process_first():
        corpus = load_corpus(
            args.dataset,
            dataset_config=args.dataset_config,
            data_files=args.data_files,
            streaming=args.streaming,
            seed=seed,
        )
        texts = None
        if args.tokenizer == "train":
            train = corpus["train"]
            texts = (row[args.text_column] for row in (train.take(200_000) if args.streaming else train))
        tokenizer = load_tokenizer(
            args.tokenizer, texts, args.tokenizer_vocab_size, cache_dir=os.path.join(setup.output_dir, "tokenizer")
        )
        twins = build_twins(tokenizer, args.twins)
        tokenized = tokenize_corpus(
            corpus, tokenizer, args.objective, args.max_length, args.text_column, args.preprocessing_num_workers
        )
    train, validation = tokenized["train"], tokenized["validation"]
    if args.max_train_samples:  # Dataset.take and IterableDataset.take both stop early on a shorter set
        train = train.take(args.max_train_samples if args.streaming else min(args.max_train_samples, len(train)))
    if args.max_eval_samples:
        validation = validation.take(
            args.max_eval_samples if args.streaming else min(args.max_eval_samples, len(validation))
        )
    return PreparedData(tokenizer, twins, train, validation)


# -- Measurement --


class MaskedTokenAccuracy(evaluate.Metric):
    """Accuracy over labelled positions (label != -100): masked tokens for MLM, next tokens for CLM. A local
    `evaluate` module, so evaluation needs no download."""

    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description="Accuracy over the positions whose label is not -100.",
            citation="",
            inputs_description="predictions and references: int token ids, -100 references ignored",
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references) -> dict[str, float]:
        predictions, references = np.asarray(predictions), np.asarray(references)
        return {"accuracy": float((predictions == references).mean()) if len(references) else float("nan")}


def accuracy_metric(objective: str):
    """compute_metrics for Trainer: predictions arrive as argmax ids (see `preprocess_logits_for_metrics`)."""
    metric = MaskedTokenAccuracy()

    def compute(eval_pred: tf.EvalPrediction) -> dict[str, float]:
        predictions, labels = eval_pred.predictions, eval_pred.label_ids
        if objective == "clm":  # position t predicts token t + 1
            predictions, labels = predictions[:, :-1], labels[:, 1:]
        scored = labels != -100
        return metric.compute(predictions=predictions[scored], references=labels[scored])

    return compute


class TwinDistanceRecorder(tf.TrainerCallback):
    """The paper's measure at every evaluation: mean Euclidean distance word-twin (DH and skewed twins) and between
    random different words, in the input and the output space; with the evaluation's loss, perplexity, accuracy."""

    def __init__(self, twins: TwinTable) -> None:
        self.groups = {
            "twin-dh": twins.pairs_where(skewed=False),
            "twin-skewed": twins.pairs_where(skewed=True),
            "random": twins.random_pairs(),
        }
        self.groups = {name: pairs for name, pairs in self.groups.items() if pairs}
        self.history: list[dict] = []

    def distances(self, model) -> dict[str, dict[str, float]]:
        spaces = {"input": model.get_input_embeddings().weight, "output": model.get_output_embeddings().weight}
        return {
            space: {name: float(np.mean(list(pair_distances(w, p).values()))) for name, p in self.groups.items()}
            for space, w in spaces.items()
        }

    def on_evaluate(self, args, state, control, model=None, metrics=None, **kwargs):
        loss = metrics["eval_loss"]
        self.history.append(
            {
                "step": state.global_step,
                "loss": loss,
                "perplexity": math.exp(min(loss, 50.0)),
                "accuracy": metrics.get("eval_accuracy"),
                "tied": untie.is_tied(model),
                "distances": self.distances(model),
            }
        )


class ThroughputMeter(tf.TrainerCallback):
    """Training tokens per second (non-padding tokens over all ranks), counting only the time between optimizer
    steps: evaluation, logging and checkpointing are left out so arms compare on training work alone."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.tokens = 0
        self._last: float | None = None
        self._tokens_at_last = 0

    def _restart(self, state) -> None:
        self._last, self._tokens_at_last = time.perf_counter(), state.num_input_tokens_seen

    def on_step_end(self, args, state, control, **kwargs):
        if self._last is not None:
            self.seconds += time.perf_counter() - self._last
            self.tokens += state.num_input_tokens_seen - self._tokens_at_last
        self._restart(state)

    # The first step (warm-up) is never counted; time spent outside steps restarts the clock.
    def on_evaluate(self, args, state, control, **kwargs):
        self._restart(state)

    def on_log(self, args, state, control, **kwargs):
        self._restart(state)

    def on_save(self, args, state, control, **kwargs):
        self._restart(state)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else float("nan")


# -- One arm --


def arm_callbacks(arm: str, setup: BookCorpusSetup, twins: TwinTable) -> tuple[bool, list[tf.TrainerCallback]]:
    """Whether the arm's model starts tied, and its untie callback (`BookCorpusSetup.arm_config`)."""
    config = setup.arm_config(arm, twins.pairs if setup.args.auto_pairs == "twins" else "auto")
    return arm != "untied", [] if config is None else [untie.UntieCallback(config)]


def build_model(args: BookCorpusArguments, vocab_size: int, pad_token_id: int, tied: bool):
    sizes = dict(
        hidden_size=args.hidden_size,
        num_hidden_layers=args.num_hidden_layers,
        num_attention_heads=args.num_attention_heads,
        intermediate_size=args.intermediate_size,
    )
    if args.objective == "clm":
        return small_gpt2(vocab_size, tied=tied, max_length=args.max_length, init_std=args.init_std, **sizes)
    return paper_mlm_model(
        vocab_size,
        tied=tied,
        pad_token_id=pad_token_id,
        position_embeddings=args.position_embeddings,
        max_position_embeddings=args.max_length,
        init_std=args.init_std,
        **sizes,
    )


def launch_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _arm_record(arm: str, setup: BookCorpusSetup, data: PreparedData, trainer: tf.Trainer, callback,
                recorder: TwinDistanceRecorder, meter: ThroughputMeter, runtime: float) -> dict:  # fmt: skip
    """The arm's record: its summary, its untie, its throughput and its histories."""
    final, args = recorder.history[-1], setup.args
    trigger = callback.divergence if callback else None
    return {
        "arm": arm,
        "objective": args.objective,
        "twins": args.twins,
        "dataset": args.dataset,
        **untie_outcome(trainer, callback),
        "trigger_pairs": _named_pairs(trigger.fired_pairs, data.tokenizer, data.twins) if trigger else [],
        "eval_loss": final["loss"],
        "perplexity": final["perplexity"],
        "accuracy": final["accuracy"],
        "distances": final["distances"],
        "tokens_per_second": meter.tokens_per_second,
        "train_tokens": trainer.state.num_input_tokens_seen,
        "runtime_s": round(runtime, 1),
        "world_size": trainer.args.world_size,
        "bf16": trainer.args.bf16,
        "history": {
            "eval": recorder.history,
            "train": [{"step": e["step"], "loss": e["loss"]} for e in trainer.state.log_history if "loss" in e],
            "signals": callback.history if callback else [],
        },
        "settings": _settings(setup),
    }


def _settings(setup: BookCorpusSetup) -> dict:
    """What a record keeps of the settings: the recipe's (but the arms), the optimiser's, the untie settings."""
    settings = {k: v for k, v in asdict(setup.args).items() if k != "arms"}
    training = setup.training
    settings.update(seed=training.seed, max_steps=training.max_steps, learning_rate=training.learning_rate)
    settings.update(weight_decay=training.weight_decay, eval_steps=training.eval_steps, bf16=training.bf16)
    return {**settings, "untie": setup.untie.to_json_dict()}


def train_arm(
    arm: str, setup: BookCorpusSetup, data: PreparedData, progress: JobProgress | None = None
) -> tuple[dict, tf.Trainer]:
    """Train one arm; return its record (summary + histories) and the trainer. `progress` is the job's progress line
    (None keeps Trainer's own bar, or its log printer with --disable_tqdm)."""
    args, training = setup.args, setup.training
    tied, callbacks = arm_callbacks(arm, setup, data.twins)
    tf.set_seed(training.seed)  # every arm starts from the same input table and sees the same data draws
    model = build_model(args, data.vocab_size, data.tokenizer.pad_token_id, tied)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=training.learning_rate, weight_decay=training.weight_decay, eps=training.adam_epsilon
    )
    scheduler = periodic_cosine(optimizer, training.learning_rate, args.lr_min, args.cosine_steps)
    recorder, meter = TwinDistanceRecorder(data.twins), ThroughputMeter()
    checkpoints, run_name = os.path.join(setup.output_dir, "checkpoints", arm), f"bookcorpus-{args.objective}-{arm}"
    trainer = tf.Trainer(
        model=model,
        args=training_arguments(training, output_dir=checkpoints, run_name=run_name),
        train_dataset=data.train,
        eval_dataset=data.validation,
        processing_class=data.tokenizer,  # pairs="auto" (--auto_pairs tokenizer) reads its vocabulary
        data_collator=lm_collator(
            data.tokenizer, args.objective, data.twins, seed=training.seed + 1000 * launch_rank()
        ),
        optimizers=(optimizer, scheduler),
        compute_metrics=accuracy_metric(args.objective),
        preprocess_logits_for_metrics=lambda logits, labels: logits.argmax(-1),
        callbacks=[*callbacks, recorder, meter],
    )
    if progress is not None:
        quiet_trainer(trainer)
        trainer.add_callback(progress.callback(arm))
    started = time.perf_counter()
    trainer.train()
    if recorder.history[-1]["step"] != trainer.state.global_step:  # the last step was not an eval step
        trainer.evaluate()
    runtime = time.perf_counter() - started
    callback = callbacks[0] if callbacks else None
    record = _arm_record(arm, setup, data, trainer, callback, recorder, meter, runtime)
    if trainer.is_world_process_zero():
        path = Path(setup.output_dir, "arms", f"{arm}.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.with_suffix(".tmp").write_text(json.dumps(record))
        path.with_suffix(".tmp").replace(path)  # a reader never sees half a record
        if args.save_model:
            trainer.save_model(os.path.join(setup.output_dir, "models", arm))
    return record, trainer


def _named_pairs(keys: list[str], tokenizer, twins: TwinTable) -> list[str]:
    """Pair keys ("12-8201") as tokens ("the/the'"), a twin written as its word with a prime."""
    twin_of = {twin: word for word, twin in twins.pairs}

    def token(token_id: int) -> str:
        if token_id in twin_of:
            return tokenizer.convert_ids_to_tokens(twin_of[token_id]) + "'"
        return tokenizer.convert_ids_to_tokens(token_id)

    return [f"{token(int(a))}/{token(int(b))}" for a, b in (key.split("-") for key in keys)]
