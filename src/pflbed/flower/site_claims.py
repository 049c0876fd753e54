"""Which node serves each site of a site-local deployment (`sites.local`), and what a site may claim of itself.

Every node says which site (partition) it serves, and a node can say anything: without a binding, the last node
to claim site k would get site k's messages — its clients' work, the server state sent to evaluate them. So the
server binds each site to the node that answered for it at start-up (`Claims`), with what it reported then: its
clients' training-sample counts, which are their weights in the server's means (`check_counts`: positive
integers, at most `sites.max_client_samples`, at most `federation.clients` clients), and, where the site presents
one, a secret token (`site_token`), of which the server keeps only a SHA-256 hash.

A later claim of site k by another node (a site restarts under a new node id) is accepted only with the same
report and, where the site presented a token at start-up, the same token; a site that presented none can be
claimed again only once its node has left the grid. Anything else is refused with one line (`reply_check.refuse`)
and the site keeps its node.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path
from typing import Any

from pflbed.config import Config
from pflbed.private_files import private_dir

TOKEN = "token"  # the key of a site's start-up report that carries its token
TOKEN_FILE = "site-token"


def site_token(state_dir: str | Path) -> str:
    """The site's token (a node's side): made once, at random, and kept in its state directory, readable by its
    owner only (0600), so that the site restarted under a new node id presents the same one."""
    path = Path(state_dir) / TOKEN_FILE
    private_dir(path.parent)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_text().strip()
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return path.read_text().strip()


def token_hash(token: Any) -> str | None:
    """SHA-256 of a token as the server keeps it; None for no token (or one that is not a string)."""
    return hashlib.sha256(token.encode()).hexdigest() if isinstance(token, str) and token else None


def declared_eval(cfg: Config, site: int, info: dict[str, Any]) -> list[int] | None:
    """[test, val] samples of the site's clients, where its report declares them (`num_test`, `num_val`: one count
    per client): what its evaluations must count (`site_eval.check_scores`). `ValueError` for a declaration out of
    bounds."""
    if "num_test" not in info and "num_val" not in info:
        return None
    out = []
    for key in ("num_test", "num_val"):
        v = info.get(key)
        if not isinstance(v, list) or len(v) != len(info["num_train"]) or \
                any(isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= cfg.sites.max_client_samples
                    for n in v):  # fmt: skip
            raise ValueError(f"site {site}: {key}={str(v)[:60]}; one count per client, from 0 to "
                             f"sites.max_client_samples={cfg.sites.max_client_samples}")  # fmt: skip
        out.append(sum(v))
    return out


def check_counts(cfg: Config, site: int, counts: Any) -> str | None:
    """Why a site's clients' training-sample counts are refused; None if they are not. Counts weight the server's
    means: a huge one makes the mean the site's reply, a zero or negative one turns it into an extrapolation."""
    bound = cfg.sites.max_client_samples
    if not isinstance(counts, list) or not counts:
        return f"site {site}: num_train must be a non-empty list of its clients' training-sample counts"
    if len(counts) > cfg.federation.clients:
        return f"site {site}: it reports {len(counts)} clients, more than federation.clients={cfg.federation.clients}"
    for i, n in enumerate(counts):
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= bound:
            return (f"site {site}: num_train[{i}]={n!r}; a count is an integer from 1 to sites.max_client_samples="
                    f"{bound}")  # fmt: skip
    return None


class Claims:
    """Site → its node, its start-up counts and its token's hash."""

    def __init__(self) -> None:
        self.node: dict[int, int] = {}
        self.counts: dict[int, list[int]] = {}
        self.token: dict[int, str | None] = {}
        self.eval: dict[int, list[int] | None] = {}  # [test, val] samples declared at start-up (`declared_eval`)
        self.asked: set[int] = set()  # every node asked which site it serves (a refused one is not asked again)

    def counts_list(self) -> list[list[int]]:
        """Every site's clients' training-sample counts, in site order."""
        return [self.counts[k] for k in sorted(self.counts)]

    def claim(self, site: int, node: int, info: dict[str, Any], evals: list[int] | None, connected: set[int]
              ) -> str | None:  # fmt: skip
        """Bind `site` to `node` (the first claim), or move it to `node` (a restarted site); why not, where it is
        refused. `info`: the node's report, its counts checked (`check_counts`); `evals`: its `declared_eval`;
        `connected`: the nodes on the grid now."""
        counts, token = info["num_train"], info.get(TOKEN)
        if site not in self.node:
            self.node[site], self.counts[site], self.token[site] = node, list(counts), token_hash(token)
            self.eval[site] = evals
            return None
        if node == self.node[site]:
            return None
        held = self.token[site]
        if held is not None and token_hash(token) != held:
            return f"site {site}: node {node} claims it without the token it presented at start-up"
        if held is None and self.node[site] in connected:
            return f"site {site}: node {node} claims it while node {self.node[site]} serves it"
        if list(counts) != self.counts[site]:
            return (f"site {site}: node {node} reports training-sample counts {counts[:5]}, not those of start-up "
                    f"{self.counts[site][:5]}")  # fmt: skip
        if evals != self.eval[site]:
            return f"site {site}: node {node} declares {evals} test and val samples, not those of start-up"
        self.node[site] = node
        return None
