"""The ``torchledger`` click group. Thin: parse, call analyzers/tracer, print.

Exit codes everywhere: 0 clean, 1 findings at or above ``--fail-on``, 2 bad usage or bad
input. Bad input is one line on stderr (``torchledger: error: ...``) with no traceback
unless ``--debug`` is given. Data goes to stdout, logs to stderr. A stdout that cannot take
the data (closed with ``>&-``, full as ``/dev/full``) is one line and exit 2; a reader that
went away (``| head -c0``) ends the command silently with 141, as a shell shows a process
that SIGPIPE ended (``yes | head``).
"""
from __future__ import annotations

import os
import sys

import click

from .types import InputError, StdoutError

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
        _hold_closed_streams()
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
        except BrokenPipeError as e:                 # a pipe's reader gone, wherever it was written
            code = _stdout_failed(StdoutError(e.errno, e.strerror or str(e)))
        except StdoutError as e:
            code = _stdout_failed(e)
        else:
            code = rv if isinstance(rv, int) else 0
        if standalone_mode:
            sys.exit(code)
        return code


def _hold_closed_streams() -> None:
    """A standard descriptor closed before the start (``>&-``) is held on ``/dev/null``, so the
    next file or pipe opened does not take its number (a record file on fd 1 would receive
    what a model file prints). ``sys.stdout`` stays None: ``echo_out`` still reports it."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            try:
                null = os.open(os.devnull, os.O_RDWR)
                if null != fd:
                    os.dup2(null, fd)
                    os.close(null)
            except OSError:
                pass


#: Exit status when stdout's reader went away (``EPIPE``): 128 + SIGPIPE, what a shell shows
#: for a process that SIGPIPE ended.
EXIT_PIPE = 141


def _stdout_failed(e: StdoutError) -> int:
    """One line (exit 2) for a stdout that cannot be written; silence (141) for a reader gone.
    Either way the data left in stdout's buffer is dropped, so that no later flush (at exit)
    raises again."""
    import errno
    stream = sys.stdout
    if stream is not None and stream is sys.__stdout__:
        try:                                # Python's recipe: point fd 1 at /dev/null
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, stream.fileno())
            os.close(null)
        except (OSError, ValueError):
            pass
    if e.errno == errno.EPIPE:
        return EXIT_PIPE
    try:
        click.echo(f"torchledger: error: cannot write the output to stdout ({e.reason}); write it to a "
                   f"file: --output FILE (audit, report) or a redirect", err=True)
    except (OSError, ValueError):           # stderr gone too: the exit code says it
        pass
    return 2


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
            if stream is not None:       # None: closed before the start (`>&-`)
                stream.flush()
        except (OSError, ValueError):    # a closed pipe (`| head`) or a closed stream
            pass
    os._exit(code)
