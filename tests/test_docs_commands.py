"""Every shell command in README.md and docs/*.md runs, as written, from a fresh copy of the
repository, and no file of the repository points outside it.

The commands are the lines of the pages' ```bash blocks (a line ending in ``\\`` goes on on the
next; ``#`` starts a comment). Each page runs its blocks in order, in one fresh copy of the
repository's files (what ``git ls-files`` lists, untracked files not ignored included) with the
copy as working directory and as ``PYTHONPATH``, ``python`` this interpreter and
``torchledger`` its ``python -m torchledger``: a later command may read what an earlier one of
the same page wrote (``--output a.json``, then ``report a.json``).

A command must exit 0, unless its comment begins with ``exit N`` (``# exit 1: over budget``).
A block may carry a marker, an HTML comment on the line just above its fence:

* ``<!-- docs-test: skip (WHY) -->``: never run here (it needs a GPU, ``torchrun``, installs
  packages, or is the whole test suite); WHY is required.
* ``<!-- docs-test: slow (WHY) -->``: run only with ``TORCHLEDGER_DOCS_SLOW=1`` or
  ``python tests/test_docs_commands.py --slow``: a block of a minute or more, or one that
  another test already runs (``torchrun``'s ranks); WHY says which.

``python tests/test_docs_commands.py [--slow] [--verbose] [PAGE...]`` runs the same walk
outside pytest and prints each command with its time (and with ``--verbose`` its output).
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple, Optional

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = re.compile(r"^<!--\s*docs-test:\s*(skip|slow)\s*\((.+)\)\s*-->\s*$")
EXIT = re.compile(r"^exit (\d+)\b")
FAST_TIMEOUT, SLOW_TIMEOUT = 180, 900         # seconds for one command


class Command(NamedTuple):
    page: str
    line: int          # 1-based line of the command's first line in the page
    text: str          # the shell command, continuations joined, comment dropped
    expect: int        # exit status it must give
    marker: Optional[str]    # None, "skip" or "slow"
    why: str


def _split_comment(line: str):
    """``cmd args  # comment`` -> (``cmd args``, ``comment``); a ``#`` inside quotes stays."""
    quote, i = None, 0
    while i < len(line):
        c = line[i]
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i + 1:].strip()
        i += 1
    return line.rstrip(), ""


def commands(page: str, text: str) -> list:
    """The commands of one page's ```bash blocks, with their markers and expected exits."""
    lines, out = text.split("\n"), []
    i = 0
    while i < len(lines):
        if lines[i].strip() != "```bash":
            i += 1
            continue
        above = lines[i - 1].strip() if i else ""
        m = MARKER.match(above)
        if above.startswith("<!--") and "docs-test" in above and not m:
            raise ValueError(f"{page}:{i}: a docs-test marker must read "
                             f"'<!-- docs-test: skip|slow (why) -->', got {above!r}")
        marker, why = (m.group(1), m.group(2).strip()) if m else (None, "")
        i += 1
        pending, start, comment = "", 0, ""
        while i < len(lines) and lines[i].strip() != "```":
            body, note = _split_comment(lines[i])
            if not pending:
                start, comment = i + 1, note
            else:
                body, comment = body.lstrip(), comment or note
            if body.endswith("\\"):
                pending += body[:-1].rstrip() + " "
            elif pending or body.strip():
                cmd = (pending + body).strip()
                e = EXIT.match(comment)
                out.append(Command(page, start, cmd, int(e.group(1)) if e else 0, marker, why))
                pending = ""
            i += 1
        if pending:
            raise ValueError(f"{page}:{start}: a command's last line ends in '\\'")
        i += 1
    return out


def pages() -> list:
    docs = os.path.join(ROOT, "docs")
    return ["README.md"] + sorted(f"docs/{n}" for n in os.listdir(docs) if n.endswith(".md"))


def page_commands(page: str) -> list:
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return commands(page, f.read())


