"""Path guards for commands that write a destination directory (``convert``, ``quantize``, ``rl --save``).

With ``--overwrite`` a writer replaces its destination wholesale (a new directory is
written next to it, then renamed over it), so a destination that is the source, holds
the source, or lies inside it would lose the source or be written into it. The guard
refuses those before anything is read, written or deleted.

:func:`destination_report` tells, after a Ctrl-C, what the interrupted write left at
the destination (the writers' temporary siblings are removed; the destination itself
is either as it was or completely written, because it is replaced by one rename).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable

from .dsl import UnifiedModelsError

__all__ = ["check_destination", "destination_report", "TEMP_MARKERS"]

TEMP_MARKERS = (".tmp-", ".old-")
"""A writer's siblings of ``DST`` are ``.<DST name>.tmp-<hex>`` (being written) and
``.<DST name>.old-<hex>`` (the replaced destination, until it is deleted)
(:func:`unified_models.converters.megatron_dist_ckpt.atomic_output_dir`)."""


def check_destination(src: str | os.PathLike, dst: str | os.PathLike, *, src_name: str = "SRC",
                      dst_name: str = "DST") -> None:
    """Refuse a destination ``dst`` that is ``src``, contains it, or lies inside it.

    Both paths are compared as resolved real paths (symlinks followed, ``..`` removed;
    ``dst`` need not exist yet), so a symlink to the source counts as the source. A
    ``dst`` that is a symlink is also checked where it stands (its resolved parent
    directory plus its own name), because the writers replace the link itself and
    write their temporary directory next to it: a link inside the source pointing
    elsewhere would still have the output written into the source.

    Raises:
        UnifiedModelsError: naming both paths as given, the real path they share, and
            why (``src_name`` / ``dst_name`` are the CLI's names for them).
    """
    s, d = Path(os.path.realpath(src)), Path(os.path.realpath(dst))
    given = f"{dst_name} {dst} and {src_name} {src}"
    if d == s:
        raise UnifiedModelsError(f"{given} are the same directory ({s}): writing {dst_name} would replace the "
                                 f"source; choose another {dst_name}")
    if s.is_relative_to(d):
        raise UnifiedModelsError(f"{given}: {dst_name} ({d}) contains {src_name} ({s}), so replacing it would "
                                 f"delete the source; choose a {dst_name} outside it")
    if d.is_relative_to(s):
        raise UnifiedModelsError(f"{given}: {dst_name} ({d}) is inside {src_name} ({s}); choose a {dst_name} "
                                 "outside the source")
    p = Path(dst)
    placed = Path(os.path.realpath(p.parent)) / p.name  # where the writer puts its directory
    if placed.is_relative_to(s):
        raise UnifiedModelsError(f"{given}: {dst_name} is a link at {placed}, inside {src_name} ({s}); the output "
                                 f"would be written into the source; choose a {dst_name} outside it")


def _siblings(dst: Path) -> set[str]:
    parent = dst.parent if str(dst.parent) else Path(".")
    prefix = f".{dst.name}"
    try:
        return {e.name for e in os.scandir(parent)
                if e.name.startswith(prefix) and any(m in e.name for m in TEMP_MARKERS)}
    except OSError:
        return set()


def _identity(dst: Path):
    try:
        st = os.lstat(dst)
    except OSError:
        return None
    return (st.st_ino, st.st_dev, st.st_mtime_ns)


def destination_report(dst: str | os.PathLike, name: str = "DST") -> Callable[[], str]:
    """Snapshot ``dst`` now; the returned callable, called after an interrupted write,
    removes the temporary siblings the write created (:data:`TEMP_MARKERS`; ones that
    existed before are left alone) and says what ``dst`` holds.

    Returns:
        ``describe() -> str``, e.g. ``"DST out was not written (it did not exist and still
        does not)"`` or ``"DST out was written completely before the interrupt"``.
    """
    p = Path(dst)
    before, before_siblings = _identity(p), _siblings(p)

    def describe() -> str:
        removed = []
        for n in sorted(_siblings(p) - before_siblings):
            q = p.parent / n
            if q.is_symlink() or q.is_file():
                q.unlink(missing_ok=True)
            else:
                shutil.rmtree(q, ignore_errors=True)
            removed.append(n)
        now = _identity(p)
        if now == before:
            state = (f"{name} {dst} was not written (it did not exist and still does not)" if before is None else
                     f"{name} {dst} is untouched (its previous contents are kept)")
        elif now is None:
            state = f"{name} {dst} no longer exists"  # not something our writers do; say it plainly
        else:
            state = f"{name} {dst} was written completely before the interrupt"
        if removed:
            state += f"; removed the unfinished temporary {', '.join(removed)}"
        return state

    return describe
