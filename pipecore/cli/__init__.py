"""The ``pipecore`` command line: ``pipecore <command> [options]``.

Subcommands are modules registered in :data:`COMMANDS` (name -> module path). A subcommand module
defines ``HELP`` (one line for the command list), ``add_arguments(parser)`` and ``run(args) -> int``, and
keeps heavy imports inside ``run`` so that ``pipecore --help`` stays fast. Adding a command is one line
in :data:`COMMANDS`.

Bad input is reported as one line on stderr with exit code 2: argparse errors, and any ``ValueError``
a command raises (commands raise ``ValueError`` for input problems, never print tracebacks for them).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from types import ModuleType
from typing import Sequence

COMMANDS: dict[str, str] = {
    "plan": "pipecore.cli.plan",
    "simulate": "pipecore.cli.simulate",
    "train": "pipecore.cli.train",
}

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors raise instead of exiting, so that :func:`main` returns the code."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        raise _UsageError(f"{self.prog}: error: {message}")


class _UsageError(Exception):
    pass


def _load(name: str) -> ModuleType:
    return importlib.import_module(COMMANDS[name])


def build_parser() -> argparse.ArgumentParser:
    """The full parser: one subparser per registered command."""
    from .. import __version__

    parser = _Parser(
        prog="pipecore",
        description="Pipeline-parallel training with first-class weight staleness.",
    )
    parser.add_argument("--version", action="version", version=f"pipecore {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in COMMANDS:
        module = _load(name)
        command = sub.add_parser(
            name, help=module.HELP, description=getattr(module, "DESCRIPTION", module.HELP),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(command)
        command.set_defaults(_run=module.run, _parser=command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``pipecore`` with ``argv`` (default: ``sys.argv[1:]``) and return the exit code."""
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
        if extra:
            # Report stray arguments against the subcommand they were given to.
            (getattr(args, "_parser", None) or parser).error(f"unrecognized arguments: {' '.join(extra)}")
    except _UsageError as error:
        print(error, file=sys.stderr)
        return EXIT_USAGE
    except SystemExit as done:  # --help and --version exit through argparse
        return int(done.code or 0)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return int(args._run(args) or 0)
    except ValueError as error:
        # Input problems: one clear line (or the schedule table a ScheduleError carries), no traceback.
        print(f"pipecore {args.command}: error: {error}", file=sys.stderr)
        return EXIT_USAGE


__all__ = ["COMMANDS", "build_parser", "main"]
