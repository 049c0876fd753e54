"""`PromptGrid`: replies taken soon after they arrive, every reply kept, the timeout kept."""

import time
from types import SimpleNamespace

import pytest

pytest.importorskip("flwr")  # the `flower` extra

from pflbed.flower.prompt_grid import PromptGrid  # noqa: E402


class _Link:
    """A SuperLink's side of a grid: the reply to message k is there `delays[k]` s after the push (None: never)."""

    def __init__(self, delays):
        self.delays, self.pulls = delays, 0

    def push_messages(self, messages):
        self.t0, self.sent = time.monotonic(), list(messages)
        return [f"m{k}" for k in range(len(self.sent))]

    def pull_messages(self, message_ids):
        self.pulls += 1
        now = time.monotonic() - self.t0
        out = []
        for mid in sorted(message_ids):
            delay = self.delays[int(mid[1:])]
            if delay is not None and now >= delay:  # a reply as the grid reads it
                out.append(SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id=mid)))
        return out


def _grid(delays, **kw):
    grid = PromptGrid(None, **kw)
    grid.grid = _Link(delays)
    return grid


def _messages(n):
    return [object() for _ in range(n)]


def test_every_reply_is_taken_within_a_fraction_of_a_second_of_the_last_arrival():
    grid = _grid([0.05, 0.3, 0.6])
    t0 = time.monotonic()
    replies = grid.send_and_receive(_messages(3), timeout=10)
    took = time.monotonic() - t0
    assert sorted(r.metadata.reply_to_message_id for r in replies) == ["m0", "m1", "m2"]  # each once
    assert 0.6 <= took < 1.0, took  # Flower's own loop: 3 s


def test_the_timeout_returns_what_arrived_and_polling_slows_down_while_nothing_does():
    grid = _grid([0.1, None], max_interval=0.5)
    t0 = time.monotonic()
    replies = grid.send_and_receive(_messages(2), timeout=3.0)
    took = time.monotonic() - t0
    assert [r.metadata.reply_to_message_id for r in replies] == ["m0"]
    assert 3.0 <= took < 3.3, took
    assert grid.grid.pulls < 20, grid.grid.pulls  # 50 ms growing to 0.5 s, not every 50 ms (60 pulls)
