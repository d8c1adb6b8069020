"""The tied phase where a live shared parameter cannot be used, one implementation per training engine, behind one
interface (`TiedPhase`), chosen from one table (`TIED_PHASES`, `tied_phase_for`): `emulation.EmulatedTying` (the
head kept equal to the embedding, the tied gradient folded in after backward: FSDP2, and any engine with emulated
tying asked for) and `zero_tying.ZeroTying` (tied in autograd, read at the optimizer step: DeepSpeed ZeRO, which
reduces and partitions gradients inside backward). Which engine trains, and the collectives, are
`untie.distributed`'s."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from torch import nn

from untie.decision.settings import OptimizerStateInit
from untie.engines.emulation import EmulatedTying
from untie.engines.zero_tying import ZeroTying
from untie.registry import Registry

__all__ = ["TIED_PHASES", "TiedPhase", "tied_phase_for"]


class TiedPhase(Protocol):
    """What `untie.core.run.UntieRun` and `untie.signals.probe.RoleGradientProbe` use of an emulated tied phase."""

    embedding: Any
    head: Any
    reads_at_step: bool
    """True: the tied gradient is read at the optimizer step (`listen`, `read_tied_rows`); False: it sits in the
    embedding's `.grad` after the fold, and `after_fold` listeners run then."""
    after_fold: list

    def attach_optimizer(self, optimizer: Any) -> None: ...

    def release(self, optimizer: Any = None, optimizer_state: OptimizerStateInit = "copy") -> None: ...

    def remove(self) -> None: ...


#: The tied phase's implementation for each engine `untie.distributed.training_engine` names (None: one device, DDP).
TIED_PHASES: dict[str | None, Callable[[nn.Module, Registry | None], TiedPhase]] = {
    None: EmulatedTying,
    "FSDP2": EmulatedTying,
    "DEEPSPEED": ZeroTying,
}


def tied_phase_for(engine: str | None, model: nn.Module, registry: Registry | None = None) -> TiedPhase:
    """The emulated tied phase of `model` under `engine` (`TIED_PHASES`; an engine not listed emulates as FSDP2)."""
    return TIED_PHASES.get(engine, EmulatedTying)(model, registry)
