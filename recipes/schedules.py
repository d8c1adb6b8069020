"""Learning-rate schedules the paper's experiments use, written so that they survive an untie."""

from __future__ import annotations

import math

import torch


def periodic_cosine(
    optimizer: torch.optim.Optimizer, lr: float, lr_min: float, half_period: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """torch's CosineAnnealingLR(T_max=half_period, eta_min=lr_min) stepped past T_max, as the paper's code does:
    lr goes lr -> lr_min over half_period steps, then back up. Closed form (a LambdaLR), so a parameter group added
    by the untie follows the same curve instead of CosineAnnealingLR's recursion from its own starting lr."""
    if half_period <= 0 or not 0 <= lr_min <= lr:
        raise ValueError(f"periodic_cosine needs half_period > 0, 0 <= lr_min <= lr: {half_period}, {lr_min}, {lr}")
    floor = lr_min / lr
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: floor + (1 - floor) * (1 + math.cos(math.pi * step / half_period)) / 2
    )
