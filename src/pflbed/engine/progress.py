"""What a running experiment tells its user: a live display in a terminal, plain lines anywhere else.

In a terminal: one bar for the rounds (the last evaluation's G-FL / P-FL beside it), then one bar per stage after
training (fine-tuning each participated client, personalizing the new clients, artifacts) — so the display never
sits at "N/N rounds, ETA 0:00" while minutes of work remain. With stdout redirected (a log file, a batch
system), a live display would print nothing until the end: instead one line per evaluation and one when each
stage starts and ends, flushed at once.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


def status(record: dict[str, Any]) -> str:
    parts = [f"{name} {100 * record[k]:.1f}" for k, name in (("gfl_acc", "G-FL"), ("pfl_acc", "P-FL")) if record.get(k)]
    return " · ".join(parts)


class RunProgress:
    """`mode`: "live" (a terminal), "lines" (stdout redirected) or "off"."""

    def __init__(self, enabled: bool, title: str, rounds: int, done: int = 0) -> None:
        self.mode = "off" if not enabled else ("live" if sys.stdout.isatty() else "lines")
        self.title, self.rounds, self.t0 = title, rounds, time.perf_counter()
        self.live: Progress | None = None
        if self.mode == "live":
            self.live = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/"
                                 "{task.total}"), TextColumn("{task.fields[status]}"), TimeElapsedColumn(),
                                 TextColumn("ETA"), TimeRemainingColumn())  # fmt: skip
            self.live.start()
            self.task = self.live.add_task(f"{title}: rounds", total=rounds, completed=done, status="")
        elif self.mode == "lines" and done:
            self._line(f"resumed after round {done}/{rounds}")

    def _line(self, text: str) -> None:
        print(f"[{time.perf_counter() - self.t0:7.1f} s] {self.title}: {text}", flush=True)

    def round_done(self, rnd: int, record: dict[str, Any] | None) -> None:
        if self.live is not None:
            self.live.update(self.task, advance=1, **({"status": status(record)} if record else {}))
        elif self.mode == "lines" and record is not None:
            self._line(f"round {rnd}/{self.rounds} evaluated: {status(record) or 'no accuracy'}")

    @contextmanager
    def stage(self, name: str, total: int) -> Iterator[Callable[[], None]]:
        """A stage of `total` steps; yields the function that counts one step."""
        if self.live is not None:
            task = self.live.add_task(f"{self.title}: {name}", total=max(total, 1), status="")
            yield lambda: self.live.update(task, advance=1)  # type: ignore[union-attr]
            self.live.update(task, completed=max(total, 1))
            return
        t = time.perf_counter()
        if self.mode == "lines":
            self._line(f"{name}…")
        yield lambda: None
        if self.mode == "lines":
            self._line(f"{name}: done in {time.perf_counter() - t:.1f} s")

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None

    def __enter__(self) -> RunProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
