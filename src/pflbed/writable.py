"""Whether a command may write where it was told to, asked before any work it would waste.

Why a check of its own: Python's own errors come late and name the wrong thing. A report, a manifest or a
pretrained model below a path that is a file failed with "File exists" or "Not a directory" once the runs were read,
the figures drawn or the model trained, and the pretraining's message named its temporary directory. The commands
that write (run, report, pretrain, personalize, bench, tune, data, flower) take their paths through
`check_writable` first, so the mistake is one line naming the option, before anything is computed.
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
