"""Path guards for commands that write a destination directory (``convert``, ``quantize``).

With ``--overwrite`` a writer replaces its destination wholesale (a new directory is
written next to it, then renamed over it), so a destination that is the source, holds
the source, or lies inside it would lose the source or be written into it. The guard
refuses those before anything is read, written or deleted.
"""

from __future__ import annotations

import os
from pathlib import Path

from .dsl import UnifiedModelsError

__all__ = ["check_destination"]


def check_destination(src: str | os.PathLike, dst: str | os.PathLike, *, src_name: str = "SRC",
                      dst_name: str = "DST") -> None:
    """Refuse a destination ``dst`` that is ``src``, contains it, or lies inside it.

    Both paths are compared as resolved real paths (symlinks followed, ``..`` removed;
    ``dst`` need not exist yet), so a symlink to the source counts as the source.

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
