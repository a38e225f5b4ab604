"""The CI recipes work: examples/ci/torchledger.yml (GitHub Actions) and .pre-commit-hooks.yaml.

The workflow is parsed and its shape checked (what code scanning needs: the permission, the
upload action, a SARIF file that each upload names and a step before it writes), then every
`run:` step that does not install packages is run locally with bash, as Actions runs it
(`bash -eo pipefail`), in a throwaway git repository with an `origin` whose default branch
holds the model file: the baseline comes from that branch in a git worktree, and the audit of
a pull request that grew the model fails with TL-BASELINE-001 in valid SARIF. `torchledger`
on PATH is a shim running this checkout (the install steps are checked, not run: they would
download torch). The hooks run through pre-commit itself.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys

import pytest

yaml = pytest.importorskip("yaml", reason="the workflow test needs pyyaml (pip install -e '.[test]')")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKFLOW = os.path.join(ROOT, "examples", "ci", "torchledger.yml")
HOOKS = os.path.join(ROOT, ".pre-commit-hooks.yaml")
#: The values the workflow's ${{ }} expressions take in these local runs.
EXPRESSIONS = {"github.event.repository.default_branch": "main"}
_GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com", "GIT_COMMITTER_NAME": "t",
            "GIT_COMMITTER_EMAIL": "t@example.com", "GIT_CONFIG_GLOBAL": os.devnull,
            "GIT_CONFIG_NOSYSTEM": "1"}

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def load_workflow() -> dict:
    with open(WORKFLOW, encoding="utf-8") as fh:
        wf = yaml.safe_load(fh)
    wf["on"] = wf.pop(True, wf.get("on"))        # YAML 1.1 reads the key `on` as true
    return wf


def git(*args, cwd) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True,
                          env={**os.environ, **_GIT_ENV}).stdout


def shim(tmp_path) -> str:
    """A bin folder whose `torchledger` runs this checkout (whatever is installed)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "torchledger"
    exe.write_text(f'#!/bin/sh\nPYTHONPATH="{ROOT}" exec "{sys.executable}" -m torchledger "$@"\n')
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return str(bin_dir)


def check_sarif(doc: dict, root) -> list:
    """Problems of a SARIF 2.1.0 log as GitHub code scanning reads it ([] when fine)."""
    errs = []
    if doc.get("version") != "2.1.0" or not doc.get("runs"):
        return ["not a SARIF 2.1.0 log with runs"]
    run = doc["runs"][0]
    driver = run["tool"]["driver"]
    rules = {r["id"] for r in driver.get("rules", [])}
    if driver.get("name") != "torchledger":
        errs.append(f"tool name {driver.get('name')!r}")
    for res in run["results"]:
        if res.get("ruleId") not in rules:
            errs.append(f"{res.get('ruleId')}: not among the driver's rules")
        if res.get("level") not in ("error", "warning", "note", "none"):
            errs.append(f"{res.get('ruleId')}: level {res.get('level')!r}")
        if not res.get("message", {}).get("text"):
            errs.append(f"{res.get('ruleId')}: no message text")
        if not res.get("locations"):
            errs.append(f"{res.get('ruleId')}: no location (code scanning rejects it)")
        for loc in res.get("locations", []):
            phys = loc["physicalLocation"]
            uri, line = phys["artifactLocation"]["uri"], phys["region"]["startLine"]
            if uri.startswith(("/", "../", "file:")) or not os.path.isfile(os.path.join(root, uri)):
                errs.append(f"{res['ruleId']}: uri {uri!r} is not a file of the checkout")
            if not (type(line) is int and line >= 1):
                errs.append(f"{res['ruleId']}: startLine {line!r}")
    return errs


# -- the workflow's shape ------------------------------------------------------------------------
def _writes(script: str):
    """The file a run script writes its SARIF to (--output X or > X)."""
    m = re.search(r"(?:--output|>)\s*(\S+\.sarif)\b", script)
    return m.group(1) if m else None


