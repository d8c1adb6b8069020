"""The `untie` command line: `untie inspect` a checkpoint's tying and drift, `untie convert` it tied <-> untied.

Parsing needs nothing but the standard library: torch and transformers are imported only once a command runs, so
`--help` and usage errors answer at once.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from typing import Literal

#: The `--head` choices (`untie.checkpoints.loading.HEADS` maps each to its Auto class; a test keeps the two in step).
HEAD_CHOICES = ("causal-lm", "masked-lm", "seq2seq-lm")

EXIT_CODES = {
    0: "success",
    1: "unexpected error (a bug, or a failure inside transformers: the traceback says which)",
    2: "bad command line (argparse), or a bad value such as an unknown token in --pairs",
    3: "checkpoint not found: no such folder, no config.json, or the hub could not provide it",
    4: "the model has no input embedding or LM head to tie or untie (try --head)",
    5: "convert built the checkpoint but it did not reload in the requested state (OUT is left untouched)",
    6: "checkpoint incomplete or damaged: no weights, a missing or truncated file, a stale index, invalid config.json, "
    "an embedding or head stored with another shape or as integers, an untied head that is not stored",
    7: "OUT cannot be written: read-only, disk full, or a file where a folder must be (OUT is left untouched)",
    8: "the checkpoint ships its own modelling code (auto_map), which untie does not run",
}

_DESCRIPTION = """\
Tie or untie the input embedding and the LM head of a Hugging Face checkpoint, and see what a checkpoint is.

A tied model uses one matrix both to read tokens (input embedding) and to predict them (LM head). Bertolotti &
Cazzola (ICML 2024) show that the two roles want different geometry: inputs group tokens that are swappable,
outputs group tokens that are equally likely next. `untie inspect` tells you which case a checkpoint is in and,
for an untied one, how far the two spaces have drifted apart. `untie convert` writes a tied checkpoint untied (or
an untied one tied), so that plain from_pretrained loads it in the new state.
"""

_EPILOG = """\
examples:
  untie inspect openai-community/gpt2
  untie inspect ./my-untied-model --pairs king:queen 464:262 --json
  untie inspect sentence-transformers/all-MiniLM-L6-v2 --head masked-lm
  untie convert ./gpt2-tied ./gpt2-untied --untie
  untie convert EleutherAI/pythia-160m ./pythia-tied --tie --init mean

exit codes:
""" + "\n".join(f"  {code}  {meaning}" for code, meaning in EXIT_CODES.items())


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `untie` (shared by the entry point and `python -m untie`)."""
    parser = _Parser(
        prog="untie", description=_DESCRIPTION, epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="{inspect,convert}")

    inspect = commands.add_parser(
        "inspect",
        help="is a checkpoint tied; which parameters; how far its untied spaces have drifted",
        description="Report whether a checkpoint loads tied, its embedding parameters and config flags, and, if it "
        "is untied, how far the input and output spaces have drifted apart (nearest-neighbour overlap and linear "
        "CKA on sampled tokens, each with its chance level; distances of the token pairs you give). Only the two "
        "embedding tensors are read, so it is fast on any model size.",
    )
    _source(inspect)
    inspect.add_argument("--json", action="store_true", help="print the report as JSON")
    inspect.add_argument(
        "--pairs",
        nargs="+",
        default=[],
        metavar="A:B",
        help="token pairs to measure in both spaces: ids (464:262) or single tokens of the checkpoint's tokenizer "
        "(king:queen); `auto`: its most frequent case and word-start variants (the:The, Ġthe:the, ...)",
    )
    inspect.add_argument("--queries", type=_positive, default=512, help="tokens whose neighbours are compared (512)")
    inspect.add_argument("--pool", type=_positive, default=8192, help="tokens the neighbours are searched among (8192)")
    inspect.add_argument("--rows", type=_positive, default=2048, help="tokens linear CKA is computed on (default 2048)")
    inspect.add_argument("--k", type=_positive, default=10, help="neighbours per token (default 10)")
    inspect.add_argument("--seed", type=int, default=0, help="seed of the token samples (default 0)")

    convert = commands.add_parser(
        "convert",
        help="write a checkpoint untied (--untie) or tied (--tie)",
        description="Load SOURCE, untie or tie its LM head, and write OUT: safetensors, config and the tokenizer "
        "files. OUT is then reloaded with plain from_pretrained and checked to be in the new state, also after "
        "tie_weights() and resize_token_embeddings(). --untie gives the head an exact copy of the shared matrix; "
        "--tie keeps one matrix, chosen by --init.",
    )
    _source(convert)
    convert.add_argument("output_dir", metavar="OUT", help="folder to write (new, or empty, or with --overwrite)")
    mode = convert.add_mutually_exclusive_group(required=True)
    mode.add_argument("--untie", action="store_true", help="give the LM head its own copy of the shared matrix")
    mode.add_argument("--tie", action="store_true", help="make the LM head share the input embedding")
    convert.add_argument(
        "--init",
        choices=["input", "output", "mean"],
        default="input",
        help="with --tie: the shared matrix starts as the input embedding (default), the head, or their mean",
    )
    convert.add_argument("--overwrite", action="store_true", help="write into a non-empty OUT")
    convert.add_argument("--no-verify", action="store_true", help="skip the reload checks (saves one load)")
    convert.add_argument("--json", action="store_true", help="print the summary as JSON")
    return parser


