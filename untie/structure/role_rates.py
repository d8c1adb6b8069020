"""A learning rate per role: the input embedding and the LM head each in an optimizer param group of its own, whose
rate follows the group it came from, times a scale (`UntieConfig.embedding_lr_scale`, `UntieConfig.head_lr_scale`).

Why groups that follow. An LR scheduler built on the optimizer (Trainer's, or the user's) sets each group's rate from
its own base rate, and torch >= 2.13 refuses a group it did not see at construction. So the role groups are made when
the optimizer is first handed to the run (before Trainer builds its scheduler; a scheduler built earlier is given the
groups too, `untie._compat.extend_scheduler_groups`), and before every optimizer step a pre-hook sets each role
group's rate to scale x the current rate of its source group, and copies every other hyperparameter of the source
(weight decay, betas, a scheduler's momentum). The role's rate at every step is therefore exactly scale x the
group's rate at that step, whatever the scheduler (warm-up, cosine, plateau), and Trainer's `learning_rate` log (the
first group's) is unchanged.

While the model is tied, the shared matrix is the input embedding's parameter: it trains at the source group's rate
(scales from the untie on, the default), or at the embedding's scale with `lr_scales_while_tied=True`. An emulated
tied phase (FSDP2) holds the head as its own parameter, kept equal to the embedding: it then takes the embedding's
rate too, so that the two stay one matrix.

The layout (which roles have a group) is part of the optimizer's state: a checkpoint records it (`lr_groups` in the
run state), a resume builds the same groups, and a resume that would need a group its checkpoint's optimizer state
lacks is refused with the fix (`groups_for`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from untie import _compat
from untie.errors import UntieValueError
from untie.registry import Registry
from untie.structure.surgery import inner_optimizer, input_weight, is_tied, output_weight, sort_param_groups

#: The roles, in the order their groups are appended to the optimizer.
ROLES = ("input_embedding", "head")
#: The setting that scales each role's rate.
SCALE_SETTINGS = {"input_embedding": "embedding_lr_scale", "head": "head_lr_scale"}
#: The key that marks a role's group in `optimizer.param_groups` (kept in the optimizer's state dict).
ROLE_KEY = "untie_role"
#: The key that records, on a role's group, the index of the group it came from (its rates follow that group's).
SOURCE_KEY = "untie_role_source"
#: What each role is called in messages.
ROLE_NAMES = {"input_embedding": "input embedding", "head": "head"}


def role_groups(optimizer: torch.optim.Optimizer) -> tuple[str, ...]:
    """The roles that have a group of their own in `optimizer` (in `ROLES` order)."""
    marked = {group.get(ROLE_KEY) for group in inner_optimizer(optimizer).param_groups}
    return tuple(role for role in ROLES if role in marked)


def misplaced_roles(optimizer: torch.optim.Optimizer, model: nn.Module) -> tuple[str, ...]:
    """The roles whose group in `optimizer` holds a parameter other than the role's own (an optimizer state loaded by
    position from another layout renames the groups, not their parameters); a head's group may be empty while tied."""
    own = {"input_embedding": input_weight(model), "head": output_weight(model)}
    wrong = []
    for group in inner_optimizer(optimizer).param_groups:
        role = group.get(ROLE_KEY)
        if role in own and any(param is not own[role] for param in group["params"]):
            wrong.append(role)
    return tuple(role for role in ROLES if role in wrong)


def _format_scale(scale: float) -> str:
    return f"{scale:g}x"


