"""Whether a command may write where it was told to, asked before any work it would waste.

Why a check of its own: Python's own errors come late and name the wrong thing. A report, a manifest or a heat-map
below a path that is a file failed with "File exists" (or "Not a directory") once the runs were read and the figures
drawn; one in a directory this process may not write failed with "Permission denied" naming a temporary file.
Every command that writes takes its path through `check_writable` first, so the mistake is one line naming the
option, before anything is computed.
"""

from __future__ import annotations

import os
from pathlib import Path

from pflbed.errors import PflbedError


def check_writable(directory: Path, shown: str) -> None:
    """Refuse `directory` (made where missing) unless its nearest existing part is a directory this process may
    write and search. `shown`: the option and path as the user gave them, which the message starts with. Root
    ignores permission bits, so `os.access`, not a trial write, says whether this process may write there."""
    ancestor = next(p for p in (directory, *directory.parents) if p.exists())  # "." and "/" always do
    if not ancestor.is_dir():
        raise PflbedError(f"{shown}: {ancestor} is a file, not a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise PflbedError(f"{shown}: {ancestor} is not writable")
