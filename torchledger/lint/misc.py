"""The single-call lint rules: ``torch.load`` without ``weights_only=True`` (TL-LINT-003),
``non_blocking`` copies with nothing pinned (TL-LINT-005), the model moved to a device inside
the training loop (TL-LINT-006), a whole module passed to ``torch.save`` (TL-LINT-007),
``backward(retain_graph=True)`` in a loop (TL-LINT-008) and a checkpoint without optimizer
state (TL-LINT-009). Each looks at one call (and at most the loop or dict around it) in the
engine's parsed file (see :mod:`.lint_rules`), ``ast`` only.
"""
from __future__ import annotations

import ast

from .ast_tools import OPTIMIZER, dotted, is_const, kwarg, model_like, tail, walk_scope
from .loops import loop_effects, step_loop

__all__ = ["check_unsafe_load", "check_non_blocking", "check_model_moves", "check_module_save",
           "check_retain_graph", "check_checkpoint", "module_saves"]


def module_saves(src) -> list:
    """The file's ``torch.save(model, ...)`` calls: whole modules pickled (TL-LINT-007)."""
    return [call for call in src.calls
            if src.qualname(call.func) == "torch.save" and call.args
            and isinstance(call.args[0], (ast.Name, ast.Attribute)) and model_like(dotted(call.args[0]))]


def _loads_state_dict(src, call) -> bool:
    """The load's result goes to ``load_state_dict`` (directly, or through the name it is
    assigned to, ``ckpt["model"]`` included): a state dict, which weights_only=True loads."""
    target = src.parents.get(call)
    names = set()
    if isinstance(target, ast.Assign):
        names = {t.id for t in target.targets if isinstance(t, ast.Name)}
    for c in src.calls:
        if not (isinstance(c.func, ast.Attribute) and c.func.attr == "load_state_dict"):
            continue
        for arg in list(c.args) + [k.value for k in c.keywords]:
            inside = list(ast.walk(arg))
            if any(n is call for n in inside) or any(isinstance(n, ast.Name) and n.id in names for n in inside):
                return True
    return False


def _whole_module_load(src, call):
    """(warning, hint) for a bare ``torch.load`` in a file or tree that pickles whole modules
    (:func:`module_saves` here, ``src.tree_saves`` in the other files linted with it), unless
    the load feeds ``load_state_dict``: torch >= 2.6 loads with weights_only=True, which
    refuses a pickled module (``UnpicklingError: Weights only load failed``)."""
    here = [f"{src.path}:{c.lineno}" for c in module_saves(src)]
    saves = here + [s for s in getattr(src, "tree_saves", ()) if s not in here]
    if not saves or _loads_state_dict(src, call):
        return None
    where = ", ".join(saves[:3]) + (f" and {len(saves) - 3} more" if len(saves) > 3 else "")
    return ("TL-LINT-003", call,
            f"torch.load() without weights_only, where this code pickles whole modules (torch.save of "
            f"a model at {where}): torch >= 2.6 loads with weights_only=True and fails on such a "
            f"file (UnpicklingError: Weights only load failed); torch < 2.6 unpickles arbitrary objects",
            "save model.state_dict() and load it into a built model with "
            "model.load_state_dict(torch.load(path, weights_only=True)); for a module file you made "
            "and trust, pass weights_only=False")


def check_unsafe_load(src):
    """TL-LINT-003: ``torch.load(path)`` with ``weights_only=False`` (warning: it unpickles
    arbitrary objects on every torch version), or without ``weights_only`` (info: a portability
    note, since torch >= 2.6 defaults to ``weights_only=True`` and only older versions unpickle;
    a warning where the file or tree pickles whole modules, which that default fails to load:
    :func:`_whole_module_load`)."""
    for call in src.calls:
        if src.qualname(call.func) != "torch.load" or any(k.arg is None for k in call.keywords):
            continue
        flag = kwarg(call, "weights_only")
        if flag is not None and is_const(flag, False):
            yield ("TL-LINT-003", call,
                   "torch.load() with weights_only=False unpickles arbitrary objects: a malicious "
                   "checkpoint can execute code when loaded",
                   "pass weights_only=True to load only tensors, dicts and primitives; allow "
                   "your own trusted classes with torch.serialization.add_safe_globals")
        elif flag is None and (hit := _whole_module_load(src, call)) is not None:
            yield hit
        elif flag is None:
            yield ("TL-LINT-003", call,
                   "torch.load() without weights_only: safe on torch >= 2.6 (its default is "
                   "weights_only=True), but torch < 2.6 unpickles arbitrary objects here",
                   "pass weights_only=True to load the same way on every torch version", "info")