def repo_files() -> list:
    """What a clone holds: git's tracked files (and untracked ones not ignored, so that a page
    and its new example can be tested before they are committed)."""
    r = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        pytest.skip(f"git ls-files failed: {r.stderr.strip()}")
    return [p for p in r.stdout.split("\0") if p and os.path.isfile(os.path.join(ROOT, p))]


def fresh_copy(dest: str) -> str:
    """The repository's files under ``dest/repo``, and ``dest/bin`` with ``python`` and
    ``torchledger`` of this interpreter; returns the copy's root."""
    repo = os.path.join(dest, "repo")
    for rel in repo_files():
        os.makedirs(os.path.dirname(os.path.join(repo, rel)), exist_ok=True)
        shutil.copy2(os.path.join(ROOT, rel), os.path.join(repo, rel))
    bin_dir = os.path.join(dest, "bin")
    os.makedirs(bin_dir)
    for name, line in (("python", f'exec {shlex.quote(sys.executable)} "$@"'),
                       ("torchledger", f'exec {shlex.quote(sys.executable)} -m torchledger "$@"')):
        with open(os.path.join(bin_dir, name), "w") as f:
            f.write(f"#!/bin/sh\n{line}\n")
        os.chmod(os.path.join(bin_dir, name), 0o755)
    return repo


def run_command(cmd: Command, repo: str, timeout: float) -> subprocess.CompletedProcess:
    bin_dir = os.path.join(os.path.dirname(repo), "bin")
    env = dict(os.environ, PYTHONPATH=repo, OMP_NUM_THREADS="1",
               PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""))
    env.pop("TORCHLEDGER_HARDWARE", None)
    return subprocess.run(["bash", "-c", cmd.text], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def outside_paths(text: str) -> list:
    """Words of a command that name a path outside the repository: absolute (but ``/dev/``)
    or climbing out with ``..``."""
    bad = []
    text = re.sub(r"\b[a-z][a-z0-9+.-]*://\S+", " ", text)          # URLs are not paths
    for word in re.split(r"[\s=:'\"<>|;&]+", text):
        if word.startswith("/") and not word.startswith("/dev/"):
            bad.append(word)
        elif ".." in word.split("/"):
            bad.append(word)
    return bad


def walk(page: str, slow: bool, log=None, verbose=False) -> list:
    """Run a page's commands in a fresh copy; the failures as text (empty: all passed)."""
    cmds = [c for c in page_commands(page) if c.marker is None or (slow and c.marker == "slow")]
    failures = []
    with tempfile.TemporaryDirectory(prefix="docs-commands-") as tmp:
        repo = fresh_copy(tmp)
        for c in cmds:
            t0 = time.perf_counter()
            try:
                r = run_command(c, repo, SLOW_TIMEOUT if c.marker == "slow" else FAST_TIMEOUT)
                rc, tail = r.returncode, (r.stdout + r.stderr)[-2000:]
            except subprocess.TimeoutExpired:
                rc, tail = "timeout", ""
            if log:
                log(f"{time.perf_counter() - t0:7.1f} s  exit {rc}  {page}:{c.line}  {c.text}")
                if verbose and rc != "timeout":
                    log(r.stdout + r.stderr)
            if rc != c.expect:
                failures.append(f"{page}:{c.line}: `{c.text}` exited {rc}, expected {c.expect}\n{tail}")
    return failures


# -- the parser itself ------------------------------------------------------------------------
SAMPLE = """
text
```bash
echo one   # prints one
false      # exit 1: false fails
echo a \\
  b        # exit 0
```
<!-- docs-test: skip (needs a GPU) -->
```bash
nvidia-smi
```
```python
print("not a command")
```
<!-- docs-test: slow (a minute) -->
```bash
echo '# not a comment'
```
"""


def test_the_parser_reads_blocks_markers_continuations_and_exits():
    got = [(c.line, c.text, c.expect, c.marker, c.why) for c in commands("x.md", SAMPLE)]
    assert got == [(4, "echo one", 0, None, ""),
                   (5, "false", 1, None, ""),
                   (6, "echo a b", 0, None, ""),
                   (11, "nvidia-smi", 0, "skip", "needs a GPU"),
                   (18, "echo '# not a comment'", 0, "slow", "a minute")]


def test_a_marker_without_a_reason_is_refused():
    with pytest.raises(ValueError, match="must read"):
        commands("x.md", "<!-- docs-test: skip -->\n```bash\nls\n```\n")


def test_outside_paths_are_named():
    assert outside_paths("torchledger audit ../other/x.py --output /tmp/a.json > /dev/null") == \
        ["../other/x.py", "/tmp/a.json"]
    assert outside_paths("PYTHONPATH=$PWD python benchmarks/predict_published.py") == []
    assert outside_paths("pip install torch --index-url https://download.pytorch.org/whl/cpu") == []


# -- the pages ----------------------------------------------------------------------------------
def test_every_page_has_commands_and_they_stay_inside_the_repository():
    everything = [c for p in pages() for c in page_commands(p)]
    assert len(everything) >= 20, "the pages' bash blocks were not found"
    for c in everything:
        assert not outside_paths(c.text), f"{c.page}:{c.line}: {c.text}"


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in pages() if any(c.marker != "skip" for c in page_commands(p))])
def test_page_commands_run_from_a_fresh_copy(page):
    slow = os.environ.get("TORCHLEDGER_DOCS_SLOW") == "1"
    if not any(c.marker is None or (slow and c.marker == "slow") for c in page_commands(page)):
        pytest.skip("only slow commands (TORCHLEDGER_DOCS_SLOW=1 runs them)")
    failures = walk(page, slow)
    assert not failures, "\n\n".join(failures)


