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

from .ast_tools import SCOPES, children, dotted, kwarg, tail, target_names, walk

__all__ = ["check_forward_syncs", "uses_rpc"]


# Reading these never touches tensor values, so branching on them is free.
_META_ATTRS = {"shape", "ndim", "dtype", "device", "is_cuda", "requires_grad", "layout",
               "is_sparse", "is_quantized", "is_meta", "names", "training"}
_META_CALLS = {"size", "dim", "numel", "ndimension", "nelement", "element_size", "stride",
               "is_contiguous", "is_floating_point", "is_complex", "get_device", "data_ptr",
               "isinstance", "len", "hasattr", "getattr", "callable", "type", "id",
               "item", "tolist", "int", "float", "bool",        # these five are flagged apart
               "getrefcount", "getsizeof"}
_FLAG_PARAM = re.compile(r"^(use|return|output|is|has|do|enable|disable|with|num|n)_|"
                         r"_(size|len|length|dim|mode|type|flag|only)$|^(training|causal)$|"
                         r"(height|width)$")
# Names of sizes and paddings: such a name unpacked from a helper's tuple (``emb, num_frames,
# width = self.patch_embeddings(x)``, ``x, pad_values = self.maybe_pad(x, h, w)``) is a shape the
# helper read or the ints F.pad takes, not a tensor.
_SIZE_NAME = re.compile(r"^(num|n)_|_(size|len|length|dim)$|^(size|length|seq_len|seqlen)$|"
                        r"(^|_)(height|width)$|^pad(s|ding|dings|_values|_sizes)?$")
_SIZE = "needs the result's size on the host (its shape depends on the values)"
_SYNC_CALLS = {"item": "copies a value to the host", "cpu": "copies to the host",
               "numpy": "copies to the host", "tolist": "copies to the host",
               "nonzero": _SIZE, "argwhere": _SIZE, "unique": _SIZE,
               "unique_consecutive": _SIZE, "masked_select": _SIZE}
# An annotation naming none of these says the argument is a Python value (int, str, Literal,
# a Cache, a config...), not a tensor.
_TENSOR_ANNOTATION = re.compile(r"tensor|output|\bany\b|parameter|^object$|^$")
# Calls whose result is a Python value, not a tensor.
_PY_CALLS = {"len", "int", "float", "bool", "str", "size", "dim", "numel", "ndimension",
             "isinstance", "hasattr", "get_seq_length", "getrefcount"}
_PY_IF_ARGS = {"min", "max", "abs", "round", "ceil", "floor", "sqrt", "prod", "tuple", "list",
               "divmod", "pow"}
_MASK_CALLS = {"isnan", "isinf", "isfinite", "isneginf", "isposinf", "logical_and", "logical_or",
               "logical_not", "logical_xor", "bool", "eq", "ne", "gt", "ge", "lt", "le"}
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
        if isinstance(n, ast.Compare) and all(isinstance(o, (ast.Is, ast.IsNot, ast.In, ast.NotIn))
                                              for o in n.ops):
            continue                            # `x is None`, `"key" in outputs`: no values read
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
        stack.extend((c, names) for c in children(n) if not isinstance(c, SCOPES))
    return False


def _annotated_python(ann) -> bool:
    """An annotation that names no tensor type: ``int | None``, ``Literal["a", "b"]``,
    ``Cache``, ``tuple[int, int]``..."""
    return ann is not None and not _TENSOR_ANNOTATION.search(ast.unparse(ann).lower().strip("'\""))


