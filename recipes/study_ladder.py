"""The device tier's share ladder (issue 77, item 6) in one call: one `recipes/study.py --preset ladder` process per
cell and swept rate, all at once on the one GPU, each stopping cleanly at the time limit (the same command continues
on the next call, and a fresh machine skips the runs whose records are committed), then the report of every finished
run. The cells are one body, 256 wide and 4 deep, at 4k, 16k and 64k BPE vocabularies of the study's text (about 25%,
57% and 84% of the parameters in the embedding); the arms tied, untied, untied with the input embedding at 16x the rate
and a tied phase to 2/3, on 2 development seeds (docs/recipes/study.md, "The share ladder").

    python recipes/study.py --preset ladder --cells L4k --export_corpus runs/ladder    # here, once per cell: the
    python recipes/study.py --preset ladder --cells L16k --export_corpus runs/ladder   # text (once) and each
    python recipes/study.py --preset ladder --cells L64k --export_corpus runs/ladder   # vocabulary's tokenizer
    python recipes/study_ladder.py --corpus_dir runs/ladder --out "$OUT"                # on the device, per call
    python recipes/study_ladder.py --dry_run                                            # the commands it starts
"""

from __future__ import annotations

import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from untie_recipes.common import parse
from untie_recipes.tasks.study.protocol import LADDER_CELLS, LADDER_SEEDS

RECIPES = Path(__file__).resolve().parent
STUDY = RECIPES / "study.py"
RATES = ("tied", "untied")


@dataclass
class LadderArguments:
    corpus_dir: str = field(
        default="runs/ladder", metadata={"help": "the folder --export_corpus wrote (text, vocabularies)"}
    )
    cells: list[str] = field(
        default_factory=lambda: list(LADDER_CELLS), metadata={"help": "the ladder's cells, in order"}
    )
    seeds: list[int] = field(default_factory=lambda: list(LADDER_SEEDS), metadata={"help": "development seeds"})
    time_limit: float = field(default=300.0, metadata={"help": "seconds each process trains before it stops cleanly"})
    device: str = field(default="cuda", metadata={"help": "cuda (one device, shared by the processes), or cpu"})
    output_dir: str = field(
        default="runs/study-ladder", metadata={"help": "one folder per cell under it, and the logs"}
    )
    records_dir: str | None = field(default=None, metadata={"help": "the committed records (default: the preset's)"})
    extra: str = field(
        default="",
        metadata={
            "help": "more flags for every study process, as one quoted string (--extra='--curve_points 10'; the = "
            "form also passes one flag alone: --extra=--allow_repeats)"
        },
    )
    out: str | None = field(
        default=None,
        metadata={
            "help": "copy the records, the logs and the report here at the end, also when a SIGTERM ends the call (the "
            "device's $OUT; a SIGKILL cannot be caught: keep --time_limit under the call's limit)"
        },
    )
    dry_run: bool = field(default=False, metadata={"help": "print the commands, start nothing"})
    disable_tqdm: bool = field(default=False, metadata={"help": "no progress line"})


def commands(args: LadderArguments) -> list[tuple[str, list[str]]]:
    """One study process per cell and swept rate, the first cell's first: (name, command)."""
    unknown = sorted(set(args.cells) - set(LADDER_CELLS))
    if unknown:
        raise SystemExit(f"--cells {unknown}: the ladder's cells are {list(LADDER_CELLS)}.")
    records = ["--records_dir", args.records_dir] if args.records_dir is not None else []
    return [
        (f"{cell}-{rate}", [sys.executable, str(STUDY), "--preset", "ladder", "--cells", cell, "--rates", rate,
                            "--seeds", *map(str, args.seeds), "--corpus_dir", args.corpus_dir, "--device", args.device,
                            "--time_limit", f"{args.time_limit:g}", "--output_dir", f"{args.output_dir}/{cell}",
                            *records, "--disable_tqdm", *shlex.split(args.extra)])
        for cell in args.cells
        for rate in RATES
    ]  # fmt: skip


def run_all(args: LadderArguments, started: list[tuple[str, list[str]]]) -> dict[str, int]:
    """Start every process at once (each one's log beside its folder), show one line until they end, and return each
    one's exit status."""
    logs = Path(args.output_dir)
    logs.mkdir(parents=True, exist_ok=True)
    processes = {}
    for name, command in started:
        with open(logs / f"{name}.log", "w") as log:
            processes[name] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    bar = tqdm(total=len(processes), desc="Share ladder", unit="process", disable=args.disable_tqdm)
    finished: dict[str, int] = {}
    try:
        while len(finished) < len(processes):
            for name, process in processes.items():
                if name not in finished and process.poll() is not None:
                    finished[name] = process.returncode
                    bar.update(1)
            time.sleep(1.0)
    finally:  # interrupted (the call's time out): no process outlives the launcher
        for process in processes.values():
            if process.poll() is None:
                process.terminate()
        for process in processes.values():
            process.wait()
        bar.close()
    return finished


def _stop(signum: int, frame: object) -> None:
    """A SIGTERM (how a call's time limit ends it) as SystemExit, so that what was made is still brought back."""
    raise SystemExit(128 + signum)


def bring_back(args: LadderArguments) -> None:
    """Copy what a call made (the finished records of every cell, each process's log, the report) into `args.out`,
    each file whole or not at all: a machine given back loses the rest."""
    if args.out is None:
        return
    out = Path(args.out)
    found = [
        path
        for path in Path(args.output_dir).rglob("*")
        if path.is_file()
        and (path.suffix == ".log" or path.parent.name in ("records", "report") and path.suffix in (".json", ".md"))
    ]
    for path in found:
        copy = out / path.relative_to(args.output_dir)
        copy.parent.mkdir(parents=True, exist_ok=True)
        partial = copy.with_name(copy.name + ".partial")
        shutil.copyfile(path, partial)
        partial.replace(copy)


def main(argv: list[str] | None = None) -> dict[str, int]:
    (args,), _ = parse((LadderArguments,), argv)
    started = commands(args)
    if args.dry_run:
        for _, command in started:
            print(" ".join(command))
        return {}
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        return report_after(args, run_all(args, started))
    finally:
        bring_back(args)
        signal.signal(signal.SIGTERM, previous)


def report_after(args: LadderArguments, statuses: dict[str, int]) -> dict[str, int]:
    """Name the processes that failed and where their logs are, then write the report of every finished run."""
    failed = {name: status for name, status in statuses.items() if status != 0}
    for name in failed:
        print(f"{name}: exit status {failed[name]}; its log: {args.output_dir}/{name}.log", file=sys.stderr)
    records = ["--records_dir", args.records_dir] if args.records_dir is not None else []
    report = [sys.executable, str(STUDY), "--preset", "ladder", "--report_only", "--output_dir",
              f"{args.output_dir}/report", *records]  # fmt: skip
    subprocess.run(report, check=True)
    if failed:
        raise SystemExit(1)
    return statuses


if __name__ == "__main__":
    main()
