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