def _python_value(e, py) -> bool:
    """``e`` is surely a Python value (not a tensor): constants, shapes, config fields,
    ``len()``, arithmetic of those, and names in ``py``."""
    if isinstance(e, ast.Constant):
        return e.value is not None
    if isinstance(e, ast.JoinedStr):
        return True
    if isinstance(e, ast.Name):
        return e.id in py
    if isinstance(e, ast.Attribute):
        name = dotted(e) or ""
        return e.attr in _META_ATTRS or "config" in name.split(".")[:-1] or name in py
    if isinstance(e, ast.Subscript):
        return _python_value(e.value, py)
    if isinstance(e, ast.Compare):
        return all(isinstance(o, (ast.Is, ast.IsNot, ast.In, ast.NotIn)) for o in e.ops) or \
            all(_python_value(x, py) for x in [e.left, *e.comparators])
    if isinstance(e, ast.Call):
        name = tail(dotted(e.func, loose=True))
        if name in _PY_CALLS:
            return True
        return name in _PY_IF_ARGS and bool(e.args) and all(_python_value(a, py) for a in e.args)
    if isinstance(e, ast.BinOp):
        return _python_value(e.left, py) and _python_value(e.right, py)
    if isinstance(e, ast.UnaryOp):
        return _python_value(e.operand, py)
    if isinstance(e, ast.BoolOp):
        return all(_python_value(v, py) for v in e.values)
    if isinstance(e, ast.IfExp):
        return _python_value(e.body, py) and _python_value(e.orelse, py)
    if isinstance(e, (ast.Tuple, ast.List)):
        return all(_python_value(x, py) for x in e.elts)
    return False


def _python_names(fn, params, assigns) -> set:
    """Names whose every binding in ``fn`` is a Python value (a parameter counts as one
    binding when annotated as a Python value, and is ignored when re-bound)."""
    binds = {}
    for n in assigns:
        for t in getattr(n, "targets", None) or [n.target]:
            if isinstance(t, ast.Name):
                binds.setdefault(t.id, []).append(n.value)
            elif isinstance(t, (ast.Tuple, ast.List)):   # a, b = dims: python only if dims is
                for x in target_names(t):
                    if "." not in x:
                        sized = isinstance(n.value, ast.Call) and _SIZE_NAME.search(x)
                        binds.setdefault(x, []).append(ast.Constant(0) if sized else n.value)
    py = {p for p, ann in params.items() if _annotated_python(ann)}
    grew = True
    while grew:
        grew = False
        for name, values in binds.items():
            if name not in py and (params.get(name, 0) is None or _annotated_python(
                    params.get(name)) or name not in params) \
                    and all(_python_value(v, py) for v in values):
                py.add(name)
                grew = True
    return py


def _tensor_names(fn) -> tuple:
    """Parameters of ``forward`` that may be tensors, and those plus every name computed
    from them (less the names that only ever hold Python values)."""
    a = fn.args
    params = [*a.posonlyargs, *a.args][1:]
    defaults = [None] * (len(params) - len(a.defaults)) + list(a.defaults)
    names = set()
    for p, default in [*zip(params, defaults), *zip(a.kwonlyargs, a.kw_defaults)]:
        python_value = _annotated_python(p.annotation) or \
            (isinstance(default, ast.Constant) and default.value is not None)
        if not (python_value or _FLAG_PARAM.search(p.arg)):
            names.add(p.arg)
    assigns = [n for n in walk(fn) if isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign))
               and n.value is not None]
    py = _python_names(fn, {p.arg: p.annotation for p in [*params, *a.kwonlyargs]}, assigns)
    names -= py
    args = set(names)
    grew = True
    while grew:
        before = len(names)
        for n in assigns:
            if _value_use(n.value, names):
                for t in getattr(n, "targets", None) or [n.target]:
                    names.update(x for x in target_names(t) if "." not in x and x not in py)
        grew = len(names) > before
    return args, names


def _mask(e, tensors, masks) -> bool:
    """``e`` is a boolean tensor: a comparison of tensor values, ``~m``, ``m & n``,
    ``torch.isnan(x)``, or a name bound to one of those."""
    if isinstance(e, ast.Name):
        return e.id in masks
    if isinstance(e, ast.Compare):
        return not all(isinstance(o, (ast.Is, ast.IsNot, ast.In, ast.NotIn)) for o in e.ops) \
            and _value_use(e, tensors)
    if isinstance(e, ast.UnaryOp) and isinstance(e.op, (ast.Invert, ast.Not)):
        return _mask(e.operand, tensors, masks)
    if isinstance(e, ast.BinOp) and isinstance(e.op, (ast.BitAnd, ast.BitOr, ast.BitXor)):
        return _mask(e.left, tensors, masks) or _mask(e.right, tensors, masks)
    if isinstance(e, ast.Call):
        return tail(dotted(e.func, loose=True)) in _MASK_CALLS and _value_use(e, tensors)
    return False


