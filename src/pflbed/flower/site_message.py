"""What a site takes from the server's messages besides the run's config.

The config is held to the site's policy (`site_policy.check`) and `site-sizes` to what the site holds
(`site_node.site_sizes`). Every other field of a message is the server's choice as well, and a site takes it only as
an honest server sends it (`flower.executor`, `flower.site_executor`, `flower.secagg`), within the run it accepted:

- records: none in the partition question; `config`, and a TRAIN message's payload of each of its clients
  (`payload/<cid>`; under SecAgg+, the one shared payload), an EVALUATE message's `server` view; nothing else. A
  state sent for a client (`state/<cid>`, which a node without data of its own takes in place of its stored one)
  would replace the client's personal model, the site's own, with one of the server's choosing;
- the config record: exactly the fields of the message's kind (a QUERY's: the config alone);
- `cids`: distinct clients of this site's own;
- `round`: a TRAIN message's, one of the run's rounds (1 to `train.rounds`: a negative one failed only after
  training); an EVALUATE message's, whether to score the round's models (true or false);
- `versions`: per client, the round of a state it may have stored: 0 (its initial state) up to the round before a
  TRAIN message's, or up to `train.rounds` for an EVALUATE message;
- `methods`: final personalizations that the run's config names (`eval.finetune`, as the algorithm offers them:
  `finetune_methods`), each at its index and at most once. A server could otherwise ask for any number of
  fine-tunings in one message, or for one the run does not name;
- each client's payload: what the algorithm's server sends that client in that round (`payload_fits`: keys,
  shapes, dtypes, and the few values that are instructions), every float entry finite. A payload naming the
  client's personal entries would otherwise make some updates send them back trained (GPFL's personal
  head) or train from the server's choice of them (LG-FedAvg's representation); one of another shape failed
  inside the update.
- the server view: what the algorithm's server sends a site holding the message's clients (`view_fits`: keys,
  shapes, dtypes), every float entry finite. One of another shape failed inside the evaluation.

Each refusal is one line naming the field (`SiteError`), raised before the site reads a payload or a state; a
payload's, before its client trains on it (`check_payload`); a view's, before the site evaluates (`check_view`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from flwr.app import RecordDict
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

from pflbed.algorithms.base import Algorithm, Tensors
from pflbed.engine.guard import first_nonfinite
from pflbed.flower.secagg_node import SHARED
from pflbed.flower.sites import SiteError, own_clients

FIELDS = {  # a message's kind → its config record's fields
    "QUERY": ("pflbed-config",),  # the start-up question (the partition question holds no record at all)
    "TRAIN": ("pflbed-config", "round", "cids", "site-sizes", "versions"),
    "EVALUATE": ("pflbed-config", "round", "cids", "site-sizes", "versions", "methods"),
}


def _int(value: object) -> bool:
    return type(value) is int


def config_record(content: RecordDict, kind: str) -> Any:
    """A `kind` message's config record, holding exactly its fields (read first: it names the run's config)."""
    if "config" not in content.config_records:
        raise SiteError(f"the server's {kind} message holds no config")
    conf, fields = content.config_records["config"], FIELDS[kind]
    wrong = sorted(set(conf) ^ set(fields))
    if wrong:
        raise SiteError(f"the server's {kind} message {'lacks' if wrong[0] in fields else 'sets'} {wrong[0]!r:.60} "
                        f"in its config: it sends {', '.join(fields)}")  # fmt: skip
    return conf


def _records(content: RecordDict, kind: str, needed: set[str], allowed: frozenset[str] = frozenset()) -> None:
    """A message holds its config, every one of `needed` and no record but those and `allowed`."""
    got = set(content.array_records) | set(content.config_records) | set(content.metric_records)
    extra = sorted(got - needed - allowed - {"config"})
    if extra:
        raise SiteError(f"the server's {kind} message holds a record {extra[0]!r:.60}, which a site does not take")
    missing = sorted(needed - set(content.array_records))
    if missing:
        raise SiteError(f"the server's {kind} message holds no {missing[0]!r}")


def check_clients(kind: str, algo: Algorithm, cids: object, versions: object, newest: int
                  ) -> tuple[list[int], dict[int, int]]:  # fmt: skip
    """A message's clients, distinct and this site's own, and each one's state round (0 to `newest`)."""
    if not isinstance(cids, list) or not all(map(_int, cids)) or len(set(cids)) != len(cids):
        raise SiteError(f"the server's {kind} message: cids {cids!r:.60} are not distinct client ids")
    foreign = sorted(set(cids) - set(own_clients(algo)))
    if foreign:
        raise SiteError(f"the server asked this site for clients {foreign[:5]}, which it does not hold")
    if not isinstance(versions, list) or len(versions) != len(cids) or \
            not all(_int(v) and 0 <= v <= newest for v in versions):  # fmt: skip
        raise SiteError(f"the server's {kind} message: versions {versions!r:.60} are not, per client, a round "
                        f"from 0 to {newest}")  # fmt: skip
    return cids, dict(zip(cids, versions, strict=True))


