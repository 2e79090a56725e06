"""Errors a user can act on: the CLI prints them as one line and exits non-zero, without a traceback."""


class KvtraceError(Exception):
    """A problem with the user's input or environment, worded as one line that names what and where."""
