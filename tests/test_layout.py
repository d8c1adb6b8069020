"""The codebase's own rules: private upstream names live in `untie/_compat.py` only, the package is typed, and the
library stands apart from the paper reproductions (`untie_recipes`, mapped from recipes/)."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import untie
import untie_recipes

PACKAGE = Path(untie.__file__).parent
#: Private names of transformers / accelerate / torch that only `untie._compat` may touch, found by text: those the
#: checks below cannot see (frame access, attributes read through a variable), and upstream attributes without an
#: underscore that are not part of any public API (`ds_id`, an embedding's `sparse` flag flipped for one call).
PRIVATE_UPSTREAM = re.compile(
    r"_getframe|_shared_state|_execution_engine|_model_mapping|\b_from_config|\ball_tied_weights|\bds_id\b|"
    r"\.sparse\s*=[^=]"
)
#: Upstream packages whose private names the library must not use outside `_compat.py`.
UPSTREAM = {"transformers", "accelerate", "peft", "torch", "deepspeed", "safetensors", "bitsandbytes"}
#: Names imported from a submodule of transformers / accelerate / peft that their top-level package does not export
#: but their documentation lists as public API (each reviewed; a new one is added here only with its docs page).
DOCUMENTED_SUBMODULE_NAMES = {
    "transformers.trainer_callback.ExportableState",  # docs: main_classes/callback (stateful callbacks)
    "transformers.trainer_utils.get_last_checkpoint",  # docs: internal/trainer_utils, used by the examples
    "accelerate.state.AcceleratorState",  # docs: package_reference/state
    "accelerate.state.GradientState",  # docs: package_reference/state
    "accelerate.state.is_initialized",  # public since accelerate 1.0 (package_reference/state)
    "accelerate.utils.extract_model_from_parallel",  # docs: package_reference/utilities
}
#: Upstream packages whose submodule imports are checked against their top-level exports.
TOP_LEVEL_CHECKED = ("transformers", "accelerate", "peft")


def _private_uses(path: Path) -> list[str]:
    """Private upstream names a module uses, found in its syntax tree: an import of an underscore name or module, an
    import from a submodule of a name the package does not export (and its docs do not list), an underscore
    attribute of anything but `self` / `cls`, and getattr / setattr / hasattr / delattr of an underscore name (the
    library's own markers on upstream objects start with `_untie`)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            root = node.module.split(".")[0]
            if root not in UPSTREAM:
                continue
            if any(part.startswith("_") for part in node.module.split(".")):
                found.append(f"{node.lineno}: from {node.module} import ...")
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                if alias.name.startswith("_"):
                    found.append(f"{node.lineno}: {name}")
                elif root in TOP_LEVEL_CHECKED and node.module != root and name not in DOCUMENTED_SUBMODULE_NAMES:
                    if not hasattr(importlib.import_module(root), alias.name):
                        found.append(f"{node.lineno}: {name} (not exported by {root}, not in its documented API)")
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            ours = node.attr.startswith("_untie") or (
                isinstance(node.value, ast.Name) and node.value.id in {"self", "cls"}
            )
            if not ours:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in {"getattr", "setattr", "hasattr", "delattr"}
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            name = node.args[1].value
            if name.startswith("_") and not name.startswith("__") and not name.startswith("_untie"):
                found.append(f"{node.lineno}: {node.func.id}(..., {name!r})")
    return found


def test_upstream_internals_are_touched_in_the_compat_module_only():
    offenders = [
        f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "_compat.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if PRIVATE_UPSTREAM.search(line)
    ]
    offenders += [
        f"{path.relative_to(PACKAGE)}:{use}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "_compat.py"
        for use in _private_uses(path)
    ]
    assert not offenders, "move these into untie/_compat.py:\n" + "\n".join(offenders)


def test_the_private_name_check_finds_each_kind_of_use(tmp_path):
    module = tmp_path / "module.py"
    module.write_text(
        "from transformers.trainer_callback import CallbackHandler\n"
        "from accelerate.utils._private import thing\n"
        "from torch.nn.modules.module import _global_hooks\n"
        "x = model._tied_weights_keys\n"
        "y = getattr(state, '_shared_state')\n"
        "z = self._fine\n"
        "w = model._untie_owner\n"
    )
    found = _private_uses(module)
    assert sorted({int(use.split(":")[0]) for use in found}) == [1, 2, 3, 4, 5], found


def test_the_package_is_marked_typed():
    assert (PACKAGE / "py.typed").is_file()


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_the_library_never_imports_the_recipes_or_their_plotting():
    offenders = {
        f"{path.relative_to(PACKAGE)}: {name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for name in _imported_modules(path)
        if name.split(".")[0] in {"untie_recipes", "matplotlib"}
    }
    assert not offenders, "the library must not depend on the recipes' side:\n" + "\n".join(sorted(offenders))


def test_importing_the_library_loads_neither_recipes_nor_matplotlib():
    code = (
        "import sys, untie, untie.cli; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in {'untie_recipes', 'matplotlib'}))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "[]", loaded


def test_the_recipes_package_is_the_recipes_folder_and_ships_its_corpus():
    from untie_recipes.tasks.bookcorpus.data import OFFLINE_CORPUS, OFFLINE_VOCAB

    assert Path(untie_recipes.__file__).parent == PACKAGE.parent / "recipes"
    assert not (PACKAGE / "exor").exists() and not (PACKAGE / "bookcorpus").exists()
    assert OFFLINE_CORPUS.is_file() and OFFLINE_VOCAB.is_file()


def test_no_function_of_the_library_or_the_recipes_is_over_80_lines():
    """Long functions are where a maintainer gets lost: split them (the recipes' run setup, record, arguments)."""
    long = []
    for folder in (PACKAGE, Path(untie_recipes.__file__).parent):
        for path in sorted(folder.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    length = node.end_lineno - node.lineno + 1
                    if length > 80:
                        long.append(f"{path.name}:{node.lineno} {node.name} ({length} lines)")
    assert not long, long


def test_the_public_api_is_declared_once_and_its_generated_parts_match():
    """`untie.PUBLIC_API` is the one list: `__all__`, the type-checking imports and docs/api.md are generated from it
    (scripts/public_api.py), every name resolves to its module's object, and the API reference shows exactly these."""
    script = PACKAGE.parent / "scripts" / "public_api.py"
    result = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    declared = [name for _section, _module, names in untie.PUBLIC_API for name in names]
    assert len(declared) == len(set(declared)) and sorted(untie.__all__) == sorted(declared)
    for _section, module, names in untie.PUBLIC_API:
        for name in names:
            assert getattr(untie, name) is getattr(importlib.import_module(module), name), name
    documented = re.findall(r"^::: untie\.[\w.]+\.(\w+)$", (PACKAGE.parent / "docs" / "api.md").read_text(), re.M)
    assert sorted(documented) == sorted(declared)
    assert {"EmbeddingLayout", "was_untied", "RULES", "TokenPair", "PeftUnsupported", "UntieError"} <= set(declared)


def test_every_refusal_of_the_library_is_an_untie_error():
    """One base exception: every exception class the library defines (but the CLI's private usage error) is an
    `untie.UntieError`, and keeps the built-in type it had (ValueError, RuntimeError) for code that caught that."""
    classes = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = "untie." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        module = module.removesuffix(".__init__")
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                value = getattr(importlib.import_module(module), node.name)
                if isinstance(value, type) and issubclass(value, BaseException):
                    classes.append(value)
    assert len(classes) >= 10
    assert all(issubclass(cls, untie.UntieError) for cls in classes), [
        c for c in classes if not issubclass(c, untie.UntieError)
    ]
    assert issubclass(untie.UntieStateError, ValueError) and issubclass(untie.PeftUnsupported, ValueError)


def test_no_refusal_of_the_library_raises_a_bare_built_in():
    """`errors.py` promises that ``except untie.UntieError`` catches every refusal: no ``raise ValueError(...)`` (or
    TypeError, RuntimeError, FileNotFoundError, FileExistsError) is left in the package; each raises the UntieError of
    that built-in type (`untie.errors`)."""
    bare = {"ValueError", "TypeError", "RuntimeError", "FileNotFoundError", "FileExistsError"}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                names = {n.id for n in ast.walk(node.exc.func) if isinstance(n, ast.Name)}
                if names & bare:
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not found, found
    for error in (untie.errors.UntieValueError, untie.errors.UntieRuntimeError, untie.core.run.RunOrderError):
        assert issubclass(error, untie.UntieError)
    with pytest.raises(untie.UntieError):
        untie.UntieConfig(untie_at=-1)
    with pytest.raises(ValueError):
        untie.UntieConfig(untie_at=-1)


def _without_type_only_imports(tree: ast.Module) -> ast.Module:
    """The module without its ``if TYPE_CHECKING:`` blocks (imports for annotations only: no edge at run time)."""
    tree.body = [
        node
        for node in tree.body
        if not (isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
    ]
    return tree


def test_the_library_folders_import_one_another_without_a_loop():
    """The sub-packages form layers (docs/development.md, "Layout"): no folder imports one that imports it back at
    run time, directly or through others (the loops structure <-> engines and checkpoints <-> core are gone)."""
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    edges: dict[str, set[str]] = {folder: set() for folder in folders}
    for folder in folders:
        for path in (PACKAGE / folder).rglob("*.py"):
            for node in ast.walk(_without_type_only_imports(ast.parse(path.read_text()))):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("untie."):
                    target = node.module.split(".")[1]
                    if target in folders and target != folder:
                        edges[folder].add(target)

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(n == goal or (n not in seen and reaches(n, goal, seen | {n})) for n in edges[start])

    loops = sorted(f"{a} -> {b}" for a in folders for b in edges[a] if reaches(b, a, {b}))
    assert not loops, loops
    assert "engines" not in edges["structure"] and "core" not in edges["checkpoints"]


def _module_imports() -> dict[str, set[str]]:
    """Each library module's imports of other library modules: every import statement, at the top, in a function, or
    under ``if TYPE_CHECKING:`` (a type-only arrow is still an arrow a reader follows)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            graph[name] |= {t for t in targets if t in modules and t not in (name, "untie")}
    return graph


def test_no_module_of_the_library_imports_one_that_imports_it_back_at_any_level():
    """Issue 79: no import cycle between modules, counting in-function and type-only imports (the ones that hid
    core/run -> measuring -> messages -> run and structure/surgery <-> peft_support)."""
    graph = _module_imports()

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in graph[start]:
            if nxt == goal:
                return True
            if nxt not in seen:
                seen.add(nxt)
                if reaches(nxt, goal, seen):
                    return True
        return False

    cycles = sorted(f"{a} -> {b}" for a in graph for b in graph[a] if reaches(b, a, {b}))
    assert not cycles, cycles


def test_the_run_holds_state_and_executes_a_decision_it_does_not_make():
    """Issue 67: `UntieRun` stays under 400 lines and decides nothing itself: the policy, the schedule and the
    structure plans are `untie.decision.decide.decide`'s (its only import of them), the phase table is
    `untie.core.phases`', the messages `untie.core.messages`', the measuring `untie.core.measuring`'s."""
    source = (PACKAGE / "core" / "run.py").read_text()
    tree = ast.parse(source)
    run_class = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "UntieRun")
    assert run_class.end_lineno - run_class.lineno + 1 < 400
    assert len(source.splitlines()) < 400
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for alias in node.names}
    assert {"decide", "enter"} <= imported
    assert not imported & {"choose", "choose_plan", "settle", "plan_structure", "default_rule", "built_fresh"}
    assert "_announce_pending" not in source and "_started" not in source  # no phase flags: the table's transitions


def test_the_version_lives_in_a_leaf_module_and_pyproject_says_the_same():
    from untie import _version

    tree = ast.parse(Path(_version.__file__).read_text())
    assert not [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
    pyproject = (Path(untie.__file__).parent.parent / "pyproject.toml").read_text()
    declared = re.search(r'^version = "([^"]+)"', pyproject, flags=re.M)
    assert declared is not None and untie.__version__ == _version.__version__ == declared.group(1)


def test_the_layout_section_lists_the_folders_in_an_order_the_imports_keep():
    """Issue 79, item 6: docs/development.md's "Layout" lists the library's folders so that each imports only from the
    folders above it (any import: top, in-function or type-only); the list is checked against the code."""
    text = (PACKAGE.parent / "docs" / "development.md").read_text()
    block = text[text.index("## Layout") :]
    block = block[block.index("```text") : block.index("```", block.index("```text") + 7)]
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    order: list[str] = []
    for match in re.finditer(r"^  (\w+)/", block, flags=re.M):
        if match.group(1) in folders and match.group(1) not in order:
            order.append(match.group(1))
    assert set(order) == folders, sorted(folders - set(order))
    graph = _module_imports()
    for position, folder in enumerate(order):
        below = set(order[position + 1 :])
        wrong = sorted(
            f"{source} -> {target}"
            for source, targets in graph.items()
            if source.split(".")[1:2] == [folder]
            for target in targets
            if target.split(".")[1:2] and target.split(".")[1] in below
        )
        assert not wrong, (folder, wrong)
