"""Trigger policies: decide at which optimizer step the embeddings are untied."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ScheduledTrigger:
    """Fires once the global step reaches `untie_at` (an int step, or a fraction of the run's `max_steps`)."""

    untie_at: int | float | None
    step: int | None = None
    """The resolved step; set by `resolve` when the run length is known."""

    def resolve(self, max_steps: int) -> int | None:
        """Turn `untie_at` into a global step for a run of `max_steps` optimizer steps; raise if it lies beyond."""
        at = self.untie_at
        if at is None:
            self.step = None
        elif isinstance(at, float):
            self.step = max(1, round(at * max_steps))
        else:
            if max_steps > 0 and at > max_steps:
                raise ValueError(
                    f"untie_at={at} is beyond the end of the run (max_steps={max_steps}), so the model would never be "
                    "untied. Pass a step <= max_steps, a fraction in (0, 1) such as untie_at=0.3, or None to stay tied."
                )
            self.step = at
        return self.step

    def fires(self, global_step: int) -> bool:
        return self.step is not None and global_step >= self.step
