"""Run `recipes/decision_map.py` on another device (a GPU), changing placement only.

The map's code runs on the CPU; this wrapper moves each model to ``MAP_DEVICE`` right after its seeded construction
(on the CPU, so the initial weights are the CPU run's) and the corpus's blocks there once. Everything else is the
map's own code: data order, schedule, arms, records. ``MAP_CODE`` names the checkout whose code runs (default: this
one), so a pre-registered map can run on its frozen commit (`git worktree add /tmp/frozen 1296c8f`).

    MAP_DEVICE=cuda CUBLAS_WORKSPACE_CONFIG=:4096:8 python scripts/map_on_device.py <decision_map.py's flags>
    MAP_CODE=/tmp/frozen MAP_DEVICE=cuda CUBLAS_WORKSPACE_CONFIG=:4096:8 python scripts/map_on_device.py ...

On CUDA it asks for deterministic kernels (warning where one has none) and full float32 matmuls (no TF32), so a
rerun on the same GPU repeats the numbers. A device's numbers differ from a CPU's by more than rounding: at the map's
budgets the runs' trajectories move apart (docs/recipes/decision-map.md, "Across devices"), so the arms of one
(width, seed) must all run on one device; the map pairs arms by seed, never across seeds. ``MAP_DEVICE=cpu`` runs
the map unchanged (the check that the wrapper changes nothing but placement).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import torch

REPO = Path(__file__).resolve().parents[1]


def load_recipe(code: Path) -> ModuleType:
    """The map's recipe module from checkout `code`, with that checkout's library and recipes first on the path."""
    if not (code / "recipes" / "decision_map.py").exists():
        raise SystemExit(f"{code}/recipes/decision_map.py: not found; MAP_CODE names a checkout of this repository.")
    sys.path.insert(0, str(code))  # its untie
    package = importlib.util.spec_from_file_location(  # its recipes, as the installed package name
        "untie_recipes", code / "recipes" / "__init__.py", submodule_search_locations=[str(code / "recipes")]
    )
    sys.modules["untie_recipes"] = importlib.util.module_from_spec(package)
    package.loader.exec_module(sys.modules["untie_recipes"])
    spec = importlib.util.spec_from_file_location("decision_map_recipe", code / "recipes" / "decision_map.py")
    recipe = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = recipe  # its dataclasses look their module up
    spec.loader.exec_module(recipe)
    return recipe


def place_on(recipe: ModuleType, device: torch.device) -> None:
    """Patch the recipe's model construction and corpus loading so that both land on `device`."""
    from untie_recipes.tasks.decision_map import runs, training

    built_on_cpu = training.build_model
    loaded_on_cpu = recipe.load_corpus

    def build_model(*args, **kwargs):
        return built_on_cpu(*args, **kwargs).to(device)

    def load_corpus(*args, **kwargs):
        corpus = loaded_on_cpu(*args, **kwargs)
        return dataclasses.replace(corpus, train=corpus.train.to(device), validation=corpus.validation.to(device))

    runs.build_model = training.build_model = build_model
    recipe.load_corpus = load_corpus


def main(argv: list[str] | None = None) -> None:
    device = torch.device(os.environ.get("MAP_DEVICE", "cuda"))
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("MAP_DEVICE=cuda: no CUDA device here; MAP_DEVICE=cpu runs the map unchanged.")
        torch.use_deterministic_algorithms(True, warn_only=True)  # needs CUBLAS_WORKSPACE_CONFIG=:4096:8
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    recipe = load_recipe(Path(os.environ.get("MAP_CODE", REPO)).resolve())
    place_on(recipe, device)
    recipe.main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
