"""The flow-aware lint rules (graphs kept across iterations, gradients never cleared, host
syncs in ``forward``) and the AST helpers every rule shares. Pure functions of a parsed file:
``ast`` only, nothing runs.

Each check takes the engine's parsed view of one file (``Source`` in :mod:`.lint`: tree,
parents, import aliases, same-file functions) and yields ``(rule, node, message, hint)``;
the engine attaches severity and location and applies suppressions.

Known limitations (all heuristics, chosen to stay quiet on idiomatic code):

* A value "carries a graph" when it comes from calling something named like a model or a
  loss (``model(x)``, ``criterion(out, y)``, ``F.cross_entropy``), is named like a loss, or
  is the receiver of ``.backward()``; a tensor made elsewhere and passed in is not seen.
* Data flow is per function and by line order; aliasing (``a = losses; a.append(loss)``)
  and module-level accumulators written from inside a function are not followed.
* Helpers are followed only when defined in the same file (by name, up to any depth).
"""
from __future__ import annotations

import ast
import re
from typing import Iterator, Optional

__all__ = ["check_kept_graph", "check_grads_never_cleared", "check_forward_syncs"]

SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
LOOPS = (ast.For, ast.AsyncFor, ast.While)
OPTIMIZER = re.compile(r"optim|(^|_)opt(_|\d|s?$)")
_MODEL_CALL = re.compile(r"model|net|criterion|loss|forward|cross_entropy|kl_div|nll|"
                         r"encoder|decoder|classifier")
_NOT_A_CALL_OF_MODEL = re.compile(r"(get|set|build|make|create|init|load|save|register|setup|"
                                  r"configure|prepare|wrap|compile|to|from|num|count|log)_")
_LOSS_NAME = re.compile(r"loss", re.I)
_NOT_A_MODEL = re.compile(r"dict|state|path|file|name|dir|cfg|config|args|url|type|class|cls|"
                          r"fn$|id$")
# Methods whose result holds no graph (or is a Python value).
_DETACHING = {"item", "detach", "detach_", "tolist", "numpy", "argmax", "argmin", "long", "int",
              "bool", "numel", "size", "dim", "state_dict", "grad", "__len__"}
_FACTORIES = {"tensor", "zeros", "ones", "empty", "full", "arange", "randn", "rand", "as_tensor",
              "from_numpy", "zeros_like", "ones_like", "empty_like", "full_like"}
_PLAIN = {"float", "int", "bool", "len", "str", "round", "repr", "format", "isinstance"}
_TORCH_ROOTS = {"torch", "F", "nn", "functional"}


# -- small AST helpers -------------------------------------------------------------------------
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
        stack.extend(c for c in ast.iter_child_nodes(node) if not isinstance(c, SCOPES))


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


def _target_names(target) -> Iterator[str]:
    if isinstance(target, (ast.Tuple, ast.List)):
        for t in target.elts:
            yield from _target_names(t)
    elif isinstance(target, ast.Starred):
        yield from _target_names(target.value)
    else:
        name = dotted(target)
        if name:
            yield name


def _pairs(target, value) -> Iterator[tuple]:
    """(name, value) per bound name; ``a, b = x, y`` pairs element-wise."""
    if isinstance(target, (ast.Tuple, ast.List)) and isinstance(value, (ast.Tuple, ast.List)) \
            and len(target.elts) == len(value.elts):
        for t, v in zip(target.elts, value.elts):
            yield from _pairs(t, v)
    else:
        for name in _target_names(target):
            yield name, value


_INDEXED = {"max", "min", "topk", "sort", "median", "mode", "kthvalue"}


def _values_indices(target, value):
    """``vals, idx = out.max(1)``: the indices carry no graph (a Constant stands in)."""
    if isinstance(target, ast.Tuple) and len(target.elts) == 2 and isinstance(value, ast.Call) \
            and tail(dotted(value.func, loose=True)) in _INDEXED:
        return ast.Tuple(elts=[value, ast.Constant(None)], ctx=ast.Load())
    return value


def _names_in(expr) -> set:
    return {d for n in ast.walk(expr) if isinstance(n, (ast.Name, ast.Attribute))
            for d in [dotted(n)] if d}


