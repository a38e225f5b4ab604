"""The package layout shows the pipeline (docs/architecture.md): model file -> world and plan
(``audit``, ``parallel``) -> traced step (``tracer``) -> record (``record``) -> checks and
predictions (``steptime``, ``analyzers``) -> reports (``render``) -> commands (``cli``). No import
runs back up it, no module imports a circle, none takes another module's private names. Read
from the source (every import statement, those inside functions included), so a lazy import
cannot hide a wrong-way dependency."""
from __future__ import annotations

import ast
import functools
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(REPO, "torchledger")

#: Layer of each room (top-level part): a module may import from its own layer and those below.
LAYERS = {
    # shared leaves every layer may read, and the record
    "units": 0, "rules": 0, "settings": 0, "inputs": 0, "errors": 0, "files": 0, "__init__": 0,
    "record": 0, "models": 0,
    "formulas": 1,          # closed forms: pure arithmetic
    "tracer": 2,            # observes a step, builds the record
    "parallel": 2,          # the layout parser and the standard plans (torch's own APIs)
    "steptime": 3,          # the time model: reads records and formulas, never hooks
    "analyzers": 4,         # checks: judge records (and the closed forms, and the time model)
    "lint": 4,              # judge source files
    "render": 5,            # records and findings -> text
    "ledger": 6, "audit": 6,   # compose tracer, plans, checks and renderers
    "plan": 6,              # searches layouts by auditing them (audit's room, beside it)
    "cli": 7, "__main__": 7,
    "testing": 7, "pytest_plugin": 7, "integrations": 7,   # where users already work
    # deprecated import paths kept for a release: they may import anything, nothing imports them
    "spec": 8, "world": 8, "record_json": 8, "record_schema": 8,
}
#: The deprecated paths (see LAYERS); no module of the package imports them.
COMPAT = {"torchledger.spec", "torchledger.world", "torchledger.record_json", "torchledger.record_schema",
          "torchledger.analyzers.calibrate"}
#: The record's own convenience methods that INTERFACE.md asks for (``record.save(path)``) hand
#: the work to shared leaves; nothing runs back up now.
DELEGATIONS: set = set()
#: Parts that never import one another although their layers would allow it.
SEPARATE = {("analyzers", "lint"), ("lint", "analyzers"), ("lint", "tracer"), ("analyzers", "tracer"),
            ("formulas", "tracer"), ("formulas", "models.transformer"), ("formulas", "models.cruncher"),
            ("steptime", "tracer"), ("steptime", "parallel"), ("parallel", "tracer"), ("tracer", "parallel")}


def _modules():
    for root, _, files in os.walk(PACKAGE):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(root, name)
                rel = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
                yield path, rel[:-len(".__init__")] if rel.endswith(".__init__") else rel, name == "__init__.py"


