"""User-facing errors.

Anything a user can cause (bad recipe, unknown model, no GPU, corrupt pack) raises `ForgepackError`
with a one-line message; the CLI prints it and exits non-zero, never with a traceback.
"""


class ForgepackError(Exception):
    """An error the user can act on; `str(err)` is the whole message, one line."""

    exit_code = 2


class UsageError(ForgepackError):
    """Bad command-line arguments or recipe values."""

    exit_code = 2
