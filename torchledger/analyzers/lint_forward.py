"""The TL-LINT-004 rule: host-device syncs inside ``forward`` of an ``nn.Module`` subclass
(``.item()``, ``.cpu()``, ``.numpy()``, ``.tolist()``, ``print(tensor)``, ``.to("cpu")``,
``torch.cuda.synchronize()``, and ``if``/``while``/``assert`` on a tensor value). Which
names are tensors is guessed from ``forward``'s parameters (annotations, defaults, flag-like
names) and everything computed from them; reading only metadata (``.shape``, ``.dtype``,
``.size()``...) is not a sync. A pure function of the engine's parsed file (see
:mod:`.lint_rules`), ``ast`` only.
"""
from __future__ import annotations

import ast
import re

from .lint_ast import SCOPES, dotted, kwarg, tail, target_names

__all__ = ["check_forward_syncs"]


# Reading these never touches tensor values, so branching on them is free.
_META_ATTRS = {"shape", "ndim", "dtype", "device", "is_cuda", "requires_grad", "layout",
               "is_sparse", "is_quantized", "is_meta", "names", "training"}
_META_CALLS = {"size", "dim", "numel", "ndimension", "nelement", "element_size", "stride",
               "is_contiguous", "is_floating_point", "is_complex", "get_device", "data_ptr",
               "isinstance", "len", "hasattr", "getattr", "callable", "type", "id",
               "item", "tolist", "int", "float", "bool"}       # the last five are flagged apart
_FLAG_PARAM = re.compile(r"^(use|return|output|is|has|do|enable|disable|with|num|n)_|"
                         r"_(size|len|length|dim|mode|type|flag|only)$|^(training|causal)$")
_SYNC_CALLS = {"item": "copies a value to the host", "cpu": "copies to the host",
               "numpy": "copies to the host", "tolist": "copies to the host",
               "nonzero": "needs the result's size on the host"}
_HINT_VALUE = ("keep values on the device inside forward: return the tensor and call .item() "
               "once per step in the training loop, for logging")
_HINT_BRANCH = ("branch on shapes or Python flags, or compute both sides and select with "
                "torch.where or a mask; torch._assert_async checks without a sync")
_META_PREFIX = re.compile(r"^_*(is|has|check|can|should)_")
_COMPREHENSIONS = (ast.GeneratorExp, ast.ListComp, ast.SetComp, ast.DictComp)


def _value_use(expr, tensors) -> bool:
    """``expr`` reads the values (not just the shape/dtype) of a tensor in ``tensors``."""
    stack = [(expr, tensors)]
    while stack:
        n, names = stack.pop()
        if isinstance(n, ast.Attribute) and (n.attr in _META_ATTRS or _META_PREFIX.match(n.attr)):
            continue
        if isinstance(n, ast.Call):
            name = tail(dotted(n.func, loose=True))
            if name in _META_CALLS or _META_PREFIX.match(name):
                continue
        if isinstance(n, ast.Compare) and all(isinstance(o, (ast.Is, ast.IsNot)) for o in n.ops):
            continue
        if isinstance(n, ast.Name) and n.id in names:
            return True
        if isinstance(n, _COMPREHENSIONS):      # iterating a tuple of tensors reads no values
            inner = set(names)
            for gen in n.generators:
                if _value_use(gen.iter, inner):
                    inner |= set(target_names(gen.target))
                stack.extend((c, inner) for c in gen.ifs)
            stack.extend((c, inner) for c in [getattr(n, "elt", None), getattr(n, "key", None),
                                               getattr(n, "value", None)] if c is not None)
            continue
        stack.extend((c, names) for c in ast.iter_child_nodes(n) if not isinstance(c, SCOPES))
    return False


