"""Static lint of training code: rules over the source's syntax tree (``ast`` only; the file is
never imported or run, and no torch is needed). ``torchledger lint PATH...`` is its command.

* :mod:`.engine` - parse a file, run every rule, honour ``# torchledger: ignore[...]``.
* :mod:`.loops` - loop rules: losses kept across iterations, gradients never cleared.
* :mod:`.forward` - host-device syncs inside ``forward``.
* :mod:`.misc` - ``torch.load``/``torch.save``, device moves, ``non_blocking``, ``retain_graph``,
  checkpoints without optimizer state.
* :mod:`.ast_tools` - small helpers over ``ast`` nodes the rules share.

Rule ids, titles and docs come from the one catalogue, :mod:`torchledger.rules`; SARIF output
is :func:`torchledger.render.sarif.findings_to_sarif`.

    >>> from torchledger.lint import lint_source
    >>> [f.rule for f in lint_source("import torch\\nsd = torch.load('ckpt.pt')\\n")]
    ['TL-LINT-003']
"""
from __future__ import annotations

from .engine import RULES, LintError, lint_file, lint_paths, lint_source, python_files

__all__ = ["RULES", "LintError", "lint_source", "lint_file", "lint_paths", "python_files"]
