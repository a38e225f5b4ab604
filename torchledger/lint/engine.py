"""The lint engine: static checks of PyTorch training code. The file is parsed with
:mod:`ast` and never imported or run, so linting is safe on untrusted code and needs no torch.

    >>> from torchledger.lint import lint_source
    >>> [f.rule for f in lint_source("import torch\\nsd = torch.load('ckpt.pt')\\n")]
    ['TL-LINT-003']

Every finding names a stable rule id (``RULES``; docs/lint-rules.md explains each) and can be
silenced on its line, or from a comment-only line just above it, with
``# torchledger: ignore[TL-LINT-001]`` (several ids comma separated; a bare
``# torchledger: ignore`` silences every rule on that line).

Known limitations: the rules are heuristics over names and syntax (see :mod:`.loops`,
:mod:`.forward` and :mod:`.misc`); nothing is type-checked, and helpers are followed
within one file only.
"""
from __future__ import annotations

import ast
import io
import os
import re
import tokenize

from ..inputs import SOURCE_MAX_BYTES, InputFileError, read_input
from ..record import Finding
from ..rules import rules_in
from .ast_tools import LOOPS, SCOPES, children, dotted, is_const, tail
from .forward import check_forward_syncs
from .misc import (check_checkpoint, check_model_moves, check_module_save,
                   check_non_blocking, check_retain_graph, check_unsafe_load, module_saves)
from .loops import check_grads_never_cleared, check_kept_graph

__all__ = ["RULES", "LintError", "lint_source", "lint_file", "lint_paths", "python_files"]

#: rule id -> (severity, title, doc, anchor): lint's part of the one catalogue,
#: :data:`torchledger.rules.RULES`. Ids are stable; never reuse one.
RULES = rules_in("TL-LINT-")


class LintError(ValueError):
    """Input that cannot be linted (missing path, unreadable file, invalid Python)."""


class Source:
    """One parsed file as the rules see it: tree, parents, import aliases, functions."""

    def __init__(self, tree: ast.Module, path: str, tree_saves=()):
        self.tree, self.path, self.cache = tree, path, {}
        #: ``path:line`` of the whole-module ``torch.save`` calls in the other files linted
        #: with this one (:func:`lint_paths`): what a bare ``torch.load`` here may be given
        self.tree_saves = tuple(tree_saves)
        self.nodes, self.parents, i = [tree], {}, 0
        while i < len(self.nodes):                     # ast.walk, keeping each node's children
            node = self.nodes[i]
            i += 1
            for c in children(node):
                self.parents[c] = node
                self.nodes.append(c)
        self.aliases, self.functions = {}, {}
        for node in self.nodes:
            if isinstance(node, ast.Import):
                self.aliases.update({a.asname: a.name for a in node.names if a.asname})
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                self.aliases.update({a.asname or a.name: f"{node.module}.{a.name}"
                                     for a in node.names})
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.functions.setdefault(node.name, []).append(node)
        self.calls = [n for n in self.nodes if isinstance(n, ast.Call)]

    def qualname(self, expr):
        """``th.load`` -> ``torch.load`` after ``import torch as th``."""
        name = dotted(expr)
        if name is None:
            return None
        head, dot, rest = name.partition(".")
        return self.aliases.get(head, head) + dot + rest

    def ancestors(self, node):
        while node in self.parents:
            node = self.parents[node]
            yield node

    def ancestors_until(self, node, stop):
        for a in self.ancestors(node):
            if a is stop:
                return
            yield a

    def scopes(self):
        yield self.tree, self.tree.body
        for node in self.nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield node, node.body

    def scope_of(self, node) -> list:
        """The body of the function (or module) that ``node`` runs in."""
        for a in self.ancestors(node):
            if isinstance(a, (ast.FunctionDef, ast.AsyncFunctionDef)):
                return a.body
        return self.tree.body

    def loop_of(self, node):
        """The innermost loop whose body holds ``node``, within the same function."""
        prev = node
        for a in self.ancestors(node):
            if isinstance(a, SCOPES):
                return None
            if isinstance(a, LOOPS) and any(prev is s for s in a.body):
                return a
            prev = a
        return None

    def in_no_grad(self, node) -> bool:
        """Under ``with torch.no_grad()/inference_mode()`` or in a function decorated so."""
        for a in self.ancestors(node):
            if isinstance(a, (ast.With, ast.AsyncWith)) and any(
                    self._no_grad(i.context_expr) for i in a.items):
                return True
            if isinstance(a, (ast.FunctionDef, ast.AsyncFunctionDef)):
                return any(self._no_grad(d) for d in a.decorator_list)
            if isinstance(a, (ast.Lambda, ast.ClassDef)):
                return False
        return False

    def _no_grad(self, expr) -> bool:
        call = expr if isinstance(expr, ast.Call) else None
        name = tail(self.qualname(call.func if call else expr))
        if name == "set_grad_enabled":
            return bool(call and call.args and is_const(call.args[0], False))
        return name in ("no_grad", "inference_mode")