def _positive(text: str) -> int:
    """An argparse type: an integer of at least 1 (a sample size or a neighbour count)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _source(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", metavar="SOURCE", help="checkpoint folder or hub id")
    parser.add_argument(
        "--head",
        choices=["auto", *HEAD_CHOICES],
        default="auto",
        help="class to load SOURCE with: auto (the config's architecture) or an LM head, needed for checkpoints "
        "saved without one (a sentence-transformers BertModel: --head masked-lm)",
    )
    parser.add_argument("--revision", default=None, help="hub revision (branch, tag or commit)")


class _CommandLineError(Exception):
    """An argparse error, raised instead of exiting so that `--json` can report it."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise _CommandLineError(f"{self.prog}: error: {message}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run `untie ...`; returns the exit code (see EXIT_CODES).

    With `--json`, stdout carries exactly one JSON object, also on an error: `{"error": ..., "exit_code": ...}`.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in argv
    parser = build_parser()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    command = argv[0] if argv and not argv[0].startswith("-") else None
    try:
        args = parser.parse_args(argv)
        if args.command == "convert" and args.init != "input" and not args.tie:
            parser.error("--init only applies with --tie")
    except _CommandLineError as error:
        return _fail(str(error), 2, as_json, usage=parser.format_usage())
    command = args.command
    from untie.checkpoints.loading import CheckpointError  # torch and transformers: only once a command runs

    try:
        if command == "inspect":
            return _inspect(args, parser)
        return _convert(args)
    except _CommandLineError as error:
        return _fail(str(error), 2, as_json, usage=parser.format_usage())
    except CheckpointError as error:
        return _fail(f"untie {command}: error: {error}", error.exit_code, as_json)
    except (ValueError, FileExistsError) as error:
        return _fail(f"untie {command}: error: {error}", 2, as_json)
    except OSError as error:  # disk full, read-only, a file in the path: never a traceback
        return _fail(f"untie {command}: error: {error}", 7 if command == "convert" else 1, as_json)
    except Exception as error:
        if not as_json:
            raise
        import traceback

        traceback.print_exc()
        return _fail(f"untie {command}: unexpected error: {type(error).__name__}: {error}", 1, as_json)


def _fail(message: str, exit_code: int, as_json: bool, usage: str = "") -> int:
    print(usage + message, file=sys.stderr)
    if as_json:
        print(json.dumps({"error": message, "exit_code": exit_code}, indent=2))
    return exit_code


def _inspect(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from untie.checkpoints.inspection import describe, format_report

    listed: list[tuple[int | str, int | str]] = []
    for item in args.pairs if args.pairs != ["auto"] else ():
        parts = item.split(":")
        if len(parts) != 2 or not all(parts):
            parser.error(f"--pairs {item!r}: write each pair as A:B (token ids or tokens), e.g. 464:262 or king:queen")
        listed.append((parts[0], parts[1]))
    pairs: list[tuple[int | str, int | str]] | Literal["auto"] = "auto" if args.pairs == ["auto"] else listed
    report = describe(
        args.source,
        head=args.head,
        pairs=pairs,
        revision=args.revision,
        seed=args.seed,
        queries=args.queries,
        pool=args.pool,
        rows=args.rows,
        k=args.k,
    )
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def _convert(args: argparse.Namespace) -> int:
    from untie.checkpoints.conversion import convert_checkpoint

    summary = convert_checkpoint(
        args.source,
        args.output_dir,
        untie=args.untie,
        init=args.init,
        head=args.head,
        revision=args.revision,
        overwrite=args.overwrite,
        verify=not args.no_verify,
    )
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(
        f"{summary['source']} ({summary['model_class']}, {summary['before']}) -> {summary['output_dir']} "
        f"({summary['after']}{', init ' + summary['init'] if summary['init'] else ''})"
    )
    if summary["copied_files"]:
        print(f"  copied: {', '.join(summary['copied_files'])}")
    for check in summary["checks"]:
        print(f"  ok: {check}")
    for note in summary["notes"]:
        print(f"  note: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