def _imports(path: str, module: str, is_package: bool):
    """Every module an import statement in ``path`` names, as absolute dotted names."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            target = _target(node, package)
            yield target, node.lineno
            for a in node.names:        # ``from . import analyzers`` names a module too
                yield f"{target}.{a.name}", node.lineno


def _target(node, package: str) -> str:
    """The absolute module an ``ImportFrom`` names, its relative dots resolved in ``package``."""
    if not node.level:
        return node.module or ""
    base = package.split(".")
    base = base[:len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _part(dotted: str):
    """``torchledger.tracer.step`` -> ``tracer``; None outside the package."""
    parts = dotted.split(".")
    if parts[0] != "torchledger":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


@functools.lru_cache(maxsize=1)
def _edges() -> tuple:
    """Every import of the package once per session (each test reads the same edges)."""
    return tuple((module, target, f"{os.path.relpath(path, REPO)}:{line}")
                 for path, module, is_package in _modules()
                 for target, line in _imports(path, module, is_package))


def test_every_part_has_a_layer():
    parts = {_part(m) for _, m, _ in _modules()}
    assert parts <= set(LAYERS), parts - set(LAYERS)


def test_no_import_runs_back_up_the_pipeline():
    wrong = []
    for module, target, where in _edges():
        src, dst = _part(module), _part(target)
        if dst is None or dst not in LAYERS or src not in LAYERS:
            continue
        if LAYERS[dst] > LAYERS[src] and (module, target.rpartition(".")[0]) not in DELEGATIONS \
                and (module, target) not in DELEGATIONS:
            wrong.append(f"{where}: {module} (layer {LAYERS[src]}) imports {target} (layer {LAYERS[dst]})")
        rest = target.split(".", 2)[2] if target.count(".") >= 2 else ""
        if (src, dst) in SEPARATE or (src, f"{dst}.{rest.split('.')[0]}") in SEPARATE:
            wrong.append(f"{where}: {module} imports {target}, a part it must stay apart from")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("part,forbidden", [
    ("tracer", ("analyzers", "lint", "render", "ledger", "audit", "cli", "steptime", "parallel")),
    ("steptime", ("tracer", "parallel", "analyzers", "lint", "render", "ledger", "audit", "cli")),
    ("parallel", ("tracer", "steptime", "analyzers", "lint", "render", "ledger", "audit", "cli")),
    ("record", ("tracer", "steptime", "parallel", "analyzers", "lint", "render", "ledger", "audit", "cli")),
    ("render", ("analyzers", "lint", "tracer", "ledger", "audit", "cli")),
    ("formulas", ("tracer", "analyzers", "lint", "render", "ledger", "audit", "cli")),
    ("lint", ("tracer", "analyzers", "ledger", "audit", "cli")),
])
def test_the_issue_s_named_directions(part, forbidden):
    hits = [f"{where}: {target}" for module, target, where in _edges()
            if _part(module) == part and _part(target) in forbidden]
    assert not hits, "\n".join(hits)


@pytest.mark.parametrize("part", ["formulas", "lint", "rules", "steptime"])
def test_pure_parts_import_no_torch(part):
    hits = [f"{where}: {target}" for module, target, where in _edges()
            if _part(module) == part and target.split(".")[0] in ("torch", "numpy", "pandas")]
    assert not hits, "\n".join(hits)
    # and nothing they import pulls torch in either
    code = f"import sys, torchledger.{part}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_each_folder_says_what_lives_there():
    for root, dirs, files in os.walk(PACKAGE):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        if not any(f.endswith(".py") for f in files):
            continue
        assert "__init__.py" in files, f"{os.path.relpath(root, REPO)} has no __init__.py"
        with open(os.path.join(root, "__init__.py"), encoding="utf-8") as f:
            doc = ast.get_docstring(ast.parse(f.read()))
        assert doc and len(doc.split()) >= 8, f"{os.path.relpath(root, REPO)}/__init__.py has no docstring"


def test_the_checker_sees_a_wrong_way_import(tmp_path):
    # the reader resolves relative imports inside functions: plant one and find it
    fake = tmp_path / "step.py"
    fake.write_text("def f():\n    from ..analyzers.checks import run_checks\n")
    found = list(_imports(str(fake), "torchledger.tracer.step", False))
    assert ("torchledger.analyzers.checks", 2) in found
    assert _part(found[0][0]) == "analyzers" and LAYERS["analyzers"] > LAYERS["tracer"]


# -- modules, not only rooms ------------------------------------------------------------------------
def _module_graph() -> dict:
    """module -> the package modules it imports (a name imported from a package counts as its
    module when it is one, else as the package), every import statement included."""
    known = {m for _, m, _ in _modules()}
    graph: dict = {m: set() for m in known}
    for module, target, _ in _edges():
        if target in known and target != module:
            graph[module].add(target)
    return graph


def _circles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]; counter[0] += 1; stack.append(root); on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]; counter[0] += 1; stack.append(w); on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop(); on.discard(w); comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_module_imports_a_circle():
    graph = _module_graph()
    # a package's __init__ that re-exports its own modules is not a circle with them
    for m in graph:
        graph[m] = {t for t in graph[m] if not m.startswith(t + ".")}
    assert _circles(graph) == []


def test_the_circle_finder_finds_one():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def _private_imports():
    known = {m for _, m, _ in _modules()}
    hits = []
    for path, module, is_package in _modules():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        package = module if is_package else module.rpartition(".")[0]
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            target = _target(node, package)
            if not target.startswith("torchledger"):
                continue
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__") and f"{target}.{a.name}" not in known:
                    hits.append(f"{os.path.relpath(path, REPO)}:{node.lineno}: {module} takes {target}.{a.name}")
    return hits


def test_no_module_takes_another_s_private_names():
    assert _private_imports() == []


def test_nothing_imports_the_deprecated_paths():
    hits = [f"{where}: {target}" for module, target, where in _edges()
            if target in COMPAT and module not in COMPAT]
    assert not hits, "\n".join(hits)


@pytest.mark.parametrize("name", sorted(COMPAT))
def test_the_deprecated_paths_still_work_and_say_so(name):
    code = (f"import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
            f"try:\n    import {name}\nexcept DeprecationWarning as e:\n    print('warned', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("warned") and "deprecated" in out.stdout


def test_old_public_paths_still_resolve():
    # what users imported before the rooms: the same objects, from the new homes
    import importlib
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert importlib.import_module("torchledger.spec").AuditSpec is importlib.import_module(
            "torchledger.audit.spec").AuditSpec
        assert importlib.import_module("torchledger.world").parse_mesh("8x8") == (8, 8)
    import torchledger
    from torchledger.analyzers.steptime import predict_step_time
    from torchledger.audit import run_audit
    from torchledger.record import Finding, StepRecord
    from torchledger.steptime.predict import predict_step_time as p2
    assert predict_step_time is p2 and callable(run_audit)
    assert torchledger.AuditSpec is importlib.import_module("torchledger.audit.spec").AuditSpec
    assert torchledger.StepRecord is StepRecord and torchledger.Finding is Finding


@pytest.mark.parametrize("room", ["record", "audit", "steptime", "parallel.layout", "cli", "errors", "files"])
def test_importing_a_light_room_loads_no_torch(room):
    """The command line forks the audit's child before torch is imported (audit/supervise.py):
    the rooms it goes through must not pull torch in at import."""
    code = f"import sys, torchledger.{room}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# -- function-local imports ----------------------------------------------------------------------------
_HEAVY = ("torch", "numpy", "pandas", "transformers", "lightning", "accelerate", "pytest", "tabulate")


def _heavy_modules() -> set:
    """Package modules whose import loads a heavy library (directly at their top level, or
    through another package module they import at top level, or their parent package)."""
    known = {m: (p, pkg) for p, m, pkg in _modules()}
    top: dict = {m: set() for m in known}
    heavy = set()
    for m, (path, is_package) in known.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        package = m if is_package else m.rpartition(".")[0]
        for node in tree.body:
            for sub in ast.walk(node) if isinstance(node, ast.Try) else (node,):
                if isinstance(sub, ast.Import):
                    names = [a.name for a in sub.names]
                elif isinstance(sub, ast.ImportFrom):
                    target = _target(sub, package)
                    names = [target] + [f"{target}.{a.name}" for a in sub.names]
                else:
                    continue
                for n in names:
                    if n.split(".")[0] in _HEAVY:
                        heavy.add(m)
                    if n in known:
                        top[m].add(n)
    grew = True
    while grew:
        grew = False
        for m in known:
            parents = {".".join(m.split(".")[:i]) for i in range(2, len(m.split(".")))}
            if m not in heavy and (top[m] | parents) & heavy:
                heavy.add(m)
                grew = True
    return heavy


def test_function_local_imports_save_a_heavy_import_or_say_why():
    """A function-local import of a package module hides a dependency from readers and tools:
    only where the module it names is heavy (loads torch, pandas, ...) or the line says why."""
    heavy = _heavy_modules()
    hits = []
    for path, module, is_package in _modules():
        with open(path, encoding="utf-8") as f:
            source = f.read()
        lines = source.splitlines()
        package = module if is_package else module.rpartition(".")[0]
        for fn in ast.walk(ast.parse(source, path)):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if not isinstance(node, ast.ImportFrom) or not (node.level or (node.module or "").startswith("torchledger")):
                    continue
                target = _target(node, package)
                named = {f"{target}.{a.name}" for a in node.names} | {target}
                if named & heavy or any("#" in lines[i] for i in range(node.lineno - 1, node.end_lineno)):
                    continue
                hits.append(f"{os.path.relpath(path, REPO)}:{node.lineno}: from {target} import "
                            f"{', '.join(a.name for a in node.names)}")
    assert not hits, "move these to the module's top, or say on the line why they wait:\n" + "\n".join(hits)


def test_the_heavy_finder_sees_torch_through_the_tracer():
    heavy = _heavy_modules()
    assert {"torchledger.tracer.step", "torchledger.ledger", "torchledger.audit.engine"} <= heavy
    assert not {"torchledger.formulas.steptime", "torchledger.record.core", "torchledger.steptime.predict"} & heavy


#: Where no function may run past LONGEST lines (issue 34: the audit and prediction paths read as
#: sequences of named steps). NB: ``tracer/dispatch.py``'s ``LedgerMode._record`` stays one
#: function on purpose (it runs once per traced op; its comment says why), so the tracer is not
#: listed whole.
SHORT_FUNCTIONS = ("audit", "steptime", "parallel", "plan", os.path.join("tracer", "build.py"),
                   os.path.join("analyzers", "compare.py"))
LONGEST = 80


def _long_functions(paths, longest: int = LONGEST) -> list:
    """``path:line name (n lines)`` for each function (methods and nested ones too) in the
    files or folders ``paths`` longer than ``longest`` lines, counted from its ``def`` to its
    last line."""
    files = []
    for p in paths:
        files += [p] if p.endswith(".py") else sorted(os.path.join(root, n) for root, _, names in os.walk(p)
                                                      for n in names if n.endswith(".py"))
    hits = []
    for path in files:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = fn.end_lineno - fn.lineno + 1
                if n > longest:
                    hits.append(f"{os.path.relpath(path, REPO)}:{fn.lineno} {fn.name} ({n} lines)")
    return hits


def test_no_function_in_the_audit_and_prediction_paths_is_long():
    long = _long_functions([os.path.join(PACKAGE, p) for p in SHORT_FUNCTIONS])
    assert not long, (f"functions over {LONGEST} lines (split them into named steps):\n" + "\n".join(long))


def test_the_length_checker_counts_def_to_end(tmp_path):
    # def line + 79 body lines = 80 lines: allowed; one more body line = 81: reported
    body = "\n".join(f"    x{i} = {i}" for i in range(79))
    (tmp_path / "ok.py").write_text(f"def fits():\n{body}\n")
    (tmp_path / "long.py").write_text(f"class C:\n    @staticmethod\n    def grows():\n"
                                      + "\n".join(f"        x{i} = {i}" for i in range(80)) + "\n")
    assert _long_functions([str(tmp_path / "ok.py")]) == []
    long = _long_functions([str(tmp_path)])
    assert len(long) == 1 and long[0].endswith("long.py:3 grows (81 lines)"), long
