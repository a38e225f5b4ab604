"""``torchledger lint``: static checks of training code; parse, check, print. No torch import."""
from __future__ import annotations

import json

import click

from .. import lint as engine
from .types import InputError

__all__ = ["lint"]

SCHEMA = "torchledger.lint/1"
_RANK = {"info": 0, "warning": 1, "error": 2, "never": 3}


@click.command("lint")
@click.argument("paths", nargs=-1, required=True, metavar="PATH...")
@click.option("--format", "fmt", type=click.Choice(["table", "json", "sarif"]), default="table",
              show_default=True, help="table for people; json (schema torchledger.lint/1) or "
              "sarif (2.1.0, for code scanning) for machines.")
@click.option("--fail-on", type=click.Choice(["error", "warning", "info", "never"]),
              default="warning", show_default=True,
              help="Exit 1 when a finding at or above this severity exists.")
@click.pass_context
def lint(ctx: click.Context, paths, fmt: str, fail_on: str) -> None:
    """Check Python training code for common PyTorch mistakes, without running it.

    PATH may be files or directories (walked for *.py; hidden directories, __pycache__,
    virtualenvs and site-packages are skipped). Rules: losses kept across iterations
    (TL-LINT-001), gradients never cleared (002), torch.load without weights_only (003),
    host syncs in forward (004), non_blocking from unpinned memory (005), model moved in
    the loop (006), torch.save of a whole module (007), retain_graph in a loop (008),
    checkpoints without optimizer state (009). Silence one line with
    `# torchledger: ignore[TL-LINT-001]`. Exit 0 clean, 1 findings at or above --fail-on,
    2 bad input: a file that cannot be read or parsed is named in one line on stderr and
    skipped, the others are still linted and printed, and the exit is 2.

    Example: torchledger lint train.py models/ --format sarif > lint.sarif
    """
    try:
        files = engine.python_files(paths)
    except engine.LintError as e:
        raise InputError(str(e)) from None
    failed: list = []               # one bad file is reported and skipped, never the whole tree
    findings = engine.lint_paths(files, errors=failed)     # the tree at once: TL-LINT-003 sees its saves
    errors = [str(e) for e in failed]
    for e in errors:
        click.echo(f"torchledger: error: {e}", err=True)
    if not files:
        click.echo(f"torchledger: no Python files under {', '.join(paths)}", err=True)
    if fmt == "json":
        click.echo(json.dumps({"schema": SCHEMA, "findings": [f.to_dict() for f in findings],
                               "files": len(files), "errors": errors}, indent=2))
    elif fmt == "sarif":
        from ..render.sarif import findings_to_sarif  # lazy: CLI startup
        click.echo(json.dumps(findings_to_sarif(findings, rules=list(engine.RULES)), indent=2))
    else:
        click.echo(render_table(findings, len(files) - len(errors), len(errors)))
    if errors:
        ctx.exit(2)
    if any(_RANK[f.severity] >= _RANK[fail_on] for f in findings):
        ctx.exit(1)


def render_table(findings, n_files: int, n_errors: int = 0) -> str:
    """One line per finding, ``path:line: severity RULE message (hint)``, then a summary
    (``n_files`` linted; ``n_errors`` more could not be, their errors went to stderr)."""
    files = "file" if n_files == 1 else "files"
    skipped = (f" {n_errors} {'file' if n_errors == 1 else 'files'} not linted (errors on stderr)."
               if n_errors else "")
    if not findings:
        return f"No findings in {n_files} {files}.{skipped}"
    lines = [f"{f.location}: {f.severity} {f.rule} {f.message}" + (f" ({f.hint})" if f.hint else "")
             for f in findings]
    counts = {s: sum(f.severity == s for f in findings) for s in ("error", "warning", "info")}
    parts = ", ".join(f"{n} {s}{'s' if n != 1 and s != 'info' else ''}"
                      for s, n in counts.items() if n)
    noun = "finding" if len(findings) == 1 else "findings"
    lines.append(f"{len(findings)} {noun} ({parts}) in {n_files} {files}.{skipped}")
    return "\n".join(lines)
