"""The ``torchledger`` click group. Thin: parse, call analyzers/tracer, print.

Exit codes everywhere: 0 clean, 1 findings at or above ``--fail-on``, 2 bad usage or bad
input. Bad input is one line on stderr (``torchledger: error: ...``) with no traceback
unless ``--debug`` is given. Data goes to stdout, logs to stderr.
"""
from __future__ import annotations

import os
import sys

import click

from .types import InputError

__all__ = ["main", "cli"]


#: Subcommands, loaded on first use so that `estimate` never imports torch.
COMMANDS = {
    "estimate": "torchledger.cli.estimate:estimate",
    "audit": "torchledger.cli.audit:audit",
    "report": "torchledger.cli.audit:report",
    "lint": "torchledger.cli.lint:lint",
    "snapshot": "torchledger.cli.snapshot:snapshot",
    "calibrate": "torchledger.cli.calibrate:calibrate",
    "plan": "torchledger.cli.plan:plan",
}


class LedgerGroup(click.Group):
    """A click group whose usage errors are one line and exit 2, with lazy subcommands."""

    def list_commands(self, ctx):
        return sorted(set(super().list_commands(ctx)) | {n for n in COMMANDS if self._load(n)})

    def get_command(self, ctx, name):
        return super().get_command(ctx, name) or self._load(name)

    def _load(self, name):
        target = COMMANDS.get(name)
        if target is None:
            return None
        import importlib
        module, attr = target.split(":")
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name == module:        # that command is not part of this build
                return None
            raise
        return getattr(mod, attr, None)

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if args is None:
            args = sys.argv[1:]
        args = list(args)
        debug = "--debug" in args or os.environ.get("TORCHLEDGER_DEBUG") == "1"
        try:
            rv = super().main(args=args, prog_name=prog_name or "torchledger",
                              complete_var=complete_var, standalone_mode=False, **extra)
        except click.exceptions.Exit as e:           # --help, ctx.exit(n)
            code = e.exit_code
        except click.exceptions.Abort:
            click.echo("torchledger: aborted", err=True)
            code = 130
        except click.ClickException as e:            # UsageError, BadParameter, InputError
            if debug:
                raise
            click.echo(f"torchledger: error: {_one_line(e)}", err=True)
            code = 2
        else:
            code = rv if isinstance(rv, int) else 0
        if standalone_mode:
            sys.exit(code)
        return code


def _one_line(e: click.ClickException) -> str:
    msg = e.format_message()
    ctx = getattr(e, "ctx", None)
    if isinstance(e, click.UsageError) and ctx is not None and not isinstance(e, InputError):
        msg = f"{msg} (see '{ctx.command_path} --help')"
    return clip_line(" ".join(clip_word(w) for w in str(msg).split()))


#: An error line echoes what was typed, but not 20,000 characters of it: a word (a path, a
#: value) past ``WORD_MAX`` keeps its first ``WORD_KEPT``; a line past ``LINE_MAX`` keeps its
#: start and its end (what to do).
WORD_MAX, WORD_KEPT, LINE_MAX = 300, 120, 2000


def clip_word(word: str) -> str:
    if len(word) <= WORD_MAX:
        return word
    return f"{word[:WORD_KEPT]}...({len(word):,} characters)"


def clip_line(line: str) -> str:
    if len(line) <= LINE_MAX:
        return line
    return f"{line[:LINE_MAX - 500]} ...({len(line):,} characters)... {line[-400:]}"


@click.group(cls=LedgerGroup, context_settings={"help_option_names": ["-h", "--help"],
                                                "max_content_width": 100})
@click.option("--debug", is_flag=True, help="Show full tracebacks on errors.")
@click.version_option(package_name="torchledger", prog_name="torchledger")
def cli(debug: bool) -> None:
    """torchledger: do the accounting first, then write the code.

    FLOPs, bytes and why, for a PyTorch training step: closed-form estimates (`estimate`),
    measured audits of a real step (`audit`), and static checks of training code (`lint`).
    """


def main() -> None:  # console script entry point (and ``python -m torchledger``)
    """Run the command, then leave without tearing the interpreter down.

    After an audit the process holds the user's model, its autograd graph and every module
    torch and transformers imported; freeing them one by one at exit took 1.6 s of a 7B fake
    audit and serves no one. Exit handlers still run and the streams are flushed first.
    """
    code = cli.main(standalone_mode=False)
    import atexit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):    # a closed pipe (`| head`) or a closed stream
            pass
    os._exit(code)
