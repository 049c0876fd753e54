"""`check_writable`: where a command may write, said before it works. The commands that take it are tested in
their own files (report, run, pretrain, personalize, data, flower, bench, tune); here, the rule."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pflbed.errors import PflbedError
from pflbed.writable import check_writable


def _refused(path: Path) -> str:
    with pytest.raises(PflbedError) as e:
        check_writable(path, f"--out {path}")
    return str(e.value)


def test_the_nearest_existing_part_decides_and_a_file_there_is_named(tmp_path):
    (tmp_path / "f").write_text("")
    for deep in (tmp_path / "f" / "x", tmp_path / "f" / "x" / "y"):
        assert _refused(deep) == f"--out {deep}: {tmp_path / 'f'} is a file, not a directory"
    for fine in (tmp_path, tmp_path / "new", tmp_path / "new" / "deeper", Path("relative") / "dir", Path(".")):
        check_writable(fine, "--out")  # missing directories are made later: only what exists is asked


def test_a_directory_this_process_may_not_write_or_search_is_refused(tmp_path, monkeypatch):
    """Root ignores permission bits, so `os.access` is what says no here; both write and search are asked for,
    of the nearest existing directory alone."""
    asked = []

    def access(path, mode):
        asked.append((Path(path), mode))
        return Path(path) != tmp_path / "ro"

    monkeypatch.setattr(os, "access", access)
    (tmp_path / "ro" / "ok").mkdir(parents=True)
    assert _refused(tmp_path / "ro" / "a" / "b") == f"--out {tmp_path / 'ro' / 'a' / 'b'}: {tmp_path / 'ro'} is " \
                                                   "not writable"  # fmt: skip
    assert asked == [(tmp_path / "ro", os.W_OK | os.X_OK)]
    check_writable(tmp_path / "ro" / "ok" / "new", "--out")  # its own directory decides, not its parent's
