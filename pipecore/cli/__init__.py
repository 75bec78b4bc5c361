"""The ``pipecore`` command line: ``pipecore <command> [options]``.

Subcommands are modules registered in :data:`COMMANDS` (name -> module path). A subcommand module
defines ``HELP`` (one line for the command list), ``add_arguments(parser)`` and ``run(args) -> int``, and
keeps heavy imports inside ``run`` so that ``pipecore --help`` stays fast. Adding a command is one line
in :data:`COMMANDS`.

Bad input is reported as one line on stderr with exit code 2: argparse errors (without argparse's usage
block: the line ends by pointing at ``--help``), and any ``ValueError`` a command raises (commands raise
``ValueError`` for input problems, never print tracebacks for them).

Under ``torchrun`` every process runs the same command line, so an error in it, or any
:class:`~pipecore.cli._args.ConfigurationError` a command raises, would be printed once per rank. Such an error is
printed by rank 0 alone, which exits with 2 (the launch fails); the other ranks exit quietly (see
:func:`report_error`).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from types import ModuleType
from typing import Sequence

from ._args import ConfigurationError

COMMANDS: dict[str, str] = {
    "plan": "pipecore.cli.plan",
    "simulate": "pipecore.cli.simulate",
    "train": "pipecore.cli.train",
}

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors raise instead of exiting, so that :func:`main` returns the code."""

    def error(self, message: str) -> None:  # type: ignore[override]
        # One line, like every other error: argparse's usage block would bury it under ten lines of flags.
        raise _UsageError(f"{self.prog}: error: {message} (see {self.prog} --help)")


class _UsageError(Exception):
    pass


def launch_rank() -> int | None:
    """This process's rank when a launcher such as ``torchrun`` started several (``RANK`` and ``WORLD_SIZE``
    set, ``WORLD_SIZE`` above 1); None in a single process."""
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ.get("WORLD_SIZE", "1"))
    except (KeyError, ValueError):  # not launched so, or variables that are not a launcher's
        return None
    return rank if world > 1 else None


def report_error(line: str, same_on_every_rank: bool) -> int:
    """Print ``line`` on stderr and return the exit code.

    An error that every process of a launch finds alike (the command line's, a :class:`ConfigurationError`) is
    reported by rank 0 alone: it prints the line and exits with 2, so that the launch fails as one that did not
    train should (torchrun then adds its own summary of the failed worker); the other ranks exit quietly with 0,
    since a rank exiting with an error first would have torchrun stop rank 0 before it prints. Other errors are
    each process's own: printed, exit code 2.
    """
    rank = launch_rank()
    if rank is None or not same_on_every_rank or rank == 0:
        print(line, file=sys.stderr, flush=True)
        return EXIT_USAGE
    return 0


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
        return report_error(str(error), same_on_every_rank=True)
    except SystemExit as done:  # --help and --version exit through argparse
        return int(done.code or 0)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return int(args._run(args) or 0)
    except ValueError as error:
        # Input problems: one clear line (or the schedule table a ScheduleError carries), no traceback.
        return report_error(f"pipecore {args.command}: error: {error}",
                            same_on_every_rank=isinstance(error, ConfigurationError))


__all__ = ["COMMANDS", "ConfigurationError", "build_parser", "launch_rank", "main", "report_error"]
