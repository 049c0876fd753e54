"""A modified ClientApp: pflbed's own (`pflbed.flower.client.app`) on every node, except that a node whose node config
says `attack=...` rewrites what it answers, as a site running other code could.

A FAB has one ClientApp for every node, so the attack is chosen per node, by its node config — the one thing that
differs between the nodes of a deployment:
- `attack="replies"` (6. and 7. of issue 48): its client's reply to round r's work is the honest one rewritten by
  `REPLIES[r]` — ×10³⁰ (finite), a bias of another shape, a key dropped, a key added, an entry as int64 — and its
  figures in the final evaluation (the one that also asks for the +FT/+LP stages: `methods`) give its client a
  test accuracy of 7.5, its earlier evaluations being honest;
- `attack="counts"` (5.): its answer to the start-up question reports `num_train` = the node config's `claim` (a
  client's weight in the server's means: huge, zero or negative);
- no `attack`: the honest node, unchanged — also a node whose node config claims another site's partition (8.),
  which is pflbed's ClientApp run by someone who does not hold that site.
Every rewrite starts from the honest answer, so that what the server refuses is the rewrite and nothing else.
"""

from __future__ import annotations

import json

from flwr.app import ConfigRecord, Context, Message
from flwr.clientapp import ClientApp

from pflbed.flower import node_app as honest

app = ClientApp()


def _huge(reply: dict) -> dict:
    return {k: v * 1e30 for k, v in reply.items()}


def _wide_bias(reply: dict) -> dict:
    return {k: v.expand(2, *v.shape).clone() if v.dim() == 1 else v for k, v in reply.items()}


def _dropped(reply: dict) -> dict:
    return dict(sorted(reply.items())[1:])


def _extra(reply: dict) -> dict:
    import torch

    return {**reply, "extra": torch.zeros(3)}


def _int64(reply: dict) -> dict:
    return {k: v.long() if i == 0 else v for i, (k, v) in enumerate(sorted(reply.items()))}


REPLIES = {1: _huge, 2: _wide_bias, 3: _dropped, 4: _extra, 5: _int64}  # round → the rewrite of that round's reply


def _attack(context: Context) -> str | None:
    return context.node_config.get("attack")  # type: ignore[return-value]


@app.train()
def train(msg: Message, context: Context) -> Message:
    reply = honest.app(msg, context)
    conf = msg.content["config"]
    rewrite = REPLIES.get(int(conf["round"]))
    if _attack(context) == "replies" and rewrite is not None and not reply.has_error():
        from pflbed.flower.records import from_record, to_record

        for cid in conf["cids"]:
            reply.content[f"reply/{cid}"] = to_record(rewrite(from_record(reply.content[f"reply/{cid}"])))
    return reply


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    reply = honest.app(msg, context)
    final = bool(json.loads(str(msg.content["config"]["methods"])))
    if _attack(context) == "replies" and final and not reply.has_error():
        scores = json.loads(str(reply.content["scores"]["json"]))
        for figures in scores.values():
            figures["test"] = dict.fromkeys(figures["test"], 7.5)
        reply.content["scores"] = ConfigRecord({"json": json.dumps(scores)})
    return reply


@app.query()
def query(msg: Message, context: Context) -> Message:
    reply = honest.app(msg, context)
    if _attack(context) == "counts" and msg.metadata.group_id == "site" and not reply.has_error():
        report = json.loads(str(reply.content["site"]["report"]))
        report["num_train"] = [context.node_config["claim"]] * len(report["num_train"])
        reply.content["site"] = ConfigRecord({"report": json.dumps(report)})
    return reply
