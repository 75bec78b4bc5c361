"""argparse value types shared by the subcommands."""

from __future__ import annotations

import argparse
from typing import Any


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
