"""argparse types shared by ``bisect`` and ``gates`` (the same rules as :mod:`unified_models.cli`'s,
kept here so that this package never imports the CLI module: no import cycle)."""

from __future__ import annotations

import argparse
import math


def positive(kind):
    """argparse type: a finite ``kind`` > 0."""
    def parse(s: str):
        try:
            v = kind(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {s!r}") from None
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


def add_plugin_flag(parser: argparse.ArgumentParser) -> None:
    """``--plugin MODULE`` (repeatable; :func:`unified_models.cli.main` imports them before parsing)."""
    parser.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                        help="import this Python module first (layer families, model declarations, rewards)")
