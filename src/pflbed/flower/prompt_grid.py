"""A deployment's grid that collects replies as they arrive, not on Flower's fixed 3-second beat.

Flower's `send_and_receive` on a deployment pulls the replies every 3 s, so every exchange of a round (the work,
the evaluation, each question to the sites) waits 1.5 s on average after its last reply arrived, and a short
round is mostly this wait. `PromptGrid` pulls after 50 ms, then less and less often (×1.25 per empty pull, at most
every `max_interval` s): a reply is taken within a few tens of milliseconds while a round is short, and a long
round costs the SuperLink one pull a second. The messages, their order and the timeout are Flower's; Flower's
own workflows (SecAgg+) use this grid too, since they receive it from the ServerApp.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from flwr.app import Message, RecordDict
from flwr.serverapp import Grid


class PromptGrid(Grid):
    """`grid` with a `send_and_receive` that polls for replies at a growing interval (see the module)."""

    def __init__(self, grid: Grid, first_interval: float = 0.05, max_interval: float = 1.0) -> None:
        self.grid, self.first_interval, self.max_interval = grid, first_interval, max_interval

    def set_run(self, run) -> None:  # noqa: ANN001 (flwr's Run)
        self.grid.set_run(run)

    @property
    def run(self):  # noqa: ANN201
        return self.grid.run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:  # fmt: skip
        return self.grid.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:
        return self.grid.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self.grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self.grid.pull_messages(message_ids)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        """Push `messages`, then pull their replies until all are in or `timeout` s have passed (None: no limit)."""
        waiting = set(self.push_messages(messages))
        end = None if timeout is None else time.monotonic() + timeout
        replies: list[Message] = []
        interval = self.first_interval
        while waiting:
            got = list(self.pull_messages(waiting))
            replies.extend(got)
            waiting -= {m.metadata.reply_to_message_id for m in got}
            if not waiting or (end is not None and time.monotonic() >= end):
                break
            interval = self.first_interval if got else min(interval * 1.25, self.max_interval)
            time.sleep(interval if end is None else max(0.0, min(interval, end - time.monotonic())))
        return replies
