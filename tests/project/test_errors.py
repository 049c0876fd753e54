"""What a diverged run tells the user (where its metrics and last good state are) and that the error survives the
trip between processes (`procs` workers and `bench --jobs` raise it in a child and re-raise it in the parent)."""

from __future__ import annotations

import pickle

import pytest

from pflbed.errors import LR_HINT, DivergedError


@pytest.mark.parametrize(("args", "tail"), [
    ((), ""),
    (("runs/a",), "; no evaluation was logged yet"),
    (("runs/a", None, 0), "; no evaluation was logged yet"),
    (("runs/a", None, 4), "; metrics up to round 4 are in runs/a/metrics.jsonl"),
    (("runs/a", 3, 4), "; metrics up to round 4 are in runs/a/metrics.jsonl, the last good state (round 3) in "
                       "runs/a/checkpoints/last.pt"),
    (("runs/a", 3), "; no evaluation was logged yet, the last good state (round 3) in runs/a/checkpoints/last.pt"),
])  # fmt: skip
def test_a_divergence_names_its_round_its_cause_and_what_the_run_kept(args, tail):
    """Round 0 evaluated is no evaluation (the first is logged after round 1); a checkpoint round 0 is none."""
    exc = DivergedError(5, "the loss of client 2 is nan", *args)
    assert str(exc) == f"diverged in round 5: the loss of client 2 is nan{tail} — {LR_HINT}"
    assert (exc.round, exc.where, exc.hint, exc.exit_code) == (5, "the loss of client 2 is nan", LR_HINT, 3)


def test_a_divergence_crosses_a_process_boundary_whole():
    exc = DivergedError(2, "a parameter is inf", "runs/b", 1, 2, hint="lower algorithm.lr_head")
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is DivergedError
    assert (str(back), back.round, back.where) == (str(exc), 2, "a parameter is inf")
    assert back.hint == "lower algorithm.lr_head"