# -- TL-LINT-001: a graph kept across iterations -----------------------------------------------
class _Flow:
    """Which names hold a graph-carrying tensor in one scope, by the assignment reaching a use."""

    def __init__(self, src, body):
        self.src, self.defs, self.backward, self._memo = src, {}, set(), {}
        for node in walk_scope(body):
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and node.value:
                for target in getattr(node, "targets", None) or [node.target]:
                    for name, value in _pairs(target, _values_indices(target, node.value)):
                        self.defs.setdefault(name, []).append((pos(node), node, value))
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in ("backward", "manual_backward"):
                # accelerator.backward(loss): the argument is the tensor, not the receiver
                for expr in node.args[:1] or [node.func.value]:
                    calls = {id(c.func) for c in ast.walk(expr) if isinstance(c, ast.Call)}
                    self.backward |= {n.id for n in ast.walk(expr)
                                      if isinstance(n, ast.Name) and id(n) not in calls}
        for defs in self.defs.values():
            defs.sort(key=lambda d: d[0])
        self.consumed = self._consumed()

    def _consumed(self) -> set:
        """Names that flow into a ``.backward()``: accumulating those is building a loss."""
        seen, todo = set(), list(self.backward)
        while todo:
            name = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            for _, _, value in self.defs.get(name, []):
                todo.extend(_names_in(value) - seen)
        return seen

    def carries(self, expr, at) -> bool:
        return self._classify(expr, at) is True

    def _name(self, name, at):
        """By the last assignment before ``at``; with none (an argument, a loop variable),
        names like ``loss`` carry a graph. ``.backward()`` receivers always do."""
        before = [d for d in self.defs.get(name, []) if d[0] < at]
        if not before:
            return True if name in self.backward or _LOSS_NAME.search(tail(name)) else None
        where, stmt, value = before[-1]
        if id(value) not in self._memo:
            self._memo[id(value)] = None                    # cycle guard
            self._memo[id(value)] = False if self.src.in_no_grad(stmt) \
                else self._classify(value, where)
        result = self._memo[id(value)]
        return True if result is None and name in self.backward else result

    def _classify(self, e, at):
        """True: carries a graph; False: surely does not; None: unknown."""
        if isinstance(e, (ast.Constant, ast.JoinedStr, ast.Compare)):
            return False
        if isinstance(e, ast.Name):
            return self._name(e.id, at)
        if isinstance(e, ast.Attribute):
            if e.attr in ("data", "shape", "dtype", "device", "grad", "ndim", "requires_grad"):
                return False
            name = dotted(e)
            if name in self.defs:                            # self.total = ...
                return self._name(name, at)
            base = self._classify(e.value, at)               # out.loss where out = model(x)
            return base if base is False or not (_LOSS_NAME.search(e.attr) or e.attr == "logits") \
                else True
        if isinstance(e, ast.Call):
            return self._call(e, at)
        if isinstance(e, (ast.Subscript, ast.Starred)):
            return self._classify(e.value, at)
        if isinstance(e, ast.UnaryOp):
            return self._classify(e.operand, at)
        if isinstance(e, ast.BinOp):
            return self._any([e.left, e.right], at)
        if isinstance(e, ast.IfExp):
            return self._any([e.body, e.orelse], at)
        if isinstance(e, (ast.Tuple, ast.List, ast.Set)):
            return self._any(e.elts, at)
        if isinstance(e, ast.Dict):
            return self._any(e.values, at)
        return None

    def _any(self, exprs, at):
        """True if any carries a graph, False if none can (or there are none), else None."""
        results = [self._classify(x, at) for x in exprs if x is not None]
        return True if True in results else (None if None in results else False)

    def _call(self, e, at):
        func, name = e.func, dotted(e.func) or ""
        if isinstance(func, ast.Name) and func.id in _PLAIN:
            return False
        if isinstance(func, ast.Name) and func.id == "sum":
            return self._any(e.args[:1], at)
        last = tail(name) if name else getattr(func, "attr", "")
        if last in _DETACHING or last[:1].isupper():          # .item(), Net(...): no graph
            return False
        if (self.src.qualname(func) or name).split(".")[0] in _TORCH_ROOTS:
            if last in _FACTORIES:
                return False
            return self._any([*e.args, *(k.value for k in e.keywords)], at)
        if _MODEL_CALL.search(last.lower()) and not _NOT_A_CALL_OF_MODEL.match(last.lower()):
            return True
        if isinstance(func, ast.Attribute):                  # loss.mean(), out.to(dev)
            return self._classify(func.value, at)
        return None


