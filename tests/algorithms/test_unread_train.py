"""`Algorithm.unread_train`: the `train.*` keys an algorithm's run never reads, which `pflbed tune` leaves out of its
search. Each declaration is checked both ways by running it: a key declared unread changes nothing, bit for bit; a
key not declared changes the run. So a declaration that forgets a key its algorithm ignores (a dead dimension of its
search) and one that names a key its algorithm reads (a knob the search would never turn) both go red."""

from __future__ import annotations

import pytest

import pflbed
from pflbed.algorithms import ALGORITHMS

from ..tiny import figures, parity_config, same_tensors

# a changed value of each key an algorithm may leave unread (`TrainConfig`'s: lr 0.1, one epoch, no momentum or decay)
CHANGED = {"lr": 0.05, "local_epochs": 2, "momentum": 0.5, "weight_decay": 0.01}
# options that change what the update reads: pFedHN's K steps replace the epochs, which `local_steps: null` runs
VARIANTS = {"pfedhn+epochs": ("pfedhn", {"local_steps": None})}
# one round trains every algorithm as its later rounds do, but FedBasis's first is a FedAvg warm-up (K = 2 bases from
# the 3 clients of that round); its second combines its bases
ROUNDS = {"fedbasis": 2}
OPTIONS = {"fedbasis": {"K": 2}}


def _run(name: str, options: dict, **train):
    cfg = parity_config(name, {"threads": 1}, evaluation={"every": 100}, rounds=ROUNDS.get(name, 1), **train)
    cfg = cfg.model_dump(mode="json")
    cfg["algorithm"].update({**OPTIONS.get(name, {}), **options})
    return pflbed.run(cfg, write=False, progress=False)


def _same(a, b) -> bool:
    """The same run: server state, every client's state and every figure of the summary."""
    return (same_tensors(a.server, b.server) and a.executor.states.keys() == b.executor.states.keys()
            and all(same_tensors(a.executor.states[c], b.executor.states[c]) for c in a.executor.states)
            and figures(a.summary) == figures(b.summary))  # fmt: skip


@pytest.mark.parametrize("case", sorted(n for n in ALGORITHMS if not n.startswith("toy-")) + sorted(VARIANTS))
def test_a_key_declared_unread_changes_nothing_and_every_other_key_changes_the_run(case):
    name, options = VARIANTS.get(case, (case, {}))
    cls = ALGORITHMS[name]
    unread = cls.unread_train(cls.Config.model_validate(options))
    assert unread <= set(CHANGED), unread
    reference = _run(name, options)
    same = {key for key, value in CHANGED.items() if _same(_run(name, options, **{key: value}), reference)}
    assert same == unread
