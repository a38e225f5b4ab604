"""The error every command turns bad input into: one line, exit 2 (a shared leaf: the audit's
supervisor raises it from the child's outcome, the commands from their arguments)."""
from __future__ import annotations

import click

__all__ = ["InputError"]


class InputError(click.ClickException):
    """Bad input that is not a usage error: one line, exit 2."""

    exit_code = 2