def test_workflow_shape():
    wf = load_workflow()
    assert "pull_request" in wf["on"]
    assert wf["permissions"]["security-events"] == "write"       # upload-sarif needs it
    assert set(wf["jobs"]) == {"audit", "lint"}
    for name, job in wf["jobs"].items():
        steps = job["steps"]
        assert steps[0]["uses"].startswith("actions/checkout@")
        uploads = [i for i, s in enumerate(steps) if s.get("uses", "").startswith("github/codeql-action/upload-sarif@")]
        assert len(uploads) == 1, name
        up = steps[uploads[0]]
        written = [_writes(s["run"]) for s in steps[:uploads[0]] if "run" in s]
        assert up["with"]["sarif_file"] in written, (name, written)
        # uploaded also when the step before failed on findings (exit 1), never when nothing was written
        assert up["if"].startswith("always()") and f"hashFiles('{up['with']['sarif_file']}')" in up["if"]
        for s in steps:
            if "run" in s:
                assert "${{" not in s["run"], f"{s['name']}: expressions go in env, so the script runs as is"
    audit = "\n".join(s.get("run", "") for s in wf["jobs"]["audit"]["steps"])
    install = [s["run"] for s in wf["jobs"]["audit"]["steps"] if s.get("name", "").startswith("Install")][0]
    assert install.index("download.pytorch.org/whl/cpu") < install.index('"$TORCHLEDGER"')   # CPU torch first
    assert "--baseline" in audit and "git worktree add" in audit and "--format sarif" in audit
    lint_install = [s["run"] for s in wf["jobs"]["lint"]["steps"] if s.get("name", "").startswith("Install")][0]
    assert "--no-deps" in lint_install and "torch " not in lint_install          # lint needs no torch


# -- the workflow, run locally ---------------------------------------------------------------------
def _env(wf, job, tmp_path, repo) -> dict:
    env = {**os.environ, **_GIT_ENV}
    env.pop("PYTHONPATH", None)
    for k, v in {**wf.get("env", {}), **wf["jobs"][job].get("env", {})}.items():
        v = str(v)
        for expr in re.findall(r"\$\{\{\s*(.*?)\s*\}\}", v):
            assert expr in EXPRESSIONS, f"give the expression {expr!r} a local value in EXPRESSIONS"
            v = v.replace(v[v.index("${{"):v.index("}}") + 2], EXPRESSIONS[expr])
        env[k] = v
    runner = tmp_path / f"runner-{job}"
    runner.mkdir()
    env.update(RUNNER_TEMP=str(runner), GITHUB_WORKSPACE=str(repo), CI="true",
               PATH=shim(tmp_path) + os.pathsep + os.environ["PATH"])
    return env


def run_job(wf, job, tmp_path, repo) -> list:
    """Run the job's run: steps (not its installs) in ``repo``; [(step name, exit code, output)]."""
    env = _env(wf, job, tmp_path, repo)
    out = []
    for step in wf["jobs"][job]["steps"]:
        if "run" not in step or step.get("name", "").startswith("Install"):
            continue
        p = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", step["run"]], cwd=repo,
                           env=env, capture_output=True, text=True, timeout=300)
        out.append((step["name"], p.returncode, p.stdout + p.stderr))
    return out


def make_repo(tmp_path, model_on_main: bool, grow: bool):
    """origin (bare) whose main has the model file or not; a clone on a pull-request branch."""
    wf = load_workflow()
    model = wf["env"]["MODEL_FILE"]
    origin, repo = tmp_path / "origin.git", tmp_path / "repo"
    git("init", "-q", "--bare", "-b", "main", str(origin), cwd=tmp_path)
    git("clone", "-q", str(origin), str(repo), cwd=tmp_path)
    git("symbolic-ref", "HEAD", "refs/heads/main", cwd=repo)
    src = open(os.path.join(ROOT, model), encoding="utf-8").read()
    (repo / "README").write_text("a project with a model\n")
    if model_on_main:
        (repo / model).parent.mkdir(parents=True, exist_ok=True)
        (repo / model).write_text(src)
    git("add", "-A", cwd=repo)
    git("commit", "-q", "-m", "main", cwd=repo)
    git("push", "-q", "origin", "main", cwd=repo)
    git("checkout", "-q", "-b", "pr", cwd=repo)
    (repo / model).parent.mkdir(parents=True, exist_ok=True)
    if grow:                                    # twice the batch: twice the FLOPs and activations
        assert "torch.randn(32, cfg.dim)" in src
        src = src.replace("torch.randn(32, cfg.dim)", "torch.randn(64, cfg.dim)")
    (repo / model).write_text(src)
    lint_dir = repo / wf["env"]["LINT_PATHS"]
    lint_dir.mkdir(exist_ok=True)
    shutil.copy(os.path.join(ROOT, "examples", "leaky_step.py"), lint_dir / "leaky_step.py")
    git("add", "-A", cwd=repo)
    git("commit", "-q", "-m", "pr", cwd=repo)
    return wf, repo


