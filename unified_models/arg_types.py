"""argparse types and flags shared by every command module (:mod:`unified_models.cli`, ``bisect``,
``gates``): a leaf module, so command packages use them without importing the CLI."""

from __future__ import annotations

import argparse
import math


def positive(kind):
    """argparse type: an ``int`` > 0, or a finite ``float`` > 0 (the message says which)."""
    what = "an integer" if kind is int else "a number"

    def parse(s: str):
        try:
            v = kind(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {s!r}") from None
        if kind is int and v <= 0:
            raise argparse.ArgumentTypeError(f"must be an integer > 0, got {s}")
        if not math.isfinite(v) or v <= 0:
            raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {s}")
        return v
    return parse


def seed(s: str) -> int:
    """argparse type: an integer in ``[0, 2**32)``."""
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
    if not 0 <= v < 2**32:
        raise argparse.ArgumentTypeError(f"must be in [0, 2**32), got {v}")
    return v


def at_least(lo: int):
    """argparse type: an integer >= ``lo``."""
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        return v
    return parse


def add_plugin_flag(parser: argparse.ArgumentParser) -> None:
    """``--plugin MODULE`` (repeatable) on a command that loads models (imported by :func:`main` first)."""
    parser.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                        help="import this Python module first, so the layer families, model declarations or "
                             "rewards it registers are known (repeatable; entry points of the "
                             "'unified_models.plugins' group are always loaded)")