def _tensor_names(fn) -> tuple:
    """Parameters of ``forward`` that may be tensors, and those plus every name computed
    from them."""
    a = fn.args
    params = [*a.posonlyargs, *a.args][1:]
    defaults = [None] * (len(params) - len(a.defaults)) + list(a.defaults)
    names = set()
    for p, default in [*zip(params, defaults), *zip(a.kwonlyargs, a.kw_defaults)]:
        ann = ast.unparse(p.annotation).lower() if p.annotation is not None else ""
        python_value = re.fullmatch(r"(optional\[)?(bool|int|float|str)\]?", ann) or \
            (isinstance(default, ast.Constant) and default.value is not None)
        if "tensor" in ann or not (python_value or _FLAG_PARAM.search(p.arg)):
            names.add(p.arg)
    args = set(names)
    assigns = [n for n in ast.walk(fn) if isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign))
               and n.value is not None]
    grew = True
    while grew:
        before = len(names)
        for n in assigns:
            if _value_use(n.value, names):
                for t in getattr(n, "targets", None) or [n.target]:
                    names.update(x for x in target_names(t) if "." not in x)
        grew = len(names) > before
    return args, names


def _sync(node, params, tensors):
    """(what, hint) when ``node`` forces a host-device sync."""
    test = getattr(node, "test", None)
    while isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        test = test.operand
    if isinstance(test, ast.Name) and test.id in params:
        return None                           # `if flag:` on an argument: a Python flag, mostly
    if isinstance(node, (ast.If, ast.While, ast.Assert, ast.IfExp)) \
            and _value_use(node.test, tensors):
        word = {ast.If: "if", ast.While: "while", ast.Assert: "assert"}.get(type(node), "... if")
        return f"`{word} {ast.unparse(node.test)}` reads a tensor value on the host", _HINT_BRANCH
    if not isinstance(node, ast.Call):
        return None
    f, text = node.func, ast.unparse(node)
    if isinstance(f, ast.Attribute) and f.attr in _SYNC_CALLS:
        return f"`{text}` {_SYNC_CALLS[f.attr]}", _HINT_VALUE
    device = kwarg(node, "device") or (node.args[0] if node.args else None)
    if isinstance(f, ast.Attribute) and f.attr == "to" and isinstance(device, ast.Constant) \
            and device.value == "cpu":
        return f"`{text}` copies to the host", _HINT_VALUE
    if isinstance(f, ast.Attribute) and f.attr == "synchronize":
        return (f"`{text}` waits for all queued GPU work",
                "synchronize only when timing, outside forward")
    if isinstance(f, ast.Name) and f.id in ("print", "int", "float", "bool") \
            and any(_value_use(x, tensors) for x in node.args):
        hint = "print x.shape / x.dtype, or log outside forward" if f.id == "print" else _HINT_VALUE
        return f"`{text}` reads a tensor value on the host", hint
    return None


def _module_classes(src) -> list:
    """Classes deriving from ``nn.Module`` (or ``*Module``), directly or via this file."""
    classes = {n.name: n for n in src.nodes if isinstance(n, ast.ClassDef)}
    found, grew = {}, True
    while grew:
        grew = False
        for name, cls in classes.items():
            bases = [tail(dotted(b, loose=True)) for b in cls.bases]
            if name not in found and any(b.endswith("Module") or b in found for b in bases):
                found[name], grew = cls, True
    return list(found.values())


def check_forward_syncs(src):
    """TL-LINT-004: ``.item()``, ``.cpu()``, ``print(x)``, ``if x.sum() > 0:``... in forward."""
    for cls in _module_classes(src):
        for fn in cls.body:
            if not (isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and fn.name == "forward"):
                continue
            (params, tensors), lines = _tensor_names(fn), set()
            for node in ast.walk(fn):               # outer nodes first: one finding a line
                hit = _sync(node, params, tensors)
                if hit and node.lineno not in lines:
                    lines.add(node.lineno)
                    yield ("TL-LINT-004", node,
                           f"{cls.name}.forward: {hit[0]}, so the host waits for the GPU on "
                           f"every call (a host-device sync)", hit[1])
