"""The flow-aware lint rules (graphs kept across iterations, gradients never cleared). Pure
functions of a parsed file: ``ast`` only, nothing runs. The AST helpers every rule shares are
in :mod:`.lint_ast`; host syncs in ``forward`` are in :mod:`.lint_forward`, the single-call
rules in :mod:`.lint_misc`.

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
from typing import Iterator

from .ast_tools import (LOOPS, dotted, is_optimizer_step, pos, tail, target_names, walk,
                       walk_scope)

__all__ = ["check_kept_graph", "check_grads_never_cleared"]

_MODEL_CALL = re.compile(r"model|net|criterion|loss|forward|cross_entropy|kl_div|nll|"
                         r"encoder|decoder|classifier")
_NOT_A_CALL_OF_MODEL = re.compile(r"(get|set|build|make|create|init|load|save|register|setup|"
                                  r"configure|prepare|wrap|compile|to|from|num|count|log)_")
# The last word of a callee named like a model is the model (``model``, ``ddp_model``,
# ``loss_fn``); ``model_owner`` or ``network_config`` are helpers that return something else.
_MODEL_TAIL = re.compile(r"(^|_)(fn|func|function|fwd|wrapped|module|impl|call|step)$")
_LOSS_NAME = re.compile(r"loss", re.I)
# Parts of a loop's iterable that say "a size", not "the data": range(batch_size).
_SIZE_WORD = re.compile(r"\w*(size|len|length|count|num)\w*|\bnum_\w*|\w*_num\b", re.I)
# Methods whose result holds no graph (or is a Python value).
_DETACHING = {"item", "detach", "detach_", "tolist", "numpy", "argmax", "argmin", "long", "int",
              "bool", "numel", "size", "dim", "state_dict", "grad", "__len__"}
_FACTORIES = {"tensor", "zeros", "ones", "empty", "full", "arange", "randn", "rand", "as_tensor",
              "from_numpy", "zeros_like", "ones_like", "empty_like", "full_like"}
_PLAIN = {"float", "int", "bool", "len", "str", "round", "repr", "format", "isinstance"}
_TORCH_ROOTS = {"torch", "F", "nn", "functional"}


# -- AST helpers of the data flow --------------------------------------------------------------
def _pairs(target, value) -> Iterator[tuple]:
    """(name, value) per bound name; ``a, b = x, y`` pairs element-wise."""
    if isinstance(target, (ast.Tuple, ast.List)) and isinstance(value, (ast.Tuple, ast.List)) \
            and len(target.elts) == len(value.elts):
        for t, v in zip(target.elts, value.elts):
            yield from _pairs(t, v)
    else:
        for name in target_names(target):
            yield name, value


_INDEXED = {"max", "min", "topk", "sort", "median", "mode", "kthvalue"}


def _values_indices(target, value):
    """``vals, idx = out.max(1)``: the indices carry no graph (a Constant stands in)."""
    if isinstance(target, ast.Tuple) and len(target.elts) == 2 and isinstance(value, ast.Call) \
            and tail(dotted(value.func, loose=True)) in _INDEXED:
        return ast.Tuple(elts=[value, ast.Constant(None)], ctx=ast.Load())
    return value


def _names_in(expr) -> set:
    return {d for n in walk(expr) if isinstance(n, (ast.Name, ast.Attribute))
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
                    calls = {id(c.func) for c in walk(expr) if isinstance(c, ast.Call)}
                    # (loss / accum).backward(): the divisor (gradient accumulation steps) is a
                    # number, not a tensor whose graph flows into backward
                    calls |= {id(b.right) for b in walk(expr) if isinstance(b, ast.BinOp)
                              and isinstance(b.op, (ast.Div, ast.FloorDiv))}
                    self.backward |= {n.id for n in walk(expr)
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
        defs = self.defs.get(name, [])
        before = [d for d in defs if d[0] < at]
        if not before:
            if name in self.backward:
                return True
            if defs:        # bound later in the scope, or by this very statement: a value carried
                # from the previous iteration (`avg = b * avg + (1 - b) * loss.item()`) is what
                # those bindings make; the name alone (`avg_loss`) says nothing more
                return True if any(self._bound(*d) is True for d in defs) else None
            return True if _LOSS_NAME.search(tail(name)) else None
        result = self._bound(*before[-1])
        return True if result is None and name in self.backward else result

    def _bound(self, where, stmt, value):
        """What one assignment binds (memoised; None while it is being classified)."""
        if id(value) not in self._memo:
            self._memo[id(value)] = None                    # cycle guard
            self._memo[id(value)] = False if self.src.in_no_grad(stmt) \
                else self._classify(value, where)
        return self._memo[id(value)]

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
        if isinstance(e, ast.BinOp):                         # NB: `a + b + c` nests to the left:
            terms = []                                       # walk the chain, do not recurse
            while isinstance(e, ast.BinOp):                  # (a 500-term sum would overflow)
                terms.append(e.right)
                e = e.left
            return self._any([e] + terms[::-1], at)
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
        if _model_call(last.lower()):
            return True
        if isinstance(func, ast.Attribute):                  # loss.mean(), out.to(dev)
            return self._classify(func.value, at)
        return None


def _model_call(last: str) -> bool:
    """``model``, ``self.net``, ``criterion``, ``compute_loss``, ``loss_fn``: the callee's
    last word (after dropping ``_fn``-like suffixes) names a model or a loss."""
    if not _MODEL_CALL.search(last) or _NOT_A_CALL_OF_MODEL.match(last):
        return False
    while _MODEL_TAIL.search(last) and "_" in last:
        last = last.rsplit("_", 1)[0]
    return any(m.end() == len(last) for m in _MODEL_CALL.finditer(last))


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
            if isinstance(target.slice, ast.Constant):    # d["cache"] = x replaces, not grows
                return None
            return target.value, value
        if isinstance(value, ast.BinOp) and isinstance(value.op, (ast.Add, ast.Sub)):
            same = ast.unparse(target)                       # NB: a target is never a BinOp,
            left, right = (None if isinstance(v, ast.BinOp) else v   # so a long sum is not
                           for v in (value.left, value.right))       # unparsed (it recurses)
            if left is not None and ast.unparse(left) == same:
                return target, value.right
            if isinstance(value.op, ast.Add) and right is not None and ast.unparse(right) == same:
                return target, value.left
    return None


def _reset_each_iteration(src, loop, name) -> bool:
    """``name`` is re-bound unconditionally in each pass of ``loop`` (``loss = ...``,
    ``outs = []``, ``outs.clear()``, or it is the loop variable itself)."""
    if isinstance(loop, (ast.For, ast.AsyncFor)) and name in set(target_names(loop.target)):
        return True
    for node in walk_scope(loop.body):
        if isinstance(node, ast.Assign) or (isinstance(node, ast.AnnAssign) and node.value):
            targets = getattr(node, "targets", None) or [node.target]
            reset = name in {n for t in targets for n in target_names(t)} \
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
_DATA_ITER = re.compile(r"loader|data|batch|\bdl\b", re.I)
# A constructor runs once per object, not once per step.
_CONSTRUCTOR = {"__init__", "__post_init__", "__new__", "__init_subclass__", "setup"}


def step_loop(src, loop) -> bool:
    """A loop over training/eval steps: it runs backward/step (here or in a same-file helper)
    or iterates something named like a data loader. Loops over layers or heads are not."""
    if {"backward", "step"} & loop_effects(src, loop):
        return True
    return isinstance(loop, (ast.For, ast.AsyncFor)) \
        and bool(_DATA_ITER.search(_SIZE_WORD.sub("", ast.unparse(loop.iter))))


def _global_in_step(src, scope, name) -> bool:
    """A training-step function (it runs backward or step) filling a module-level container:
    the container outlives every call, so each step's graph is kept."""
    if not isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)) or "." in name or not name:
        return False
    if ("module-names",) not in src.cache:
        src.cache[("module-names",)] = {
            n for node in src.tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
            for t in (getattr(node, "targets", None) or [node.target]) for n in target_names(t)}
    module = src.cache[("module-names",)]
    if name not in module:
        return False
    key = ("local-names", id(scope))
    if key not in src.cache:
        local = {n for node in walk_scope(scope.body) if isinstance(node, (ast.Assign, ast.AnnAssign))
                 for t in (getattr(node, "targets", None) or [node.target]) for n in target_names(t)}
        src.cache[key] = local | {a.arg for a in scope.args.args + scope.args.kwonlyargs}
    local = src.cache[key]
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
                    if _NO_GRAPH_METHOD.match(getattr(scope, "name", "")) \
                            or getattr(scope, "name", "") in _CONSTRUCTOR:
                        continue
                elif not _global_in_step(src, scope, name):
                    continue
            elif not step_loop(src, loop) or (name and _reset_each_iteration(src, loop, name)):
                continue
            if name and name in _names_in(value):
                continue                      # `total += total / n`: no new graph comes in
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


