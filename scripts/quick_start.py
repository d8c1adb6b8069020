"""The README's two quick-start lines: print them, or run them exactly as written, timed, as a newcomer would.

    python scripts/quick_start.py                  # print the two lines
    python scripts/quick_start.py --run            # run both, in order, in this environment; time each
    python scripts/quick_start.py --run 1          # the first only (the main job), then check its claims

CI runs `--run` with a fresh venv first on PATH (`.ci/run`), so that the `pip` and `python` of the lines are the
venv's and a missing install step fails CI instead of a newcomer. After the first line the run's
`runs/exor/results.json` must report at least one checked claim (a run whose models learned nothing checks none);
which claims it checks is the docs' table CI compares with this run (`scripts/docs_tables.py --check --cheap
--from runs/exor exor-quick-checked`); which of them hold follows one seed's trajectory, exact on a CPU kind only.
Each line's wall time is printed (`quick-start line N: ... s`); the README quotes them with the machine they were
measured on.

Standard library only: it runs in a venv that has nothing installed yet.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
RESULTS = Path("runs") / "exor" / "results.json"


def quick_start_lines(readme: Path = README) -> list[str]:
    """The command lines of the README's quick start: the first ```bash block under "## Quick start"; exactly two."""
    text = readme.read_text()
    section = re.search(r"^## Quick start\n(.*?)(?=^## )", text, flags=re.M | re.S)
    if section is None:
        raise ValueError(f"{readme}: no '## Quick start' section")
    block = re.search(r"```bash\n(.*?)```", section.group(1), flags=re.S)
    if block is None:
        raise ValueError(f"{readme}: the quick start has no ```bash block")
    lines = [line.strip() for line in block.group(1).splitlines() if line.strip()]
    if len(lines) != 2:
        raise ValueError(f"{readme}: the quick start must be exactly two command lines, found {len(lines)}: {lines}")
    return lines


def claims_verdict(results: Path) -> tuple[int, int, list[str]]:
    """(checked, holding, the failing claims' texts) of a finished EXor run's results.json."""
    claims = json.loads(results.read_text())["claims"]
    checked = [c for c in claims if c["holds"] is not None]
    failing = [c["claim"] for c in checked if not c["holds"]]
    return len(checked), len(checked) - len(failing), failing


def check_claims(results: Path) -> None:
    """Fail unless the quick start checked at least one claim: a run in which nothing learned the task judges no
    geometry claim. Which claims are checked is compared with the docs (`docs_tables.py --check`), not here."""
    if not results.exists():
        raise SystemExit(f"quick start: {results} was not written")
    checked, holding, failing = claims_verdict(results)
    print(f"quick start: {holding} of {checked} checked claims hold" + (f"; failing: {failing}" if failing else ""))
    if checked == 0:
        raise SystemExit("quick start: no claim was checked (no run learned the task)")


def run_line(number: int, line: str) -> float:
    """Run one line with bash in the repository root, exactly as written; its wall time in seconds."""
    print(f"quick-start line {number}: {line}", flush=True)
    started = time.perf_counter()
    result = subprocess.run(["bash", "-c", line], cwd=ROOT)
    seconds = time.perf_counter() - started
    print(f"quick-start line {number}: exit {result.returncode}, {seconds:.0f} s wall", flush=True)
    if result.returncode != 0:
        raise SystemExit(result.returncode)
    return seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", nargs="*", type=int, metavar="N", help="run these lines (default: both)")
    args = parser.parse_args(argv)
    lines = quick_start_lines()
    if args.run is None:
        print("\n".join(lines))
        return
    for number in args.run or [1, 2]:
        if number not in (1, 2):
            parser.error(f"--run takes 1 and/or 2, not {number}")
        run_line(number, lines[number - 1])
        if number == 1:
            check_claims(ROOT / RESULTS)


if __name__ == "__main__":
    main(sys.argv[1:])