@pytest.mark.slow
def test_audit_job_fails_a_pull_request_that_grew_the_model(tmp_path):
    wf, repo = make_repo(tmp_path, model_on_main=True, grow=True)
    steps = run_job(wf, "audit", tmp_path, repo)
    assert [(name, rc) for name, rc, _ in steps] == [("Audit the default branch (baseline)", 0),
                                                      ("Audit this commit against the baseline", 1)], steps
    base = json.loads((tmp_path / "runner-audit" / "baseline.json").read_text())
    sarif = json.loads((repo / "torchledger-audit.sarif").read_text())
    assert check_sarif(sarif, repo) == []
    grew = {r["message"]["text"].split(" grew")[0] for r in sarif["runs"][0]["results"]
            if r["ruleId"] == "TL-BASELINE-001"}
    assert {"FLOPs", "activation bytes"} <= grew
    flops = [r for r in sarif["runs"][0]["results"] if r["message"]["text"].startswith("FLOPs grew")][0]
    # batch 32 -> 64: the step's FLOPs double exactly; the baseline's are the default branch's
    assert f"({base['totals']['flops']['total']:,} -> {2 * base['totals']['flops']['total']:,};" \
        in flops["message"]["text"]
    assert flops["locations"][0]["physicalLocation"]["artifactLocation"]["uri"] == wf["env"]["MODEL_FILE"]


@pytest.mark.slow
def test_audit_job_without_a_baseline_on_the_default_branch(tmp_path):
    wf, repo = make_repo(tmp_path, model_on_main=False, grow=False)
    steps = run_job(wf, "audit", tmp_path, repo)
    assert [(name, rc) for name, rc, _ in steps] == [("Audit the default branch (baseline)", 0),
                                                      ("Audit this commit against the baseline", 0)], steps
    assert "auditing without a baseline" in steps[0][2]
    sarif = json.loads((repo / "torchledger-audit.sarif").read_text())
    assert check_sarif(sarif, repo) == []
    assert not [r for r in sarif["runs"][0]["results"] if r["ruleId"] == "TL-BASELINE-001"]


def test_lint_job_reports_the_leaky_loop(tmp_path):
    wf, repo = make_repo(tmp_path, model_on_main=False, grow=False)
    steps = run_job(wf, "lint", tmp_path, repo)
    assert [(name, rc) for name, rc, _ in steps] == [("Lint the training code", 1)], steps   # a warning
    sarif = json.loads((repo / "torchledger-lint.sarif").read_text())
    assert check_sarif(sarif, repo) == []
    hits = [(r["ruleId"], r["locations"][0]["physicalLocation"]["artifactLocation"]["uri"],
             r["locations"][0]["physicalLocation"]["region"]["startLine"]) for r in sarif["runs"][0]["results"]]
    line = [i for i, text in enumerate(open(os.path.join(ROOT, "examples", "leaky_step.py")), 1)
            if text.strip().startswith("losses.append(loss)")]
    assert hits == [("TL-LINT-001", "examples/leaky_step.py", line[0])]


def test_lint_needs_no_torch():
    # what lets the lint job (and the pre-commit hooks) skip the torch download
    code = ("import sys; from torchledger.cli import cli\n"
            "rc = cli.main(['lint', sys.argv[1]], standalone_mode=False)\n"
            "print(rc, sorted(m for m in ('torch', 'numpy', 'pandas') if m in sys.modules), file=sys.stderr)")
    p = subprocess.run([sys.executable, "-c", code, os.path.join(ROOT, "examples", "leaky_step.py")],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT}, timeout=120)
    assert p.stderr.strip().splitlines()[-1] == "1 []", p.stderr        # one finding, no torch


# -- pre-commit ------------------------------------------------------------------------------------
def _hooks() -> dict:
    with open(HOOKS, encoding="utf-8") as fh:
        return {h["id"]: h for h in yaml.safe_load(fh)}


