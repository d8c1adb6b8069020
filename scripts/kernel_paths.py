"""Run a docs table's command under the float-kernel paths other x86 CPUs take, on this machine, and say whether the
table comes out the same on every path: what `.ci/run` may compare on a machine of any CPU kind.

    python scripts/kernel_paths.py exor-quick exor-quick-claims --write   # run, print, and record the verdict
    python scripts/kernel_paths.py exor-quick --paths portable native      # some paths only; print, record nothing
    python scripts/kernel_paths.py --summary          # the record as a table (docs/recipes/exor.md)

A CPU kind shows in a run's numbers through the kernels torch, MKL, oneDNN and glibc's libm pick from its vector
instructions. One machine can take the paths a CPU with fewer instructions takes by capping them
(`ATEN_CPU_CAPABILITY`, `MKL_CBWR` / `MKL_ENABLE_INSTRUCTIONS`, `ONEDNN_MAX_CPU_ISA`, `GLIBC_TUNABLES`): `PATHS`
lists those tried. The tables run their command once per path (the tables of one command share its runs), then each
table is compared across paths: the same text on every portable path (`PORTABLE_PATHS`: what the recipes' default
`--kernels portable` runs on other CPUs) is "stable"; the native paths show what the command gives without the pin.
`--write` records every table's commands, its text per path and its verdict in `docs/data/kernel-paths.json`;
`tests/test_docs_tables.py` fails on a table CI compares (cost "cheap") that this record does not show stable under
its current commands."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import docs_tables  # noqa: E402  (a sibling script)

RECORD = ROOT / "docs" / "data" / "kernel-paths.json"
#: The kernel paths tried, by name: the environment each adds. "native" and "native-avx2" are what this CPU and an
#: AVX2-only CPU run with `--kernels native`; the portable ones run the recipes' default (`untie_recipes.kernels`),
#: with the paths a portable run must not depend on capped as an older CPU would have them.
PATHS: dict[str, dict[str, str]] = {
    "portable": {},
    "portable-as-older-cpu": {
        "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
        "GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX512F,-AVX2,-FMA,-AVX",
    },
    "native": {},
    "native-avx2": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "MKL_CBWR": "AVX2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
    },
}


#: The paths that run the recipes with `--kernels native`, for contrast: what the same command gives without the pin.
NATIVE_PATHS = ("native", "native-avx2")
#: The paths a default (portable) run takes on other CPUs: a table CI compares must be the same on all of them.
PORTABLE_PATHS = tuple(path for path in PATHS if path not in NATIVE_PATHS)


def with_native(command: tuple[str, ...], path: str) -> list[str]:
    """The command, with `--kernels native` on a native path where it runs a recipe."""
    native = path in NATIVE_PATHS and "recipes/" in " ".join(command)
    return [*command, "--kernels", "native"] if native else list(command)


def run_path(table: docs_tables.Table, path: str, workdir: Path) -> str:
    """Run the table's commands with the path's environment; the text of the file (or output) the table is read
    from."""
    environment = {**os.environ, **PATHS[path]}
    out = workdir / path
    out.mkdir(parents=True, exist_ok=True)
    stdout = ""
    for command in table.commands:
        argv = [part.replace("{out}", str(out)) for part in with_native(command, path)]
        argv[0] = sys.executable if argv[0] == "python" else argv[0]
        result = subprocess.run(argv, cwd=ROOT, env=environment, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{path}: {' '.join(argv)} failed:\n{result.stderr[-3000:]}")
        stdout = result.stdout
    return (out / table.output).read_text() if table.output else stdout


def machine() -> str:
    model = ""
    try:
        model = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{model or platform.processor()}, {os.cpu_count()} cores, {platform.system()}"


def verdicts(claims_table: str) -> str:
    """A claims table's verdict line: how many claims hold, fail and are not tested."""
    cells = [line.split(" | ")[1].strip() for line in claims_table.splitlines()[2:]]
    return f"{cells.count('yes')} hold, {cells.count('**no**')} fail, {cells.count('not tested')} not tested"