def test_no_file_points_into_the_shared_folder_beside_the_checkout():
    """Users have only the repository: no file of it may name the folder beside the checkout
    that the developers have (or an absolute path to it)."""
    needles = [".." + "/shared", "/work" + "/shared", "shared" + "/calibration", "shared" + "/gpu-check"]
    found = []
    for rel in repo_files():
        try:
            with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
                text = f.read()
        except (UnicodeDecodeError, OSError):
            continue                                   # binary files (pickles)
        found += [f"{rel}: {n}" for n in needles if n in text]
    assert not found, found



def test_pages_cite_no_file_users_do_not_have():
    """The developers' notes (the accounting, interface and style guides) are not in the
    repository: a page, example or benchmark that cites them sends a user nowhere."""
    notes = re.compile(r"\b(ACCOUNTING|INTERFACE|STYLE)(\.md\b| sec)")
    found = []
    for rel in repo_files():
        if rel.endswith(".md") or rel.startswith(("examples/", "benchmarks/")):
            with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
                found += [f"{rel}:{n}: {line.strip()}" for n, line in enumerate(f, 1) if notes.search(line)]
    assert not found, "\n".join(found)


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _headings(path: str) -> set:
    with open(path, encoding="utf-8") as f:
        text = re.sub(r"```.*?```", "", f.read(), flags=re.S)      # a '# comment' is no heading
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}


def test_links_between_pages_resolve():
    """Every relative link of README.md and docs/*.md names a file of the repository, and its
    #anchor a heading of that file."""
    bad = []
    for page in pages():
        with open(os.path.join(ROOT, page), encoding="utf-8") as f:
            text = f.read()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue                                           # https:, mailto:
            path, _, anchor = target.partition("#")
            full = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), path)) if path \
                else os.path.join(ROOT, page)
            if not full.startswith(ROOT + os.sep) or not os.path.exists(full):
                bad.append(f"{page}: ({target}): no such file")
            elif anchor and anchor not in _headings(full):
                bad.append(f"{page}: ({target}): no heading #{anchor}")
    assert not bad, "\n".join(bad)

if __name__ == "__main__":
    argv = sys.argv[1:]
    slow, verbose = "--slow" in argv, "--verbose" in argv
    chosen = [a for a in argv if a not in ("--slow", "--verbose")] or pages()
    bad = []
    for p in chosen:
        bad += walk(p, slow, log=lambda line: print(line, flush=True), verbose=verbose)
    print("\n\n".join(bad) if bad else "all commands gave the exit status their pages expect")
    sys.exit(1 if bad else 0)
