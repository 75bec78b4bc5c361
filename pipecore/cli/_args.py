"""argparse value types shared by the subcommands, and the error they raise for a bad combination of flags."""

from __future__ import annotations

import argparse
from typing import Any


class ConfigurationError(ValueError):
    """Bad input that depends only on the command line and the launch (the flags, the number of processes),
    so that every process of a ``torchrun`` launch finds it alike: :func:`pipecore.cli.main` prints it from
    rank 0 alone. Errors a rank may meet on its own (a file, its stage) stay plain ``ValueError``."""


def positive_int(text: str) -> int:
    """An integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def parse_option_value(text: str) -> Any:
    """``--option`` values: int, float, ``true``/``false``, ``none`` (= the default), comma-separated
    lists of those (e.g. SpecTrain's ``lookahead=3,2,1,0``), otherwise the string itself."""
    if "," in text:
        return [parse_option_value(part) for part in text.split(",")]
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def algorithm_option(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` for an algorithm option; the value is parsed by :func:`parse_option_value`."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip() or not value.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (e.g. lam=0.5), got {text!r}")
    return key.strip(), parse_option_value(value.strip())


#: The optimizers ``--optimizer`` chooses from, with what a run's header says of them (``{lr}``: the rate).
OPTIMIZERS = {"sgd": "SGD lr {lr:g} momentum 0.9", "adamw": "AdamW lr {lr:g}", "nadam": "NAdam lr {lr:g}"}