def check_query(content: RecordDict, with_config: bool) -> None:
    """A site's two queries (`client.SITE_QUERIES`): the partition question holds no record, the start-up question
    its config record alone, holding the run's config alone."""
    if with_config:
        config_record(content, "QUERY")
    _records(content, "QUERY", set())


def train_fields(content: RecordDict, algo: Algorithm, secure: bool) -> tuple[int, list[int], dict[int, int]]:
    """A TRAIN message's round, clients and their state rounds (`secure`: SecAgg+'s masked-update step)."""
    conf = config_record(content, "TRAIN")
    rounds = algo.ctx.cfg.train.rounds
    rnd = conf["round"]
    if not _int(rnd) or not 1 <= rnd <= rounds:
        raise SiteError(f"the server's TRAIN message: round {rnd!r:.60} is not one of the run's (1 to {rounds})")
    cids, versions = check_clients("TRAIN", algo, conf["cids"], conf["versions"], rnd - 1)
    if secure:  # SecAgg+'s own record, its stage's parameters, is its mod's to check (`secagg_node`)
        _records(content, "TRAIN", {SHARED}, frozenset({RECORD_KEY_CONFIGS}))
    else:
        _records(content, "TRAIN", {f"payload/{c}" for c in cids})
    return rnd, cids, versions


def check_payload(algo: Algorithm, rnd: int, cid: int, payload: Tensors, state: Tensors) -> None:
    """Client `cid`'s payload of round `rnd` (`state`: the client's, as the site holds it) as the algorithm's
    server sends it (`Algorithm.payload_fits`), and finite: an honest server's state is (its divergence guard,
    `engine.guard.check_server`, stops a run whose state is not)."""
    _refuse(algo.payload_fits(rnd, cid, payload, state), payload, f"TRAIN message: the payload of client {cid}")


def check_view(algo: Algorithm, view: Tensors, cids: list[int]) -> None:
    """An EVALUATE message's server view as the algorithm's server sends a site holding clients `cids`
    (`Algorithm.view_fits`), and finite, as `check_payload`."""
    _refuse(algo.view_fits(view, cids), view, "EVALUATE message: its server view")


def _refuse(why: str | None, tensors: Tensors, what: str) -> None:
    """Refuse `what` (the message's tensors `tensors`) for `why`, the algorithm's verdict on their structure, or
    where that is None for their first non-finite entry (the structure is said first)."""
    bad = first_nonfinite(tensors) if why is None else None
    if bad is not None:
        why = f"has a non-finite entry in '{bad}'"
    if why is not None:
        raise SiteError(f"the server's {what} {why}")


def evaluate_fields(content: RecordDict, algo: Algorithm, server: Callable[[], Tensors]
                    ) -> tuple[list[int], dict[int, int], bool, list[tuple[int, str]]]:  # fmt: skip
    """An EVALUATE message's clients, their state rounds, whether to score the round, and the personalizations
    asked for (`server`: the message's server view, read once its clients are checked, and held to `check_view`
    before anything else reads it)."""
    conf = config_record(content, "EVALUATE")
    _records(content, "EVALUATE", {"server"})
    cids, versions = check_clients("EVALUATE", algo, conf["cids"], conf["versions"], algo.ctx.cfg.train.rounds)
    check_view(algo, server(), cids)
    figures = conf["round"]
    if type(figures) is not bool:
        raise SiteError(f"the server's EVALUATE message: round {figures!r:.60} is not true or false")
    try:
        asked = json.loads(str(conf["methods"]))
    except (ValueError, RecursionError):
        asked = None
    pairs = [(p[0], p[1]) for p in asked if isinstance(p, list) and len(p) == 2 and _int(p[0]) and
             isinstance(p[1], str)] if isinstance(asked, list) else []  # fmt: skip
    if not isinstance(asked, list) or len(pairs) != len(asked) or len(set(pairs)) != len(pairs):
        raise SiteError(f"the server's EVALUATE message: methods {str(conf['methods'])!r:.60} are not distinct "
                        "[index, name] pairs")  # fmt: skip
    offered = set(enumerate(algo.finetune_methods(server(), list(algo.ctx.cfg.eval.finetune)))) if pairs else set()
    if not set(pairs) <= offered:
        raise SiteError(f"the server's EVALUATE message: methods {str(conf['methods'])!r:.60} ask for more than the "
                        f"run's personalizations {sorted(offered)}")  # fmt: skip
    return cids, versions, figures, pairs