def check_non_blocking(src):
    """TL-LINT-005: ``.to(dev, non_blocking=True)`` of a batch, with nothing in the file
    pinning memory. Only data code is judged: a file that builds a DataLoader, or copies inside
    a loop over batches (elsewhere the source is usually already on a device)."""
    for call in src.calls:
        pin = kwarg(call, "pin_memory")
        if (pin is not None and not is_const(pin, False)) \
                or tail(dotted(call.func, True)) == "pin_memory":
            return                                    # something is pinned: trust it
    data_file = any(tail(src.qualname(c.func)) == "DataLoader" for c in src.calls)
    for call in src.calls:
        f = call.func
        if not (isinstance(f, ast.Attribute) and f.attr in ("to", "cuda", "copy_")
                and is_const(kwarg(call, "non_blocking"), True)):
            continue
        target = kwarg(call, "device") or (call.args[0] if call.args and f.attr == "to" else None)
        if isinstance(target, ast.Constant) and str(target.value).startswith("cpu"):
            continue                                  # device-to-host: a different story
        if not (data_file or _in_step_loop(src, call)):
            continue
        yield ("TL-LINT-005", call,
               f"`{ast.unparse(call)}` asks for an asynchronous copy but nothing in this file "
               f"pins memory: from pageable memory the copy is synchronous anyway",
               "build the DataLoader with pin_memory=True, or call .pin_memory() on the batch, "
               "so the host-to-device copy can overlap compute")


def _in_step_loop(src, node) -> bool:
    loop = src.loop_of(node)
    while loop is not None and not step_loop(src, loop):
        loop = src.loop_of(loop)
    return loop is not None


def check_model_moves(src):
    """TL-LINT-006: ``model.to(device)`` inside a loop that trains."""
    for call in src.calls:
        f, stmt = call.func, src.parents.get(call)
        if not (isinstance(f, ast.Attribute) and f.attr in ("to", "cuda")
                and isinstance(f.value, (ast.Name, ast.Attribute)) and model_like(dotted(f.value))):
            continue
        if not (isinstance(stmt, ast.Expr) or (isinstance(stmt, ast.Assign) and
                                               dotted(stmt.targets[0]) == dotted(f.value))):
            continue                                  # DDP(model.cuda()) builds something new
        loop = src.loop_of(call)
        while loop is not None and "backward" not in loop_effects(src, loop):
            loop = src.loop_of(loop)
        if loop is not None:
            yield ("TL-LINT-006", call,
                   f"`{ast.unparse(call)}` runs on every iteration of the training loop "
                   f"(line {loop.lineno}): it walks all parameters each step",
                   "move the model to its device once, before the loop and before building "
                   "the optimizer")


def check_module_save(src):
    """TL-LINT-007: ``torch.save(model, path)`` pickles the whole module."""
    for call in module_saves(src):
        name = ast.unparse(call.args[0])
        yield ("TL-LINT-007", call,
               f"torch.save({name}, ...) pickles the whole module: loading it needs the same "
               f"class at the same import path and weights_only=False",
               f"save {name}.state_dict() and rebuild the model before load_state_dict()")


def check_retain_graph(src):
    """TL-LINT-008: ``loss.backward(retain_graph=True)`` inside a loop."""
    for call in src.calls:
        f = call.func
        if isinstance(f, ast.Attribute) and f.attr == "backward" \
                and is_const(kwarg(call, "retain_graph"), True) and src.loop_of(call) is not None:
            yield ("TL-LINT-008", call,
                   "backward(retain_graph=True) in a loop keeps the graph's saved activations "
                   "alive; if any tensor is carried to the next step, memory grows every iteration",
                   "drop retain_graph, or detach state carried across steps: h = h.detach(); "
                   "for several losses, sum them and call backward once")


