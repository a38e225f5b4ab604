"""The package layout shows the pipeline ``tracer -> record -> analyzers -> findings -> render
-> cli``: no import runs back up it. Read from the source (every import statement, those inside
functions included), so a lazy import cannot hide a wrong-way dependency."""
from __future__ import annotations

import ast
import functools
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(REPO, "torchledger")

#: Layer of each top-level part: a module may import from its own layer and those below.
LAYERS = {
    # data and plumbing every layer may read
    "units": 0, "inputs": 0, "rules": 0, "record": 0, "record_json": 0, "record_schema": 0,
    "spec": 0, "models": 0, "settings": 0, "__init__": 0,
    "formulas": 1,          # closed forms: pure arithmetic
    "tracer": 2,            # observes a step, builds the record
    "analyzers": 3,         # judge records (and the closed forms)
    "lint": 3,              # judge source files
    "render": 4,            # records and findings -> text
    "ledger": 5, "audit": 5, "world": 5, "parallel": 5,  # compose tracer, analyzers and renderers
    "cli": 6, "__main__": 6,
    "testing": 6, "pytest_plugin": 6, "integrations": 6,   # where users already work
}
#: The record's own convenience methods that INTERFACE.md asks for (``record.to_trace()``,
#: ``record.save(path)``) hand the work to the renderers, imported inside the method.
DELEGATIONS = {("torchledger.record", "torchledger.render.trace_events"),
               ("torchledger.record", "torchledger.render.output")}
#: Parts that never import one another although their layers would allow it.
SEPARATE = {("analyzers", "lint"), ("lint", "analyzers"), ("lint", "tracer"), ("analyzers", "tracer"),
            ("formulas", "tracer"), ("formulas", "models.transformer"), ("formulas", "models.cruncher")}


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
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            yield target, node.lineno
            for a in node.names:        # ``from . import analyzers`` names a module too
                yield f"{target}.{a.name}", node.lineno


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
    ("tracer", ("analyzers", "lint", "render", "ledger", "audit", "cli")),
    ("render", ("analyzers", "lint", "tracer", "ledger", "audit", "cli")),
    ("formulas", ("tracer", "analyzers", "lint", "render", "ledger", "audit", "cli")),
    ("lint", ("tracer", "analyzers", "ledger", "audit", "cli")),
])
def test_the_issue_s_named_directions(part, forbidden):
    hits = [f"{where}: {target}" for module, target, where in _edges()
            if _part(module) == part and _part(target) in forbidden]
    assert not hits, "\n".join(hits)


@pytest.mark.parametrize("part", ["formulas", "lint", "rules"])
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
