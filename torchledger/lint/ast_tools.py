"""The small AST helpers every lint rule shares: dotted names, scope walks without entering
nested functions, call keywords, and names that look like a model or an optimizer. Pure
functions of ``ast`` nodes; :mod:`.lint` and the rule modules (:mod:`.lint_rules`,
:mod:`.lint_forward`, :mod:`.lint_misc`) import them, and they import no other lint module.
"""
from __future__ import annotations

import ast
import re
from typing import Iterator, Optional

__all__ = ["SCOPES", "LOOPS", "OPTIMIZER", "dotted", "tail", "walk_scope", "pos", "kwarg",
           "is_const", "model_like", "is_optimizer_step", "target_names", "children", "walk"]

SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
LOOPS = (ast.For, ast.AsyncFor, ast.While)
OPTIMIZER = re.compile(r"optim|(^|_)opt(_|\d|s?$)")
_NOT_A_MODEL = re.compile(r"dict|state|path|file|name|dir|cfg|config|args|url|type|class|cls|"
                          r"fn$|id$")


def dotted(node: ast.AST, loose: bool = False) -> Optional[str]:
    """``self.model.to`` for a Name/Attribute chain. ``loose`` looks through calls and
    subscripts (``self.optimizers()[0]`` -> ``self.optimizers``)."""
    parts = []
    while True:
        if isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        elif isinstance(node, ast.Name):
            parts.append(node.id)
            return ".".join(reversed(parts))
        elif loose and isinstance(node, ast.Call):
            node = node.func
        elif loose and isinstance(node, ast.Subscript):
            node = node.value
        else:
            return None


def tail(name: Optional[str]) -> str:
    return (name or "").rsplit(".", 1)[-1]


def walk_scope(nodes) -> Iterator[ast.AST]:
    """Every node under ``nodes`` without entering nested functions, lambdas or classes."""
    stack = list(reversed(list(nodes)))
    while stack:
        node = stack.pop()
        yield node
        kids = children(node)
        stack.extend(c for c in kids if not isinstance(c, SCOPES))


def walk(node) -> Iterator[ast.AST]:
    """``ast.walk`` (breadth first, outer nodes first) over the cached children."""
    todo, i = [node], 0
    while i < len(todo):
        n = todo[i]
        i += 1
        todo.extend(children(n))
        yield n


def children(node) -> list:
    """``ast.iter_child_nodes`` as a list, kept on the node (the tree is walked many times)."""
    kids = node.__dict__.get("_tl_kids")
    if kids is None:
        kids = node._tl_kids = list(ast.iter_child_nodes(node))
    return kids


def pos(node: ast.AST) -> tuple:
    return (getattr(node, "lineno", 0), getattr(node, "col_offset", 0))


def kwarg(call: ast.Call, name: str):
    return next((k.value for k in call.keywords if k.arg == name), None)


def is_const(node, value) -> bool:
    return isinstance(node, ast.Constant) and node.value is value


def model_like(name: Optional[str]) -> bool:
    """A receiver named like a model (``model``, ``self.net``, ``ddp_model.module``)."""
    t = tail(name).lower()
    return ("model" in t or t in {"net", "network", "module"}) and not _NOT_A_MODEL.search(t)


def is_optimizer_step(call: ast.Call) -> bool:
    """``opt.step()``, ``self.optimizer.step()``, ``scaler.step(optimizer)``."""
    if not (isinstance(call.func, ast.Attribute) and call.func.attr == "step"):
        return False
    names = [dotted(call.func.value, loose=True)] + [dotted(a, loose=True) for a in call.args]
    return any(OPTIMIZER.search(tail(n).lower()) for n in names if n)


def target_names(target) -> Iterator[str]:
    if isinstance(target, (ast.Tuple, ast.List)):
        for t in target.elts:
            yield from target_names(t)
    elif isinstance(target, ast.Starred):
        yield from target_names(target.value)
    else:
        name = dotted(target)
        if name:
            yield name
