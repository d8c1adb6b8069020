"""One progress line for a whole job of several Trainer runs, with an ETA for all of them.

A recipe trains many runs (arms x seeds x variants), one after another or in parallel worker processes. Trainer's own
bar covers one run and restarts for the next; parallel workers interleave their bars. Here each run's Trainer drops
its bar and console printer and reports finished steps instead, and the launching process shows one `tqdm` line whose
total is the job's steps:
`EXor 7/15 runs: 43%|####      | 5200/12000 [01:10<01:31, 74.3step/s, main-auto-42 loss 0.61]`.
Logs still reach `report_to` (TensorBoard, W&B) and each run's `log_history`.

- In one process (`workers == 1`, or under `torchrun` / `accelerate launch`): `JobProgress.callback()` updates the
  line directly; only the main process draws it.
- With worker processes: `JobProgress.queue()` is passed to each worker, whose `StepReporter(queue)` callback sends
  its steps (batched to a few messages a second), and the launcher calls `JobProgress.follow(futures)`.
"""

from __future__ import annotations

import queue as queue_module
import time
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from multiprocessing.context import BaseContext

import transformers as tf
from tqdm.auto import tqdm

#: A worker sends its steps at most this often (seconds): a queue message costs an IPC round trip.
REPORT_EVERY_S = 0.5


def quiet_trainer(trainer: tf.Trainer) -> None:
    """Remove Trainer's per-run progress bar and console log printer (the job's line replaces them)."""
    trainer.remove_callback(tf.trainer_callback.ProgressCallback)
    trainer.remove_callback(tf.trainer_callback.PrinterCallback)


class JobProgress:
    """The job's progress line. `runs` runs of `steps_per_run` steps each; `steps_per_run=None` takes the first run's
    `max_steps` at its start (every run of a recipe job has the same length). `disable` hides it (`--disable_tqdm`,
    or a process other than the main one)."""

    def __init__(self, runs: int, steps_per_run: int | None, *, description: str, disable: bool = False) -> None:
        self.runs = runs
        self.finished_runs = 0
        self.description = description
        total = runs * steps_per_run if steps_per_run else None
        self.bar = tqdm(total=total, desc=self._desc(), unit="step", disable=disable, dynamic_ncols=True)
        self._queue = None

    def _desc(self) -> str:
        return f"{self.description} {self.finished_runs}/{self.runs} runs"

    def advance(self, steps: int, run: str | None = None, loss: float | None = None, finished: bool = False) -> None:
        """Count `steps` more finished steps (of `run`, whose latest training loss is `loss`)."""
        if finished:
            self.finished_runs += 1
            self.bar.set_description(self._desc(), refresh=False)
        if run is not None and loss is not None:
            self.bar.set_postfix_str(f"{run} loss {loss:.4g}", refresh=False)
        self.bar.update(steps)

    def set_steps_per_run(self, steps: int) -> None:
        if self.bar.total is None:
            self.bar.total = self.runs * steps
            self.bar.refresh()

    def callback(self, run: str) -> tf.TrainerCallback:
        """A callback that advances this line from the same process (sequential runs)."""
        return _DirectProgress(self, run)

    def queue(self, context: BaseContext):
        """A queue that worker processes' `StepReporter` callbacks send to (a Manager queue: it pickles)."""
        self._manager = context.Manager()
        self._queue = self._manager.Queue()
        return self._queue

    def follow(self, futures: Iterable[Future]) -> None:
        """Draw the line from the workers' messages until every future is done; re-raise a worker's error."""
        pending = set(futures)
        while pending:
            done, pending = wait(pending, timeout=REPORT_EVERY_S, return_when=FIRST_COMPLETED)
            self._drain()
            for future in done:
                future.result()
        self._drain()

    def _drain(self) -> None:
        while True:
            try:
                steps, run, loss, finished = self._queue.get_nowait()
            except queue_module.Empty:
                return
            if steps is None:  # a run's first message: its length
                self.set_steps_per_run(run)
                continue
            self.advance(steps, run, loss, finished)

    def close(self) -> None:
        self.bar.close()
        if self._queue is not None:
            self._manager.shutdown()
            self._queue = None


class _DirectProgress(tf.TrainerCallback):
    def __init__(self, progress: JobProgress, run: str) -> None:
        self.progress, self.run, self.loss, self.reported = progress, run, None, 0

    def on_train_begin(self, args, state, control, **kwargs):
        self.progress.set_steps_per_run(state.max_steps)
        self.reported = state.global_step  # a resumed run counts from where it resumed

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.loss = logs["loss"]

    def on_step_end(self, args, state, control, **kwargs):
        self.progress.advance(state.global_step - self.reported, self.run, self.loss)
        self.reported = state.global_step

    def on_train_end(self, args, state, control, **kwargs):
        self.progress.advance(max(state.max_steps - self.reported, 0), self.run, self.loss, finished=True)


class StepReporter(tf.TrainerCallback):
    """A worker process's side of `JobProgress`: sends (steps, run, loss, finished) a few times a second."""

    def __init__(self, queue, run: str) -> None:
        self.queue, self.run, self.loss, self.reported, self.sent_at = queue, run, None, 0, 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        self.queue.put((None, state.max_steps, None, False))
        self.reported = state.global_step

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.loss = logs["loss"]

    def on_step_end(self, args, state, control, **kwargs):
        now = time.monotonic()
        if now - self.sent_at >= REPORT_EVERY_S:
            self._send(state.global_step)
            self.sent_at = now

    def on_train_end(self, args, state, control, **kwargs):
        # A run that stops early (or resumed) still counts as its full length: the line's total assumed it.
        self._send(max(state.max_steps, state.global_step), finished=True)

    def _send(self, step: int, finished: bool = False) -> None:
        self.queue.put((step - self.reported, self.run, self.loss, finished))
        self.reported = step
