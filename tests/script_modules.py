"""Load a repository script (scripts/, benchmarks/) as a module, registered under its name, for the tests of it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def load_script(folder: str, name: str, *, register_as: str | None = None) -> ModuleType:
    """`ROOT/folder/name.py` as a fresh module, put in sys.modules under `register_as` (default: `name`), so that
    the scripts that import each other (kernel_paths imports docs_tables) and pickling find it."""
    spec = importlib.util.spec_from_file_location(register_as or name, ROOT / folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[register_as or name] = module
    spec.loader.exec_module(module)
    return module