def _mask_names(fn, tensors) -> set:
    masks = set()
    for n in walk(fn):
        if isinstance(n, ast.Assign) and len(n.targets) == 1 \
                and isinstance(n.targets[0], ast.Name) and _mask(n.value, tensors, masks):
            masks.add(n.targets[0].id)
    return masks


def _repeats(node, src):
    """The ``repeats`` of a ``repeat_interleave`` call without ``output_size=``, else None."""
    f = node.func
    if not (isinstance(f, ast.Attribute) and f.attr == "repeat_interleave") \
            or kwarg(node, "output_size") is not None:
        return None
    if kwarg(node, "repeats") is not None:
        return kwarg(node, "repeats")
    if src.qualname(f.value) == "torch":                 # torch.repeat_interleave(x, r)
        return node.args[1] if len(node.args) > 1 else (node.args[0] if node.args else None)
    return node.args[0] if node.args else None


def _sync(node, params, tensors, masks=frozenset(), src=None):
    """(what, hint) when ``node`` forces a host-device sync."""
    if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) \
            and _value_use(node.value, tensors) and _mask(node.slice, tensors, masks):
        return (f"`{ast.unparse(node)}` (boolean-mask indexing) {_SIZE}",
                "keep the shape static: torch.where(mask, x, 0) or x * mask, or a "
                "masked reduction")
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
    if isinstance(f, ast.Attribute) and f.attr == "where" and len(node.args) == 1 \
            and not node.keywords and src is not None and src.qualname(f.value) == "torch":
        return f"`{text}` {_SIZE}", _HINT_VALUE
    repeats = _repeats(node, src) if src is not None else None
    if repeats is not None and _value_use(repeats, tensors | {"torch"}) \
            and not _python_value(repeats, set()):
        return (f"`{text}` with tensor repeats {_SIZE}",
                "pass output_size= (known from shapes) or repeat a Python int")
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


#: torch.distributed.rpc's entry points: a file naming one sends tensors over RPC.
_RPC_NAMES = {"rpc_sync", "rpc_async", "remote", "RRef"}


def uses_rpc(src) -> bool:
    """The file uses ``torch.distributed.rpc`` (``rpc_sync``, ``rpc_async``, ``remote`` or
    ``RRef``, however imported): RPC's TensorPipe agent takes CPU tensors unless a device map
    is set, so a module served over it moves its results to the host by design."""
    for node in src.nodes:
        if isinstance(node, (ast.Name, ast.Attribute)):
            name = src.qualname(node) or ""
            if name.startswith("torch.distributed.rpc.") and tail(name) in _RPC_NAMES:
                return True
    return False


def _host_copy(node) -> bool:
    """``x.cpu()`` or ``x.to("cpu")`` / ``x.to(device="cpu")``: a tensor copied to the host."""
    f = node.func if isinstance(node, ast.Call) else None
    if not isinstance(f, ast.Attribute):
        return False
    device = kwarg(node, "device") or (node.args[0] if node.args else None)
    return f.attr == "cpu" or (f.attr == "to" and isinstance(device, ast.Constant) and device.value == "cpu")


def check_forward_syncs(src):
    """TL-LINT-004: ``.item()``, ``.cpu()``, ``print(x)``, ``if x.sum() > 0:``... in forward.
    In a file that uses ``torch.distributed.rpc`` (:func:`uses_rpc`) a host copy (``.cpu()``,
    ``.to("cpu")``) is what RPC needs, not a mistake: only the other syncs are reported there."""
    rpc = uses_rpc(src)
    for cls in _module_classes(src):
        for fn in cls.body:
            if not (isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and fn.name == "forward"):
                continue
            (params, tensors), lines = _tensor_names(fn), set()
            masks = _mask_names(fn, tensors)
            for node in walk(fn):               # outer nodes first: one finding a line
                hit = _sync(node, params, tensors, masks, src)
                if hit and rpc and _host_copy(node):
                    continue
                if hit and node.lineno not in lines:
                    lines.add(node.lineno)
                    yield ("TL-LINT-004", node,
                           f"{cls.name}.forward: {hit[0]}, so the host waits for the GPU on "
                           f"every call (a host-device sync)", hit[1])