_APPENDS = {"append": 0, "appendleft": 0, "extend": 0, "insert": 1}


def _accumulation(node):
    """``(container, value)`` when ``node`` stores ``value`` into something that outlives it."""
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
        call = node.value
        if isinstance(call.func, ast.Attribute) and call.func.attr in _APPENDS:
            i = _APPENDS[call.func.attr]
            if len(call.args) > i:
                return call.func.value, call.args[i]
    elif isinstance(node, ast.AugAssign) and isinstance(node.op, (ast.Add, ast.Sub)):
        return node.target, node.value
    elif isinstance(node, ast.Assign) and len(node.targets) == 1:
        target, value = node.targets[0], node.value
        if isinstance(target, ast.Subscript):
            return target.value, value
        if isinstance(value, ast.BinOp) and isinstance(value.op, (ast.Add, ast.Sub)):
            same = ast.unparse(target)
            if ast.unparse(value.left) == same:
                return target, value.right
            if isinstance(value.op, ast.Add) and ast.unparse(value.right) == same:
                return target, value.left
    return None


def _reset_each_iteration(src, loop, name) -> bool:
    """``name`` is re-bound unconditionally in each pass of ``loop`` (``loss = ...``,
    ``outs = []``, ``outs.clear()``, or it is the loop variable itself)."""
    if isinstance(loop, (ast.For, ast.AsyncFor)) and name in set(_target_names(loop.target)):
        return True
    for node in walk_scope(loop.body):
        if isinstance(node, ast.Assign) or (isinstance(node, ast.AnnAssign) and node.value):
            targets = getattr(node, "targets", None) or [node.target]
            reset = name in {n for t in targets for n in _target_names(t)} \
                and name not in _names_in(node.value)
        else:
            reset = isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) \
                and dotted(node.value.func) == f"{name}.clear"
        if reset and all(isinstance(a, (ast.With, ast.AsyncWith, ast.Try))
                         for a in src.ancestors_until(node, loop)):
            return True
    return False


# forward builds the graph on purpose; Lightning runs validation/test/predict under no_grad.
_NO_GRAPH_METHOD = re.compile(r"forward$|(validation|val|test|predict|eval)")
_DATA_ITER = re.compile(r"load|data|batch|\bdl\b", re.I)


def step_loop(src, loop) -> bool:
    """A loop over training/eval steps: it runs backward/step (here or in a same-file helper)
    or iterates something named like a data loader. Loops over layers or heads are not."""
    if {"backward", "step"} & loop_effects(src, loop):
        return True
    return isinstance(loop, (ast.For, ast.AsyncFor)) \
        and bool(_DATA_ITER.search(ast.unparse(loop.iter)))


def _global_in_step(src, scope, name) -> bool:
    """A training-step function (it runs backward or step) filling a module-level container:
    the container outlives every call, so each step's graph is kept."""
    if not isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)) or "." in name or not name:
        return False
    local = {n for node in walk_scope(scope.body) if isinstance(node, (ast.Assign, ast.AnnAssign))
             for t in (getattr(node, "targets", None) or [node.target]) for n in _target_names(t)}
    local |= {a.arg for a in scope.args.args + scope.args.kwonlyargs}
    module = {n for node in src.tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
              for t in (getattr(node, "targets", None) or [node.target]) for n in _target_names(t)}
    return name in module and name not in local and bool({"backward", "step"} & _function_effects(src, scope))


