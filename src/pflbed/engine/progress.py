"""What a running experiment tells its user: a live display in a terminal, plain lines anywhere else.

In a terminal: one bar for the rounds (the last evaluation's G-FL / P-FL beside it), then one bar per stage after
training (fine-tuning each participated client, personalizing the new clients, artifacts) — so the display never
sits at "N/N rounds, ETA 0:00" while minutes of work remain. With stdout redirected (a log file, a batch
system), a live display would print nothing until the end: instead a line at start-up, one per evaluation, one
when each stage starts and ends, and in between a line with the round (or the stage's step) and the time left
whenever `interval_s()` (default 30 s, `PFLBED_PROGRESS_INTERVAL`) has passed since the last line — at most one per
round or step, so fast runs are not flooded and slow ones never look hung. Every line is flushed at once.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from pflbed.errors import PflbedError

INTERVAL_ENV = "PFLBED_PROGRESS_INTERVAL"
DEFAULT_INTERVAL_S = 30.0


def interval_s() -> float:
    """Seconds between two progress lines when nothing else is printed; read at each run's start, so a test or a
    batch script can set the variable without reloading anything."""
    text = os.environ.get(INTERVAL_ENV, "")
    if not text.strip():
        return DEFAULT_INTERVAL_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise PflbedError(f"{INTERVAL_ENV}={text!r}: expected a number of seconds >= 0 (default 30)")
    return value


def status(record: dict[str, Any]) -> str:
    """An evaluation's accuracies as shown beside the rounds ("G-FL 25.0 · P-FL 50.0"); one that was not measured
    (None or absent) is left out, an accuracy of 0 is shown."""
    parts = [f"{name} {100 * record[k]:.1f}" for k, name in (("gfl_acc", "G-FL"), ("pfl_acc", "P-FL"))
             if record.get(k) is not None]  # fmt: skip
    return " · ".join(parts)


def clock_text(seconds: float) -> str:
    """h:mm:ss, as rich's bars show elapsed and remaining time."""
    s = max(0, round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def plain_lines(enabled: bool) -> bool:
    """Whether progress goes out as plain lines (stdout is not a terminal)."""
    return enabled and not sys.stdout.isatty()


def announce(enabled: bool, text: str) -> None:
    """A start-up line, before anything slow (loading the data, starting processes), where the output is plain
    lines: a log must show at once that the run started. A terminal gets its bar a moment later."""
    if plain_lines(enabled):
        print(text, flush=True)


class RunProgress:
    """`mode`: "live" (a terminal), "lines" (stdout redirected) or "off".

    `t0`: when the command started (`clock`'s time), the origin of the lines' timestamps; `clock` and `interval`
    are there for tests (default: `time.perf_counter`, `interval_s()`)."""

    def __init__(self, enabled: bool, title: str, rounds: int, done: int = 0, *, t0: float | None = None,
                 clock: Callable[[], float] = time.perf_counter, interval: float | None = None) -> None:  # fmt: skip
        self.mode = "off" if not enabled else ("live" if sys.stdout.isatty() else "lines")
        self.clock = clock
        self.interval = interval_s() if (interval is None and self.mode == "lines") else (interval or 0.0)
        self.title, self.rounds = title, rounds
        self.t_rounds = clock()  # rounds' pace: from the first round this process ran
        self.t0 = self.t_rounds if t0 is None else t0
        self.last = self.t_rounds  # when the last line was printed
        self.done0 = self.done = done
        self.live: Progress | None = None
        if self.mode == "live":
            # the run's title and the status as written: brackets in them are text, not rich markup
            self.live = Progress(TextColumn("{task.description}", markup=False), BarColumn(),
                                 TextColumn("{task.completed}/{task.total}"),
                                 TextColumn("{task.fields[status]}", markup=False), TimeElapsedColumn(),
                                 TextColumn("ETA"), TimeRemainingColumn())  # fmt: skip
            self.live.start()
            self.task = self.live.add_task(f"{title}: rounds", total=rounds, completed=done, status="")
        elif self.mode == "lines" and done:
            self._line(f"resumed after round {done}/{rounds}")

    def _line(self, text: str) -> None:
        now = self.clock()
        self.last = now
        print(f"[{now - self.t0:7.1f} s] {self.title}: {text}", flush=True)

    def _due(self) -> bool:
        return self.clock() - self.last >= self.interval

    def _eta(self, done: int, total: int, since: float) -> str:
        """", ETA h:mm:ss" from the pace of the `done` steps (of `total`) taken since `since`."""
        if done <= 0:
            return ""
        return f", ETA {clock_text((self.clock() - since) / done * (total - done))}"

    def round_done(self, rnd: int, record: dict[str, Any] | None) -> None:
        """Round `rnd` finished (the rounds before it too); `record`: its evaluation, if it had one."""
        self.done = max(self.done, rnd)
        if self.live is not None:
            self.live.update(self.task, completed=self.done, **({"status": status(record)} if record else {}))
        elif self.mode == "lines" and record is not None:
            self._line(f"round {rnd}/{self.rounds} evaluated: {status(record) or 'no accuracy'}")
        elif self.mode == "lines" and self._due():
            eta = self._eta(self.done - self.done0, self.rounds - self.done0, self.t_rounds)
            self._line(f"round {self.done}/{self.rounds}{eta}")

    def heartbeat(self, text: str) -> None:
        """`text` (what is going on) as a line, if one is due: for waits that have no steps to count."""
        if self.mode == "lines" and self._due():
            self._line(text)

    @contextmanager
    def stage(self, name: str, total: int) -> Iterator[Callable[[], None]]:
        """A stage of `total` steps; yields the function that counts one step."""
        if self.live is not None:
            task = self.live.add_task(f"{self.title}: {name}", total=max(total, 1), status="")
            yield lambda: self.live.update(task, advance=1)  # type: ignore[union-attr]
            self.live.update(task, completed=max(total, 1))
            return
        if self.mode != "lines":
            yield lambda: None
            return
        t = self.clock()
        steps = 0

        def tick() -> None:
            nonlocal steps
            steps += 1
            if self._due():
                self._line(f"{name}: {steps}/{total}{self._eta(steps, total, t)}")

        self._line(f"{name}…")
        yield tick
        self._line(f"{name}: done in {self.clock() - t:.1f} s")

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None

    def __enter__(self) -> RunProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