CHECKS = (check_kept_graph, check_grads_never_cleared, check_unsafe_load, check_forward_syncs,
          check_non_blocking, check_model_moves, check_module_save, check_retain_graph,
          check_checkpoint)


# -- the engine ---------------------------------------------------------------------------------
def lint_source(source: str, path: str = "<string>", tree_saves=()) -> list:
    """Findings for one file's text, sorted by line. Raises :class:`LintError` when the text
    is not valid Python (the message names ``path:line``), or holds an expression nested too
    deeply to parse or check (thousands of chained ``.b`` or ``-``: RecursionError or
    MemoryError inside Python), so that no file is ever reported clean after a partial check.
    ``tree_saves``: ``path:line`` of whole-module ``torch.save`` calls elsewhere in the tree
    (TL-LINT-003 then warns that a bare ``torch.load`` here fails on torch >= 2.6)."""
    return _lint(source, path, tree_saves)[0]


def _lint(source: str, path: str, tree_saves=()) -> tuple:
    """(findings, ``path:line`` of the file's own whole-module saves) of :func:`lint_source`."""
    try:
        tree = ast.parse(source, filename=path)
    except SyntaxError as e:
        raise LintError(f"{path}:{e.lineno or 1}: not valid Python ({e.msg}); fix the syntax or "
                        f"leave the file out") from None
    except ValueError as e:                            # e.g. null bytes on older Pythons
        raise LintError(f"{path}: not valid Python ({e})") from None
    except (RecursionError, MemoryError) as e:         # 3,000 chained `- - -` or `.b.b.b`
        raise _too_deep(path, e, "parse") from None
    src, ignored = Source(tree, path, tree_saves), _suppressions(source)
    found = {}
    for check in CHECKS:
        try:
            hits = list(check(src))
        except (RecursionError, MemoryError) as e:    # the rules recurse into expressions
            raise _too_deep(path, e, "check") from None
        for rule, node, message, hint, *severity in hits:    # a check may lower one hit's severity
            line = node.lineno
            if _silenced(ignored, rule, node):
                continue
            found.setdefault((line, rule, message), Finding(
                rule=rule, severity=severity[0] if severity else RULES[rule][0], message=message,
                location=f"{path}:{line}", hint=hint))
    try:
        saves = [f"{path}:{c.lineno}" for c in module_saves(src)]
    except (RecursionError, MemoryError) as e:
        raise _too_deep(path, e, "check") from None
    return [found[k] for k in sorted(found)], saves


def _too_deep(path: str, e: BaseException, what: str) -> LintError:
    # NB: the whole file is skipped, not one rule: a partial check would pass for a clean one
    return LintError(f"{path}: an expression is nested too deeply to {what} ({type(e).__name__}); "
                     f"expected ordinary Python: split the expression, or leave the file out")


def _silenced(ignored: dict, rule: str, node) -> bool:
    """A comment on any line of a simple statement or expression (black puts it after the
    closing parenthesis), or on the header line of a compound one, silences it."""
    last = node.lineno if isinstance(getattr(node, "body", None), list) else \
        (getattr(node, "end_lineno", None) or node.lineno)
    rules = set().union(*(ignored.get(i, ()) for i in range(node.lineno, last + 1)))
    return rule in rules or "*" in rules


