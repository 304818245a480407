"""Errors that reach users as a one-line message instead of a traceback."""


class DostuneError(Exception):
    """A problem the user can act on. The CLI prints its message and exits with ``exit_code``."""

    exit_code = 2

    def __init__(self, message: str, *, hint: str | None = None):
        super().__init__(message)
        self.hint = hint


class ProfileError(DostuneError):
    """A profile file is missing, malformed, or from an incompatible schema version."""


class ConfigError(DostuneError):
    """A DeepSpeed config or its ``dostune`` section is unusable."""


class NotAvailable(DostuneError):
    """A measurement or feature needs hardware this machine does not have (e.g. a CUDA GPU)."""
