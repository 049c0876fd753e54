"""The Flower deployment processes a test started, found by a mark in their environment.

A deployment's processes (SuperLink, SuperNodes, SuperExec, ServerApps, ClientApps) inherit the environment of the
`pflbed flower` command that started them — one that outlived its deployment too, though it is then no descendant
of the test any more. So a test marks its environment (the `deployment_mark` fixture) and looks for processes that
carry its mark, not for every Flower process on the machine: tests running side by side (pytest-xdist) or another
user's Flower then do not count as this test's leftovers."""

from __future__ import annotations

import os
from pathlib import Path

MARK = "PFLBED_TEST_DEPLOYMENT"
NAMES = (b"flower-superlink", b"flower-supernode", b"flower-superexec", b"flwr-serverapp", b"flwr-clientapp",
         b"pflbed.flower.node_worker")


def marked_processes(mark: str) -> dict[int, str]:
    """{pid: command line} of the Flower processes alive on this machine whose environment holds `MARK=mark`."""
    found, wanted = {}, f"{MARK}={mark}".encode()
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{d}/cmdline").read_bytes()
            if any(n in cmd for n in NAMES) and wanted in Path(f"/proc/{d}/environ").read_bytes().split(b"\0"):
                found[int(d)] = cmd.replace(b"\0", b" ").decode()
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found
