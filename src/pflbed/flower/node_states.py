"""Client states kept on the SuperNode, on disk (`executor.state_dir`): a node that restarts continues its clients.

Flower's own per-client state (`context.state`) lives in the SuperNode's memory and is gone when the node
restarts. With `executor.state_dir` set, a node keeps each of its clients' states in files instead, and the states
do not travel with the round's messages: the server sends, per client, the round of the state it expects (the
round of the last reply it accepted, 0 for none yet), and the node reads that version, trains, and writes the new
one. The server reads states from the nodes only when it needs them (evaluation, diagnostics, checkpoints).

Layout: `<state dir>/<run key>/client-<cid>/round-<r>.pt`, where the run key is a hash of the run's config (two
runs never read each other's states) and the state directory is the node's `state-dir` node config, or else
`executor.state_dir` (relative paths are relative to the node's working directory). A node keeps at most two
versions of a client: the one the server expects, and the one it just wrote. The older one is needed when the
server drops the new one (its reply came after the round timeout): the server then still expects the older one.
Writes go to a new private file (0600, created with `O_EXCL` under a random name, in 0700 directories:
`private_files`) renamed into place, so no other local user can read a state, and a node killed mid-write leaves
the previous version intact.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from pflbed.algorithms.base import Algorithm, Tensors
from pflbed.private_files import private_dir, save_private

NODE_CONFIG_KEY = "state-dir"


class MissingStateError(RuntimeError):
    """The state version the server expects is not on the node (its state directory was lost or is another)."""


class NodeStates:
    def __init__(self, root: str | Path, config_json: str, algo: Algorithm) -> None:
        self.dir = Path(root) / hashlib.sha256(config_json.encode()).hexdigest()[:16]
        self.algo = algo

    def _path(self, cid: int, rnd: int) -> Path:
        return self.dir / f"client-{cid}" / f"round-{rnd}.pt"

    def load(self, cid: int, rnd: int) -> Tensors:
        """Client `cid`'s state as of round `rnd` (0: `init_client`'s, never written)."""
        if rnd == 0:
            return self.algo.init_client(cid)
        path = self._path(cid, rnd)
        if not path.is_file():
            raise MissingStateError(f"client {cid}'s state of round {rnd} is not in this node's state directory "
                                    "(was it lost or changed?)")  # fmt: skip  # no path: the server reads the line
        return torch.load(path, map_location=self.algo.ctx.device, weights_only=True)

    def save(self, cid: int, rnd: int, state: Tensors, keep: int) -> None:
        """Write client `cid`'s state of round `rnd`; delete its versions other than `rnd` and `keep`."""
        path = self._path(cid, rnd)
        private_dir(path.parent)
        save_private({k: v.detach().cpu().clone() for k, v in state.items()}, path)  # clone: no shared storage
        for old in path.parent.glob("round-*.pt"):
            if old.name not in (path.name, f"round-{keep}.pt"):
                old.unlink(missing_ok=True)