_IGNORE = re.compile(r"#\s*torchledger:\s*ignore\b(\[[^\]]*\])?", re.I)


def _suppressions(source: str) -> dict:
    """line -> rule ids silenced there ("*" for all). A comment-only line covers the next."""
    if "torchledger" not in source:
        return {}
    try:
        comments = [(t.start[0], t.string, t.line) for t in
                    tokenize.generate_tokens(io.StringIO(source).readline)
                    if t.type == tokenize.COMMENT]
    except (tokenize.TokenError, SyntaxError):         # NB: fall back to a plain text scan
        comments = [(i, line[line.index("#"):], line)
                    for i, line in enumerate(source.splitlines(), 1) if "#" in line]
    out = {}
    for line, text, physical in comments:
        m = _IGNORE.search(text)
        if not m:
            continue
        ids = {"*"} if m.group(1) is None else \
            {x.strip().upper() for x in m.group(1)[1:-1].split(",") if x.strip()}
        for target in [line, line + 1] if physical.lstrip().startswith("#") else [line]:
            out.setdefault(target, set()).update(ids)
    return out


def lint_file(path: str, tree_saves=()) -> list:
    """Findings for one file on disk (decoded as Python does, honouring a coding cookie).

    Only a regular file of at most ``SOURCE_MAX_BYTES`` is read (a FIFO named ``x.py`` is
    refused at once, never opened for a blocking read); anything else raises :class:`LintError`.
    ``tree_saves`` as in :func:`lint_source`.
    """
    return _lint(_read_source(path), path, tree_saves)[0]


def _read_source(path: str) -> str:
    try:
        data = read_input(path, what="Python source", max_bytes=SOURCE_MAX_BYTES)
    except InputFileError as e:
        raise LintError(str(e)) from None
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
        source = data.decode(encoding)
    except (SyntaxError, UnicodeDecodeError, LookupError) as e:
        raise LintError(f"{path}: cannot decode as Python source ({e})") from None
    # NB: universal newlines, as tokenize.open (and the interpreter) read the file
    return source.replace("\r\n", "\n").replace("\r", "\n")


_SKIP_DIRS = {"__pycache__", ".venv", "venv", "site-packages", "node_modules"}


def python_files(paths) -> list:
    """The files ``lint`` reads: files as given, directories walked for ``*.py`` (skipping
    hidden directories, ``__pycache__``, virtualenvs and ``site-packages``), each once."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out, seen = [], set()
    for path in map(os.fspath, paths):
        if os.path.isdir(path):
            found = []
            for root, dirs, files in os.walk(path):
                dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in _SKIP_DIRS)
                found += [os.path.normpath(os.path.join(root, f)) for f in sorted(files)
                          if f.endswith(".py")]
        elif os.path.exists(path):
            found = [path]
        else:
            raise LintError(f"{path}: no such file or directory")
        for f in found:
            if os.path.realpath(f) not in seen:
                seen.add(os.path.realpath(f))
                out.append(f)
    return out


def lint_paths(paths, errors=None) -> list:
    """Findings for every Python file under ``paths`` (files or directories), in file order.
    A bare ``torch.load`` is judged against the whole tree: where another file pickles whole
    modules (``torch.save(model, ...)``), TL-LINT-003 warns that the load fails on torch >= 2.6.

    A file that cannot be linted (unreadable, not a regular file, invalid Python) raises
    :class:`LintError`; with ``errors`` (a list) its error is appended there instead and the
    other files are still linted.
    """
    results, saves = {}, []
    for path in python_files(paths):
        try:
            results[path], own = _lint(_read_source(path), path)
        except LintError as e:
            if errors is None:
                raise
            errors.append(e)
            continue
        saves += own
    for path, found in results.items():       # a bare load in a tree that pickles modules
        others = [s for s in saves if s.rsplit(":", 1)[0] != path]
        if others and any(f.rule == "TL-LINT-003" and f.severity == "info" for f in found):
            results[path] = lint_file(path, others)
    return [f for found in results.values() for f in found]
