"""`scripts/kernel_paths.py`: a table's command under the kernel paths of other CPU kinds, and the record CI trusts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from script_modules import load_script

pytestmark = pytest.mark.recipes  # a test of recipes/, scripts/ or the docs' tables (pytest -m 'not recipes')

ROOT = Path(__file__).resolve().parent.parent


def _load(name: str):
    return load_script("scripts", name)


@pytest.fixture
def kernel_paths(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    docs_tables = _load("docs_tables")
    module = _load("kernel_paths")
    short = "--models mixer --arms untied tied --max_steps 60 --record_every 20 --eval_every 20 --metrics_every 20"
    command = ("python", "recipes/exor.py", *short.split(), "--disable_tqdm", "--output_dir", "{out}")
    toy = docs_tables.Table(page="unused.md", commands=(command,), output="results.md", cost="cheap")
    monkeypatch.setattr(module.docs_tables, "TABLES", {"toy": toy})
    monkeypatch.setattr(module, "RECORD", tmp_path / "kernel-paths.json")
    return module


def test_a_portable_run_gives_the_same_table_when_the_cpu_offers_fewer_instructions(kernel_paths):
    """What an older CPU's MKL and libm would pick changes nothing in a portable run (untie_recipes.kernels)."""
    record = kernel_paths.main(["toy", "--paths", "portable", "portable-as-older-cpu", "--write"])["toy"]
    tables = {path: entry["table"] for path, entry in record["paths"].items()}
    assert tables["portable"] == tables["portable-as-older-cpu"] and "| main | mixer | untied |" in tables["portable"]
    assert record["stable"] is True  # every portable path was tried and agreed
    assert json.loads(kernel_paths.RECORD.read_text())["toy"]["commands"] == [list(c) for c in record_commands()]


def record_commands():
    return sys.modules["kernel_paths"].docs_tables.TABLES["toy"].commands


def test_native_paths_run_the_recipe_with_the_cpus_own_kernels():
    module = _load("kernel_paths")
    command = ("python", "recipes/exor.py", "--output_dir", "{out}")
    assert module.with_native(command, "native-avx2")[-2:] == ["--kernels", "native"]
    assert module.with_native(command, "portable") == list(command)


def test_every_table_ci_compares_was_shown_stable_on_every_kernel_path():
    """`.ci/run` compares the cheap tables on whatever CPU kind it runs on: each must be one that the kernel-path
    check ran under every path with its current commands and found the same, and the page must hold that text."""
    docs_tables = _load("docs_tables")
    record = json.loads((ROOT / "docs" / "data" / "kernel-paths.json").read_text())
    kernel_paths = _load("kernel_paths")
    cheap = [name for name, table in docs_tables.TABLES.items() if table.cost == "cheap"]
    assert cheap
    for name in cheap:
        entry = record.get(name)
        assert entry, f"{name}: CI compares it, but scripts/kernel_paths.py {name} --write never recorded it"
        assert entry["commands"] == [list(c) for c in docs_tables.TABLES[name].commands], f"{name}: stale record"
        assert set(entry["paths"]) == set(kernel_paths.PATHS) and entry["stable"], f"{name}: not stable"
        portable = [entry["paths"][path]["table"] for path in kernel_paths.PORTABLE_PATHS]
        assert all(table == docs_tables.committed(name) for table in portable), f"{name}: the page is not the record"


def test_which_claims_the_quick_start_checks_is_the_same_on_both_cpu_kinds_recorded():
    """The quick start's numbers and verdicts differ between CPU kinds (an AMD EPYC and an Intel Xeon, both AVX-512,
    portable kernels: one seed's chaotic trajectory); which claims it checks does not. The record holds the claims
    table from the EPYC and the checked table from the Xeon: the first, read as checked, must be the second."""
    docs_tables = _load("docs_tables")
    record = json.loads((ROOT / "docs" / "data" / "kernel-paths.json").read_text())
    claims, checked = record["exor-quick-claims"], record["exor-quick-checked"]
    assert claims["machine"] != checked["machine"], "both recorded on one machine: nothing compared across kinds"
    for path, entry in claims["paths"].items():
        as_results = "| x |\n|---|\n\n" + entry["table"] + "\n"
        assert docs_tables.claims_checked(as_results) == checked["paths"][path]["table"], path