class RoleRates:
    """The per-role learning rates of one run (see the module docstring).

    Args:
        scales: each role's scale (`ROLES` -> float), from the settings.
        while_tied: the scales apply during a tied phase too (the shared matrix takes the embedding's).
        owner: the adapter's name, for messages.
    """

    def __init__(
        self, scales: dict[str, float], while_tied: bool, owner: str, emulating: Callable[[], bool] = lambda: False
    ) -> None:
        self.scales, self.while_tied, self.owner, self.emulating = dict(scales), while_tied, owner, emulating
        self.optimizer: torch.optim.Optimizer | None = None
        self.model: nn.Module | None = None
        self.lr_scheduler = None
        """The LR scheduler built before the groups, if one was given (a resume may add the checkpoint's groups)."""
        self.sources: dict[str, int] = {}
        """Each role group's source group (its index in the optimizer's param groups)."""
        self._hooked: tuple[int, int] | None = None  # (optimizer, registry) the follower is installed for
        self.applied: dict[str, float] = {}
        """Each role's rate in the last step (`follow`)."""

    @classmethod
    def from_config(cls, config, owner: str, structure: Callable[[], object] = lambda: None) -> RoleRates:
        """The rates of `config` (`untie.UntieConfig`); `structure` gives the attached model's structure (an
        emulated tied phase, `ModelStructure.emulation`, trains the head at the embedding's rate)."""
        scales = {role: float(getattr(config, SCALE_SETTINGS[role])) for role in ROLES}

        def emulating() -> bool:
            return getattr(structure(), "emulation", None) is not None

        return cls(scales, bool(config.lr_scales_while_tied), owner, emulating)

    @property
    def wanted(self) -> tuple[str, ...]:
        """The roles whose scale asks for a group of their own (a scale other than 1)."""
        return tuple(role for role in ROLES if self.scales[role] != 1.0)

    @property
    def groups(self) -> tuple[str, ...]:
        """The roles that have a group in the run's optimizer (what a checkpoint records as `lr_groups`)."""
        return role_groups(self.optimizer) if self.optimizer is not None else ()

    # -- the layout ----------------------------------------------------------------------------------------------------
    def groups_for(self, saved: tuple[str, ...] | None, where: str | None) -> tuple[str, ...]:
        """The groups a run resuming a checkpoint whose optimizer state has the groups `saved` builds: the saved ones
        (a role whose scale is back to 1 keeps its group, at 1x), refused where a scale needs a group the saved
        optimizer state lacks (it could not load into it). `where` None: a fresh start (the wanted groups)."""
        if where is None:
            return self.wanted
        saved = tuple(saved or ())
        missing = [role for role in self.wanted if role not in saved]
        if missing:
            settings = ", ".join(f"{SCALE_SETTINGS[role]}={self.scales[role]!r}" for role in missing)
            had = ", ".join(SCALE_SETTINGS[role] for role in missing)
            raise UntieValueError(
                f"{self.owner}: {where} was saved with {had} at 1 (no param group of its own), so its optimizer state "
                f"cannot load into an optimizer that gives {settings} a group: resume with {had}=1.0 (the scales "
                "can change at a resume that has the groups), or start a new run from its weights (load the model "
                "from the folder and train without resuming: its optimizer state is not loaded)."
            )
        return tuple(role for role in ROLES if role in saved)

    def split(
        self,
        optimizer: torch.optim.Optimizer,
        model: nn.Module,
        registry: Registry,
        lr_scheduler=None,
        saved=None,
        provisional: tuple[str, ...] = (),
    ) -> str | None:
        """Give each role the run needs a group for (`groups_for` the checkpoint `saved`, a `SavedFacts`, or a fresh
        start) a group of its own in `optimizer` (a copy of its source group's hyperparameters), extend
        `lr_scheduler` (built before: its per-group lists) to them, and install the follower. Idempotent: an
        optimizer that has the groups already (a second `train()` call) keeps them; one with other role groups than
        the checkpoint's is refused (its state would load crosswise).

        `provisional`: roles whose scale the run's policy chose for a fresh start (not the user): where the
        checkpoint `saved` has no group for one, its scale falls back to 1 and a group made for it at a fresh start
        is withdrawn, so that the checkpoint's optimizer state loads (a resume continues the checkpoint's run). An
        optimizer that computes its own step size cannot take one (`lr=None`, or Adafactor's `relative_step=True`,
        whose rate no group's `lr` sets): a user's scale is refused, the policy's falls back to 1. Returns why it
        fell back (None where nothing did)."""
        where = getattr(saved, "where", None)
        inner = inner_optimizer(optimizer)
        self.optimizer, self.model = optimizer, model
        self.lr_scheduler = lr_scheduler if lr_scheduler is not None else self.lr_scheduler
        lr_scheduler = self.lr_scheduler
        saved_groups = getattr(saved, "lr_groups", None)
        if where is not None:
            lacking = tuple(role for role in provisional if role not in (saved_groups or ()))
            self.scales.update(dict.fromkeys(lacking, 1.0))
            self._withdraw(inner, model, lacking)
        own_step = any(group.get("lr") is None or group.get("relative_step") for group in inner.param_groups)
        yielded = None
        if own_step and any(role in provisional and self.scales[role] != 1.0 for role in ROLES):
            self.scales.update(dict.fromkeys(provisional, 1.0))
            yielded = "the optimizer computes its own step size (Adafactor's relative_step=True), which no scale sets"
        roles = self.groups_for(saved_groups, where)
        existing = role_groups(inner)
        if existing and roles != existing:
            raise UntieValueError(
                f"{self.owner}: the optimizer has learning-rate groups for {list(existing)}, and {where} was saved "
                f"with groups for {list(roles)}: resume with the scales it was saved with (a scale other than 1 for "
                "each role it has a group for)."
            )
        if roles and not existing:
            if own_step:
                raise UntieValueError(
                    f"{self.owner}: the optimizer computes its own step size (Adafactor with relative_step=True: no "
                    "group's lr sets it), so embedding_lr_scale / head_lr_scale cannot apply: pass Adafactor(..., "
                    "relative_step=False, lr=<a rate>), or set embedding_lr_scale=1.0 and head_lr_scale=1.0."
                )
            if lr_scheduler is None and _compat.has_lr_scheduler(inner):
                raise UntieValueError(
                    f"{self.owner}: an LR scheduler was built on this optimizer, and the per-role learning rates add "
                    "param groups it must know: pass it (Untier(..., lr_scheduler=scheduler) or "
                    "untier.start(optimizer, lr_scheduler=scheduler)), or build the scheduler after untier.start()."
                )
            sources = self._add_groups(inner, model, roles)
            if lr_scheduler is not None:
                _compat.extend_scheduler_groups(lr_scheduler, [sources[role] for role in roles])
        self._find_sources(inner)
        if self.sources and self._hooked != (id(inner), id(registry)):
            handle = inner.register_step_pre_hook(lambda *_: self.follow())
            registry.hook("per-role learning rates (optimizer step pre-hook)", handle)
            registry.add("per-role learning rates: the hook's record", self._unhook)
            self._hooked = (id(inner), id(registry))
        self.follow()
        return yielded

    def _add_groups(self, inner: torch.optim.Optimizer, model: nn.Module, roles: tuple[str, ...]) -> dict[str, int]:
        embedding = input_weight(model)
        head = output_weight(model)
        params = {"input_embedding": embedding, "head": None if head is embedding else head}
        embedding_source = _group_index(inner, embedding)
        if embedding_source is None:
            raise UntieValueError(
                f"{self.owner}: the input embedding is not in the optimizer (frozen, or built without it), so "
                f"{', '.join(SCALE_SETTINGS[role] for role in roles)} would scale nothing: train the embedding, or "
                "leave the scales at 1."
            )
        sources = {}
        for role in roles:
            param = params[role]
            index = _group_index(inner, param) if param is not None else None
            sources[role] = embedding_source if index is None else index
        for role in roles:
            param = params[role]
            if param is not None:
                for group in inner.param_groups:
                    group["params"] = [p for p in group["params"] if p is not param]
            source = inner.param_groups[sources[role]]
            # A tensor hyperparameter (a capturable or fused optimizer's `lr`) is cloned: the follower writes the
            # role's rate into its own group's tensor, never into the one its source shares.
            group = {key: _own(value) for key, value in source.items() if key != "params"}
            group.update(params=[] if param is None else [param], **{ROLE_KEY: role, SOURCE_KEY: sources[role]})
            inner.param_groups.append(group)  # as add_param_group does, keeping the source's every hyperparameter
        _compat.reindex_bitsandbytes_overrides(inner)
        return sources

    def _withdraw(self, inner: torch.optim.Optimizer, model: nn.Module, roles: tuple[str, ...]) -> None:
        """Take the groups of `roles` out of `inner` again (made at a fresh start, before any step: they hold no
        state), their parameters back in their source groups in a fresh optimizer's order, and their entries out of
        the LR scheduler given the groups."""
        dropped = [i for i, group in enumerate(inner.param_groups) if group.get(ROLE_KEY) in roles]
        if not dropped:
            return
        for index in dropped:
            group = inner.param_groups[index]
            inner.param_groups[int(group[SOURCE_KEY])]["params"].extend(group["params"])
        inner.param_groups[:] = [group for i, group in enumerate(inner.param_groups) if i not in dropped]
        if self.lr_scheduler is not None:
            _compat.drop_scheduler_groups(self.lr_scheduler, dropped)
        sort_param_groups(inner, model)
        self._find_sources(inner)

    def _unhook(self) -> None:
        self._hooked = None

    def _find_sources(self, inner: torch.optim.Optimizer) -> None:
        """Each role group's source: the group the role's parameter came from, recorded on the group itself."""
        self.sources = {}
        for group in inner.param_groups:
            if group.get(ROLE_KEY) in ROLES:
                self.sources[group[ROLE_KEY]] = int(group[SOURCE_KEY])

    def place_head(self) -> None:
        """Put the head in its role's group, or, without one, in its source's (after an untie or a plan added it to
        the group of the matrix it was copied from)."""
        if self.optimizer is None or self.model is None or not self.sources and not self.groups:
            return
        inner = inner_optimizer(self.optimizer)
        head = output_weight(self.model)
        if head is input_weight(self.model) or _group_index(inner, head) is None:
            return
        target = next((i for i, g in enumerate(inner.param_groups) if g.get(ROLE_KEY) == "head"), None)
        if target is None:
            target = self.sources.get("input_embedding", 0)
        current = _group_index(inner, head)
        if current == target:
            return
        for group in inner.param_groups:
            group["params"] = [p for p in group["params"] if p is not head]
        inner.param_groups[target]["params"].append(head)
        sort_param_groups(inner, self.model)  # a fresh optimizer's order (a resume loads by position)

    # -- the rates -----------------------------------------------------------------------------------------------------
    def factor(self, role: str) -> float:
        """The scale role `role` trains at now: 1 while tied unless `while_tied` (then the embedding's)."""
        tied = self.model is not None and (is_tied(self.model) or self.emulating())
        if tied:
            return self.scales["input_embedding"] if self.while_tied else 1.0
        return self.scales[role]

    def follow(self) -> None:
        """Set each role group's hyperparameters to its source group's, its rate to factor x the source's rate (the
        optimizer step pre-hook), and record the rate each role trains at in this step (`current`)."""
        if self.optimizer is None:
            return
        groups = inner_optimizer(self.optimizer).param_groups
        for role, source_index in self.sources.items():
            group = next(g for g in groups if g.get(ROLE_KEY) == role)
            source = groups[source_index]
            for key, value in source.items():
                if key not in ("params", "lr", ROLE_KEY, SOURCE_KEY):
                    _follow_value(group, key, value)
            rate = self.factor(role) * source["lr"]
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(float(rate))
            else:
                group["lr"] = rate
        self.applied = self._rates(groups)

    def current(self) -> dict[str, float]:
        """Each role's rate in the last optimizer step (`untie/lr_input_embedding`, `untie/lr_head`; before the first
        step, the first step's), where the run has role groups: the rates Trainer's `learning_rate` log sits beside."""
        if self.optimizer is None or not self.sources:
            return {}
        return dict(self.applied)

    def _rates(self, groups: list[dict]) -> dict[str, float]:
        """Each role's rate as the groups stand: its group's, or, for a role without one, the rate of the group that
        holds it (the shared matrix's, while tied)."""
        assert self.model is not None
        values = {}
        for role in ROLES:
            param = input_weight(self.model) if role == "input_embedding" else output_weight(self.model)
            index: int | None
            if role in self.sources:
                index = next(i for i, g in enumerate(groups) if g.get(ROLE_KEY) == role)
            else:
                index = _group_index(groups, param)
                index = _group_index(groups, input_weight(self.model)) if index is None else index
            rate = groups[index]["lr"] if index is not None else None
            values[f"untie/lr_{role}"] = float(rate) if rate is not None else float("nan")  # None: its own step size
        return values

    def line(self) -> str | None:
        """What the run says about the rates ('input embedding at 0.1x, head at 1x the group's rate, from the
        untie on'); None at the scales' defaults."""
        if not self.wanted and not self.groups:
            return None
        rates = ", ".join(f"{ROLE_NAMES[role]} at {_format_scale(self.scales[role])}" for role in ROLES)
        when = "also while tied (the shared matrix at the embedding's)" if self.while_tied else "from the untie on"
        return f"untie: learning rates: {rates} the rate of the optimizer group each came from, {when}"


def _follow_value(group: dict, key: str, value) -> None:
    """Set `group[key]` to the source's `value`: a tensor is copied into the group's own tensor (never shared)."""
    mine = group.get(key)
    if not isinstance(value, torch.Tensor):
        group[key] = value
    elif isinstance(mine, torch.Tensor) and mine is not value and mine.shape == value.shape:
        mine.copy_(value)
    else:
        group[key] = value.clone()


def _own(value):
    """`value`, or a copy of it where it is a tensor (a group's hyperparameter the role's group must not share)."""
    return value.clone() if isinstance(value, torch.Tensor) else value


def _group_index(optimizer_or_groups, param: nn.Parameter) -> int | None:
    """The index of the param group holding `param` (of an optimizer, or of its list of groups), or None."""
    groups = getattr(optimizer_or_groups, "param_groups", optimizer_or_groups)
    return next((i for i, g in enumerate(groups) if any(p is param for p in g["params"])), None)