def _checkpoint_dict(src, expr, call):
    """The dict literal saved by ``torch.save(expr, ...)``, following one local name."""
    if isinstance(expr, ast.Name):
        scope = list(walk_scope(src.scope_of(call)))
        stores = [n for n in scope if isinstance(n, ast.Assign)
                  and n.lineno < call.lineno and any(dotted(t) == expr.id for t in n.targets)]
        changed = any(isinstance(n, ast.Subscript) and isinstance(n.ctx, ast.Store)
                      and dotted(n.value) == expr.id for n in scope) or any(
            isinstance(n, ast.Call) and dotted(n.func) == f"{expr.id}.update" for n in scope)
        expr = None if changed or not stores else stores[-1].value
    if isinstance(expr, ast.Dict):
        return [k for k in expr.keys if k is not None], expr.values
    if isinstance(expr, ast.Call) and dotted(expr.func) == "dict":
        return ([ast.Constant(k.arg) for k in expr.keywords if k.arg],
                [k.value for k in expr.keywords])
    return None


#: torch.optim's classes (and the usual outside ones), by the name a file calls them with.
_OPTIMIZER_CLASSES = frozenset("""
    SGD Adam AdamW Adagrad Adadelta Adamax NAdam RAdam RMSprop Rprop ASGD LBFGS SparseAdam Adafactor
    Muon Lion LAMB Lamb FusedAdam FusedLAMB DeepSpeedCPUAdam Adam8bit AdamW8bit PagedAdamW
""".split())


def _stateless_optimizers(src) -> bool:
    """Every optimizer the file builds is plain SGD (no momentum: ``state`` stays empty) and
    no LR scheduler is built: a checkpoint of the model alone resumes it exactly. False when
    the file builds none (it may get a stateful one from elsewhere)."""
    built = [c for c in src.calls if tail(src.qualname(c.func)) in _OPTIMIZER_CLASSES]
    if not built or any(tail(src.qualname(c.func)) != "SGD" for c in built):
        return False
    for c in src.calls:                               # StepLR, lr_scheduler.*, get_*_schedule_*
        name = src.qualname(c.func) or ""
        if "lr_scheduler" in name or tail(name).endswith("LR") or "schedul" in tail(name).lower():
            return False
    for call in built:
        momentum = kwarg(call, "momentum")
        if len(call.args) > 2 or any(k.arg is None for k in call.keywords):
            return False                              # momentum given by position, or **options
        if momentum is not None and not (isinstance(momentum, ast.Constant) and momentum.value == 0):
            return False
    return True


def check_checkpoint(src):
    """TL-LINT-009: a checkpoint dict with a model state_dict and no optimizer state (unless
    the only optimizer built is plain SGD without momentum: it has no state)."""
    saves = [c for c in src.calls if c.args and src.qualname(c.func) == "torch.save"]
    if not saves or not any(OPTIMIZER.search(tail(dotted(n) or "").lower()) for n in src.nodes
                            if isinstance(n, (ast.Name, ast.Attribute))):
        return                                        # no optimizer here: an export, not a resume
    if _stateless_optimizers(src):
        return
    for call in saves:
        found = _checkpoint_dict(src, call.args[0], call)
        if found is None:
            continue
        keys, values = found
        texts = [str(k.value).lower() for k in keys if isinstance(k, ast.Constant)]
        states = [dotted(v.func.value, True) for v in values if isinstance(v, ast.Call)
                  and isinstance(v.func, ast.Attribute) and v.func.attr == "state_dict"]
        if not (any(model_like(s) for s in states) or any("model" in t for t in texts)):
            continue                                  # not a model checkpoint
        if any(OPTIMIZER.search(t) or "optim" in t for t in texts) \
                or any(OPTIMIZER.search(tail(s).lower()) for s in states if s) \
                or len(keys) < len(values):           # **extra: cannot tell
            continue
        yield ("TL-LINT-009", call,
               "this checkpoint saves the model but no optimizer state: a run resumed from it "
               "restarts the optimizer's moments (and LR schedule) and diverges",
               "add 'optimizer': optimizer.state_dict(), plus the scheduler, step and RNG state")
