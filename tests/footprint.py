"""What of the untie library is installed on a model, an optimizer, a Trainer or an Accelerator: for the teardown
tests (tests/test_teardown.py and the multi-process workers), which check that a closed run leaves nothing behind.

"Of the library" is read off the objects themselves, never off the library's own bookkeeping: every hook table torch
keeps (modules, parameters, optimizers: any instance attribute whose name ends in ``hooks`` holding a dict), every
instance attribute that shadows a class attribute (a replaced ``forward`` or ``step``, a wrapped ``train``), and every
attribute whose name starts with ``_untie``; a callable counts as the library's when it, the function it binds or
wraps with functools.partial, or the object it is bound to, comes from a module under ``untie``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch


def is_library_object(value: Any, depth: int = 0) -> bool:
    """Whether `value` is a function, method, partial or object of the untie library."""
    if depth > 4 or value is None:
        return False
    if isinstance(value, functools.partial):
        return is_library_object(value.func, depth + 1)
    bound = getattr(value, "__func__", None)
    if bound is not None:
        return is_library_object(bound, depth + 1) or is_library_object(getattr(value, "__self__", None), depth + 1)
    module = getattr(value, "__module__", None) if callable(value) and not isinstance(value, type) else None
    if isinstance(module, str) and module.split(".")[0] == "untie":
        return True
    return type(value).__module__.split(".")[0] == "untie"


def _leftovers_of(obj: Any, name: str) -> list[str]:
    found = []
    attributes = vars(obj) if hasattr(obj, "__dict__") else {}
    for key, value in attributes.items():
        if key.startswith("_untie"):
            found.append(f"{name}.{key}")
        elif key.endswith("hooks") and isinstance(value, dict):
            found += [f"{name}.{key}[{k}]" for k, hook in value.items() if is_library_object(hook)]
        elif hasattr(type(obj), key) and is_library_object(value):
            found.append(f"{name}.{key} (replaced)")
    return found


def library_leftovers(*, model: Any = None, optimizer: Any = None, trainer: Any = None, accelerator: Any = None):
    """Every install of the library still on these objects, named (empty: nothing left behind)."""
    found: list[str] = []
    if model is not None:
        for module_name, module in model.named_modules():
            found += _leftovers_of(module, module_name or "model")
        for param_name, param in model.named_parameters(remove_duplicate=False):
            found += _leftovers_of(param, param_name)
    inner = optimizer
    for _ in range(4):  # accelerate's / DeepSpeed's wrappers and the optimizers they wrap
        if inner is None:
            break
        found += _leftovers_of(inner, type(inner).__name__)
        nested = getattr(inner, "optimizer", None)
        inner = nested if nested is not inner else None
    if trainer is not None:
        found += _leftovers_of(trainer, "trainer")
    if accelerator is not None:
        found += _leftovers_of(accelerator, "accelerator")
    return found


def foreign_installs(model: torch.nn.Module) -> dict[str, Any]:
    """Install what someone else might have before the run, on the input embedding and the head: a forward hook and
    an instance ``forward`` wrapping the class's (as accelerate's `add_hook_to_module` does). Returns them, for
    `foreign_installs_kept`."""
    installed: dict[str, Any] = {}
    for role, module in (("embedding", model.get_input_embeddings()), ("head", model.get_output_embeddings())):
        calls = []
        handle = module.register_forward_hook(lambda *_args, calls=calls: calls.append(1))
        original = type(module).forward.__get__(module)

        def wrapped_forward(*args, original=original, **kwargs):
            return original(*args, **kwargs)

        module.forward = wrapped_forward
        installed[role] = (module, handle, wrapped_forward, calls)
    return installed


def foreign_installs_kept(installed: dict[str, Any]) -> dict[str, bool]:
    """Whether each foreign install is still in place (its hook registered, its forward the instance's)."""
    kept = {}
    for role, (module, handle, forward, _calls) in installed.items():
        kept[f"{role} forward hook"] = handle.id in module._forward_hooks
        kept[f"{role} forward"] = vars(module).get("forward") is forward
    return kept
