"""Ctrl-C (SIGINT) in a command: one line saying what was kept, exit status 130.

:func:`unified_models.cli.main` installs :func:`handle_sigint` for the duration of a
command. The handler records that an interrupt arrived and raises
``KeyboardInterrupt`` as Python's default one does. Some libraries catch that and
re-raise it as their own error (PyTorch DCP wraps every ``BaseException`` of a write
into a ``CheckpointException``, which our writers then report as "writing ... failed");
:func:`interrupted` lets ``main`` recognise such an error as the interrupt it is.

Commands say what an interrupt would keep by registering a describer with
:func:`on_interrupt` (a callable returning one line, called only after the
interrupt, so it reads the state on disk at that moment) and, for a loop, their
progress with :func:`progress`. :func:`summary` builds the line ``main`` prints, e.g.
``interrupted at step 3; latest checkpoint: step 2 (runs/ckpt/iter_0000002)``.
"""

from __future__ import annotations

import signal
from typing import Callable

__all__ = ["EXIT_STATUS", "handle_sigint", "interrupted", "on_interrupt", "progress", "summary", "reset"]

EXIT_STATUS = 130
"""128 + SIGINT (2), what shells report for a command ended by Ctrl-C."""

_state: dict = {"interrupted": False, "step": None, "describe": None}


def reset() -> None:
    """Forget an earlier command's interrupt, progress and describer (``main`` calls it first)."""
    _state.update(interrupted=False, step=None, describe=None)


def handle_sigint(signum: int = signal.SIGINT, frame=None) -> None:
    """SIGINT handler: mark the interrupt, then raise ``KeyboardInterrupt``.

    Raises:
        KeyboardInterrupt: always (as the default handler).
    """
    _state["interrupted"] = True
    raise KeyboardInterrupt


def interrupted() -> bool:
    """Whether a SIGINT arrived since :func:`reset`."""
    return bool(_state["interrupted"])


def progress(step: int) -> None:
    """Record the step (1-based) a loop is working on; :func:`summary` names it."""
    _state["step"] = int(step)


def on_interrupt(describe: Callable[[], str]) -> None:
    """Register what the running command keeps on an interrupt: ``describe()`` returns
    the part of the line after ``interrupted ...;`` (e.g. ``"latest checkpoint: step 2"``)."""
    _state["describe"] = describe


def summary() -> str:
    """The one line printed on an interrupt: ``interrupted[ at step N][; <what was kept>]``.

    A describer that itself fails is reported as such instead of raising.
    """
    head = "interrupted" if _state["step"] is None else f"interrupted at step {_state['step']}"
    describe = _state["describe"]
    if describe is None:
        return head
    try:
        kept = describe()
    except Exception as e:  # noqa: BLE001 - the line must still be printed
        kept = f"could not tell what was kept ({type(e).__name__}: {e})"
    return f"{head}; {kept}" if kept else head