def test_hook_manifest():
    hooks = _hooks()
    assert set(hooks) == {"torchledger-lint", "torchledger-lint-isolated"}
    for h in hooks.values():
        assert h["entry"] == "torchledger lint" and h["types"] == ["python"]
    assert hooks["torchledger-lint"]["language"] == "system"
    assert hooks["torchledger-lint-isolated"]["language"] == "python"


def hook_repo(tmp_path):
    """A git repository of this checkout's package and hook manifest, committed (pre-commit
    clones what is committed, so uncommitted edits of the checkout are tested too)."""
    repo = tmp_path / "hook"
    repo.mkdir()
    for name in ("pyproject.toml", "README.md", ".pre-commit-hooks.yaml"):
        shutil.copy(os.path.join(ROOT, name), repo / name)
    shutil.copytree(os.path.join(ROOT, "torchledger"), repo / "torchledger",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    git("init", "-q", "-b", "main", cwd=repo)
    git("add", "-A", cwd=repo)
    git("commit", "-q", "-m", "hook", cwd=repo)
    return repo


def project(tmp_path):
    proj = tmp_path / "proj"
    proj.mkdir()
    shutil.copy(os.path.join(ROOT, "examples", "leaky_step.py"), proj / "train.py")
    shutil.copy(os.path.join(ROOT, "tests", "data", "lint", "clean_loop.py"), proj / "clean.py")
    git("init", "-q", "-b", "main", cwd=proj)
    git("add", "-A", cwd=proj)
    return proj


def pre_commit(args, cwd, env, timeout=240):
    pytest.importorskip("pre_commit", reason="pre-commit is in the test extra: pip install -e '.[test]'")
    return subprocess.run([sys.executable, "-m", "pre_commit", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_pre_commit_try_repo_runs_the_lint_hook(tmp_path):
    repo, proj = hook_repo(tmp_path), project(tmp_path)
    env = {**os.environ, **_GIT_ENV, "PRE_COMMIT_HOME": str(tmp_path / "cache")}
    env.pop("PYTHONPATH", None)
    env["PATH"] = shim(tmp_path) + os.pathsep + env["PATH"]
    p = pre_commit(["try-repo", str(repo), "torchledger-lint", "--files", "train.py"], proj, env)
    assert p.returncode == 1, p.stdout + p.stderr
    assert re.search(r"train\.py:\d+: warning TL-LINT-001", p.stdout), p.stdout
    p = pre_commit(["try-repo", str(repo), "torchledger-lint", "--files", "clean.py"], proj, env)
    assert p.returncode == 0 and "Passed" in p.stdout, p.stdout + p.stderr


@pytest.mark.slow
def test_isolated_hook_installs_without_torch(tmp_path):
    """The `language: python` hook in an environment pre-commit builds. PIP_NO_DEPS=1 keeps pip
    to torchledger and the hook's additional_dependencies (click): no torch download, and lint
    runs there. (Without it, pre-commit would install torch, torchledger's dependency.)"""
    repo, proj = hook_repo(tmp_path), project(tmp_path)
    rev = git("rev-parse", "HEAD", cwd=repo).strip()
    (proj / ".pre-commit-config.yaml").write_text(
        f"repos:\n- repo: {repo}\n  rev: {rev}\n  hooks:\n  - id: torchledger-lint-isolated\n")
    git("add", "-A", cwd=proj)
    home = tmp_path / "cache"
    env = {**os.environ, **_GIT_ENV, "PRE_COMMIT_HOME": str(home), "PIP_NO_DEPS": "1"}
    env.pop("PYTHONPATH", None)
    p = pre_commit(["run", "torchledger-lint-isolated", "--files", "train.py", "clean.py"], proj, env, timeout=480)
    assert p.returncode == 1, p.stdout + p.stderr
    assert re.search(r"train\.py:\d+: warning TL-LINT-001", p.stdout), p.stdout
    assert "clean.py" not in p.stdout
    site = [os.path.join(d, n) for d, dirs, _ in os.walk(home) for n in dirs if n == "site-packages"]
    assert len(site) == 1, site
    installed = set(os.listdir(site[0]))
    assert {"torchledger", "click"} <= installed
    assert not {"torch", "numpy", "pandas"} & installed
