"""User-facing errors.

Anything a user can get wrong (a config key, a data file, an output directory) raises a subclass of
`PflbedError`. The CLI prints its message as one line and exits with code 2; a traceback is reserved for bugs.
"""


class PflbedError(Exception):
    """An error caused by the user's input; its message names the offending field or file."""


class ConfigError(PflbedError):
    """An invalid configuration value or key."""


class DataError(PflbedError):
    """A missing, unreadable or corrupt data file, or an impossible federation of the data."""


LR_HINT = "lower train.lr (or the algorithm's own lrs)"  # what a divergence suggests unless its cause is known


class DivergedError(PflbedError):
    """Training produced a non-finite loss or parameter. The CLI exits with code 3 (not 2: the input was valid)."""

    exit_code = 3

    def __init__(
        self, rnd: int, where: str, run_dir: str | None = None, checkpoint_round: int | None = None,
        evaluated_round: int | None = None, hint: str = LR_HINT,
    ) -> None:  # fmt: skip
        self.round, self.where, self.hint = rnd, where, hint
        self._args = (rnd, where, run_dir, checkpoint_round, evaluated_round, hint)
        kept = ""
        if run_dir is not None:
            kept = (f"; metrics up to round {evaluated_round} are in {run_dir}/metrics.jsonl" if evaluated_round
                    else "; no evaluation was logged yet")  # fmt: skip
            if checkpoint_round:
                kept += f", the last good state (round {checkpoint_round}) in {run_dir}/checkpoints/last.pt"
        super().__init__(f"diverged in round {rnd}: {where}{kept} — {hint}")

    def __reduce__(self):  # rebuilt from its own arguments: it crosses process boundaries (`bench --jobs`, procs)
        return (type(self), self._args)


class PersonalizationDiverged(PflbedError):
    """Personalizing a new client produced a non-finite parameter at every learning rate tried. Exit code 3, as a
    diverging run: the input was valid, the learning rate too large for it."""

    exit_code = 3
