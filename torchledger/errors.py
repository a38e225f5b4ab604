"""The error every command turns bad input into: one line, exit 2 (a shared leaf: the audit's
supervisor raises it from the child's outcome, the commands from their arguments)."""
from __future__ import annotations

import click

__all__ = ["InputError", "StdoutError"]


class InputError(click.ClickException):
    """Bad input that is not a usage error: one line, exit 2."""

    exit_code = 2


class StdoutError(Exception):
    """The command's output could not be written to stdout (closed, full, or a reader that
    went away): the CLI's group turns it into one line and exit 2, or, for a reader gone
    (``EPIPE``: ``| head``), a silent exit 141 as a shell shows for a process SIGPIPE ended."""

    def __init__(self, errno_: int, reason: str):
        super().__init__(reason)
        self.errno, self.reason = errno_, reason