def summary(record: dict) -> str:
    """The record as a Markdown table: per kernel path, its environment, whether each table is the same as on the
    first path, and the claims' verdict line (a table whose name ends in -claims)."""
    names = sorted(record)
    paths = list(next(iter(record.values()))["paths"]) if record else []
    header = ["path", "environment", *(f"{name} same as {paths[0]}" for name in names), "claims"]
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for path in paths:
        shown = ["`--kernels native`"] * (path in NATIVE_PATHS) + [f"`{k}={v}`" for k, v in PATHS[path].items()]
        environment = " ".join(shown) or "as is"
        same = ["yes" if record[n]["paths"][path]["table"] == record[n]["paths"][paths[0]]["table"] else "**no**"
                for n in names]  # fmt: skip
        claims = "; ".join(verdicts(record[n]["paths"][path]["table"]) for n in names if n.endswith("-claims"))
        rows.append("| " + " | ".join([path, environment, *same, claims]) + " |")
    machines = sorted({f"{entry['machine']}, torch {entry['torch']}" for entry in record.values()})
    return "\n".join(rows) + f"\n\nRecorded on: {'; '.join(machines)}."


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tables", nargs="*", help="table names (scripts/docs_tables.py --list)")
    parser.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS), help="kernel paths to try")
    parser.add_argument("--write", action="store_true", help="record the verdicts in docs/data/kernel-paths.json")
    parser.add_argument("--summary", action="store_true", help="print the record as a Markdown table and stop")
    parser.add_argument("--output", type=Path, help="with --summary: also write the table into this file")
    args = parser.parse_args(argv)
    if args.summary:
        record = json.loads(RECORD.read_text())
        table = summary(record)
        print(table)
        if args.output:
            args.output.parent.mkdir(parents=True, exist_ok=True)
            args.output.write_text(table + "\n")
        return record
    if not args.tables:
        parser.error("name the tables to run (scripts/docs_tables.py --list), or pass --summary")
    unknown = sorted(set(args.tables) - set(docs_tables.TABLES))
    if unknown:
        parser.error(f"no such table: {unknown}")
    tables = {name: docs_tables.TABLES[name] for name in args.tables}
    texts: dict[str, dict[str, str]] = {name: {} for name in tables}
    with tempfile.TemporaryDirectory() as workdir:
        for path in args.paths:
            outputs: dict[tuple, str] = {}  # tables of one command share its run
            for name, table in tables.items():
                key = (table.commands, table.output)
                if key not in outputs:
                    started = time.perf_counter()
                    outputs[key] = run_path(table, path, Path(workdir) / str(len(outputs)))
                    print(f"{path}: {name}'s commands ran in {time.perf_counter() - started:.0f} s", file=sys.stderr)
                texts[name][path] = table.extract(outputs[key])
    import torch

    record = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    for name, table in tables.items():
        portable = [path for path in args.paths if path in PORTABLE_PATHS]
        stable = len({texts[name][path] for path in portable}) == 1 and set(portable) == set(PORTABLE_PATHS)
        print(f"\n## {name}: {'stable' if stable else 'NOT SHOWN STABLE'} across {', '.join(PORTABLE_PATHS)}")
        for path, text in texts[name].items():
            same = text == texts[name][args.paths[0]]
            print(f"\n### {path} ({'same as' if same else 'differs from'} {args.paths[0]}): {PATHS[path] or 'as is'}")
            print(text)
        record[name] = {
            "commands": [list(c) for c in table.commands],
            "paths": {path: {"environment": PATHS[path], "table": texts[name][path]} for path in args.paths},
            "stable": stable,
            "machine": machine(),
            "torch": torch.__version__,
        }
    if args.write:
        RECORD.write_text(json.dumps(record, indent=1) + "\n")
        print(f"\nrecorded in {RECORD}", file=sys.stderr)
    return record


if __name__ == "__main__":
    main()
