"""A modified ServerApp: a server that, instead of running the experiment, sends honest sites (pflbed's own
ClientApp) the messages a malicious server could send, and writes what each site answered.

Its run config is pflbed's (`config`: the run's honest site-local config, `out`: the run directory), plus
`attacks`: a JSON object naming what the attempts need — `secret` (a file in site 0's state directory), `missing`
(a path next to it that does not exist) and `sizes` (the sites' true `site-sizes`, so that a round's work is
refused for its config alone). Each attempt is one message to one site; the site's answer is recorded as
Flower returns it (`<out>/attempts.json`: name → {"site", "replied", "error" (its code, or None for an answer),
"reason"}), for the test to judge. Nothing here decides whether an attempt failed: a site that answered would show
as an answer.

The attempts (numbered as in issue 48), all with the run's config tampered as a server that skips pflbed's
validation would:
1. read a site's file: `sites.local=false` and `model.init_from` naming site 0's `secret`, then `missing`, asked
   as the node-state query (`states`, the way a non-site node hands back its clients' states) and as a round's
   work (TRAIN) — a site must answer the two alike, or it tells the server which of its files exist — and a
   round's `site-sizes` other than what site 0 holds;
2. choose what a site may not let it choose: keys off the site's allow-list (`executor.state_dir`, `dataset.path`)
   and sizes beyond its bounds (FedBasis's K, `train.local_epochs`, `sites.input_shape`), asked as the start-up
   question (`site`);
4. run without the privacy a site requires in its node config: site 1 (`max-epsilon`) is asked the start-up
   question with the honest config, which has no DP, and site 2 (`require-secagg`) is sent a round's work without
   SecAgg.
The partition question every server asks first is the control: the sites answer it (`partitions`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp

app = ServerApp()

PARTITION = "partition-id"


def _tampered(config: dict, **keys) -> str:
    """The config JSON with dotted `keys` (`model__init_from`) set, unvalidated."""
    tree = json.loads(json.dumps(config))
    for dotted, value in keys.items():
        *sections, last = dotted.split("__")
        node = tree
        for s in sections:
            node = node.setdefault(s, {})
        node[last] = value
    return json.dumps(tree, sort_keys=True)


def _sites(grid: Grid, count: int) -> dict[int, int]:
    """Site (partition) → node id, once `count` nodes are connected and have said which site they serve."""
    deadline = time.monotonic() + 120
    while len(nodes := list(grid.get_node_ids())) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(nodes)} of {count} SuperNodes connected")
        time.sleep(0.2)
    asks = [Message(RecordDict({}), dst_node_id=n, message_type=MessageType.QUERY, group_id="partitions")
            for n in nodes]  # fmt: skip
    replies = list(grid.send_and_receive(asks, timeout=120))
    for r in replies:
        if not r.has_content():  # the control failed: nothing after it would mean anything
            raise RuntimeError(f"node {r.metadata.src_node_id} did not answer the partition question: "
                               f"{r.error.reason if r.has_error() else 'no reply'}")  # fmt: skip
    node_of = {int(r.content["node"][PARTITION]): r.metadata.src_node_id for r in replies}
    if sorted(node_of) != list(range(count)):
        raise RuntimeError(f"the SuperNodes serve sites {sorted(node_of)}, not 0…{count - 1}")
    return node_of


@app.main()
def main(grid: Grid, context: Context) -> None:
    config = json.loads(str(context.run_config["config"]))
    out = Path(str(context.run_config["out"]))
    paths = json.loads(str(context.run_config["attacks"]))
    node_of = _sites(grid, int(config["federation"]["clients"]))
    honest = json.dumps(config, sort_keys=True)
    wrong_sizes = json.dumps([[1]] * len(node_of))  # as many clients as the sites hold, not their sample counts

    def query(group: str, conf: str) -> RecordDict:
        extra = {"cids": [0], "versions": [1]} if group == "states" else {}
        return RecordDict({"config": ConfigRecord({"pflbed-config": conf, **extra})})

    def train(conf: str, site_sizes: str = paths["sizes"]) -> RecordDict:
        return RecordDict({"config": ConfigRecord({"pflbed-config": conf, "round": 1, "cids": [0], "versions": [0],
                                                   "site-sizes": site_sizes})})  # fmt: skip

    attempts: list[tuple[str, int, MessageType, str, RecordDict]] = []
    for which in ("secret", "missing"):  # 1: a site's own file, then one that is not there
        read = _tampered(config, sites__local=False, model__init_from=paths[which])
        attempts += [(f"states query, init_from {which}", 0, MessageType.QUERY, "states", query("states", read)),
                     (f"train, init_from {which}", 0, MessageType.TRAIN, "1", train(read))]  # fmt: skip
    attempts.append(("train, site-sizes", 0, MessageType.TRAIN, "1", train(honest, wrong_sizes)))
    for site, name, keys in (  # 2: off the allow-list, beyond the bounds (checked before a site's requirements)
        (1, "algorithm.K", {"algorithm": {"name": "fedbasis", "K": 10**9}}),
        (1, "train.local_epochs", {"train__local_epochs": 10**5}),
        (1, "sites.input_shape", {"sites__input_shape": [3, 100_000, 100_000]}),
        (2, "executor.state_dir", {"executor__state_dir": paths["missing"]}),
        (2, "dataset.path", {"dataset__path": str(Path(paths["secret"]).parent)}),
    ):
        asked = query("site", _tampered(config, **keys))
        attempts.append((f"site query, {name}", site, MessageType.QUERY, "site", asked))
    attempts += [  # 4: the privacy a site requires, missing from the run
        ("site query, no DP", 1, MessageType.QUERY, "site", query("site", honest)),
        ("train, no SecAgg", 2, MessageType.TRAIN, "1", train(honest)),
    ]
    # all at once: a node answers its messages one after another, each in a ClientApp process of its own (seconds
    # to start), but the three nodes then work side by side
    msgs = [Message(content, dst_node_id=node_of[site], message_type=kind, group_id=group)
            for _, site, kind, group, content in attempts]  # fmt: skip
    t0 = time.monotonic()
    replies = {r.metadata.reply_to_message_id: r for r in grid.send_and_receive(msgs, timeout=300)}
    results: dict[str, dict] = {}
    for (name, site, *_), msg in zip(attempts, msgs, strict=True):
        reply = replies.get(msg.metadata.message_id)
        error = reply.error if reply is not None and reply.has_error() else None
        results[name] = {"site": site, "replied": reply is not None,
                         "error": None if error is None else int(error.code),
                         "reason": None if error is None else error.reason}  # fmt: skip
    results["seconds"] = round(time.monotonic() - t0, 1)
    results["partitions"] = {"sites": sorted(node_of)}  # the question every server asks: answered
    out.mkdir(parents=True, exist_ok=True)
    (out / "attempts.json").write_text(json.dumps(results, indent=1) + "\n")