def check_kept_graph(src):
    """TL-LINT-001: ``losses.append(loss)`` / ``total += loss`` keeps every step's graph."""
    for scope, body in src.scopes():
        flow = None
        for node in walk_scope(body):
            acc = _accumulation(node)
            if acc is None or src.in_no_grad(node):
                continue
            container, value = acc
            name = dotted(container, loose=True) or ""
            loop = src.loop_of(node)
            if loop is None:                  # a method filling self.x outlives the call
                if name.startswith("self."):
                    if _NO_GRAPH_METHOD.match(getattr(scope, "name", "")):
                        continue
                elif not _global_in_step(src, scope, name):
                    continue
            elif not step_loop(src, loop) or (name and _reset_each_iteration(src, loop, name)):
                continue
            flow = flow or _Flow(src, body)
            if not flow.carries(value, pos(node)) or name in flow.consumed:
                continue
            text = ast.unparse(value)
            text = text if isinstance(value, (ast.Name, ast.Attribute, ast.Call)) else f"({text})"
            hint = f"store `{text}.item()`, a Python float, or `{text}.detach()` instead"
            if loop is not None and "backward" not in loop_effects(src, loop):
                hint = f"run the loop under `with torch.no_grad():` (no graph is needed), or {hint}"
            yield ("TL-LINT-001", node,
                   f"`{name or ast.unparse(container)}` keeps `{text}` and with it the autograd "
                   f"graph of every step: memory grows each iteration", hint)


# -- TL-LINT-002: gradients never cleared ------------------------------------------------------
def _clears(node) -> bool:
    if isinstance(node, ast.Call):
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
        if name == "zero_grad":
            return True
        recv = dotted(f.value, loose=True) if isinstance(f, ast.Attribute) else None
        return name in ("zero_", "detach_") and (recv or "").endswith(("grad", "grad.data"))
    targets = getattr(node, "targets", None) or [getattr(node, "target", None)]
    return isinstance(node, (ast.Assign, ast.AnnAssign, ast.Delete)) and any(
        isinstance(t, ast.Attribute) and t.attr == "grad" for t in targets)


def effects(src, nodes) -> set:
    """Which of backward / step / clear ``nodes`` do, following same-file helper calls."""
    out = set()
    for node in walk_scope(nodes):
        if _clears(node):
            out.add("clear")
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr in ("backward", "manual_backward"):
            out.add("backward")
        elif is_optimizer_step(node):
            out.add("step")
        callee = f.id if isinstance(f, ast.Name) else (
            f.attr if isinstance(f, ast.Attribute) and dotted(f.value) in ("self", "cls") else None)
        for fn in src.functions.get(callee, []):
            out |= _function_effects(src, fn)
    return out


def _function_effects(src, fn) -> set:
    """``effects`` of a helper's body, plus "nested" when the helper has a training loop of
    its own (that loop is reported, not every loop that calls the helper)."""
    key = ("function", id(fn))
    if key not in src.cache:
        src.cache[key] = set()                   # a recursive call sees what is known so far
        found = effects(src, fn.body)
        if any(_trains(loop_effects(src, n)) for n in walk_scope(fn.body) if isinstance(n, LOOPS)):
            found.add("nested")
        src.cache[key] = found
    return src.cache[key]


def _trains(done: set) -> bool:
    return {"backward", "step"} <= done or "nested" in done


def loop_effects(src, loop) -> set:
    key = ("effects", id(loop))
    if key not in src.cache:
        src.cache[key] = effects(src, loop.body)
    return src.cache[key]


def check_grads_never_cleared(src):
    """TL-LINT-002: a loop that calls ``backward()`` and ``opt.step()`` but never clears grads."""
    for loop in (n for n in src.nodes if isinstance(n, LOOPS)):
        done = loop_effects(src, loop)
        if not {"backward", "step"} <= done or "clear" in done or "nested" in done:
            continue
        inner = [n for n in walk_scope(loop.body) if isinstance(n, LOOPS)]
        if any(_trains(loop_effects(src, n)) for n in inner):
            continue                                   # reported on the inner loop
        yield ("TL-LINT-002", loop,
               "this loop calls backward() and optimizer.step() but never clears gradients: "
               "each step adds to the previous gradients, so updates grow and training diverges",
               "call optimizer.zero_grad(set_to_none=True) once per step, or every k steps "
               "under an `if` when accumulating gradients")


# -- TL-LINT-004: host-device syncs in forward -------------------------------------------------
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
                    inner |= set(_target_names(gen.target))
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
                    names.update(x for x in _target_names(t) if "." not in x)
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