def _per_context_grads(src, loop) -> bool:
    """The loop's steps run in ``with dist_autograd.context() as cid:``: each context holds
    its own gradients (``dist_autograd.backward(cid, ...)``, ``DistributedOptimizer.step(cid)``)
    and drops them when it closes, so there is nothing to clear."""
    for node in walk_scope(loop.body):
        if isinstance(node, (ast.With, ast.AsyncWith)):
            for item in node.items:
                e = item.context_expr
                name = src.qualname(e.func) if isinstance(e, ast.Call) else None
                if name and tail(name) == "context" and "autograd" in name.split("."):
                    return True
    return False


def check_grads_never_cleared(src):
    """TL-LINT-002: a loop that calls ``backward()`` and ``opt.step()`` but never clears grads
    (a distributed autograd context per step has nothing to clear)."""
    for loop in (n for n in src.nodes if isinstance(n, LOOPS)):
        done = loop_effects(src, loop)
        if not {"backward", "step"} <= done or "clear" in done or "nested" in done:
            continue
        if _per_context_grads(src, loop):
            continue
        inner = [n for n in walk_scope(loop.body) if isinstance(n, LOOPS)]
        if any(_trains(loop_effects(src, n)) for n in inner):
            continue                                   # reported on the inner loop
        yield ("TL-LINT-002", loop,
               "this loop calls backward() and optimizer.step() but never clears gradients: "
               "each step adds to the previous gradients, so updates grow and training diverges",
               "call optimizer.zero_grad(set_to_none=True) once per step, or every k steps "
               "under an `if` when accumulating gradients")
