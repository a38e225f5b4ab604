"""pytest plugin: the ``torchledger_trace`` fixture and ``--torchledger-report DIR``.

Installed with torchledger (entry point ``pytest11``), so a test suite only has to use it::

    from torchledger.testing import assert_step

    def test_mlp_budget(torchledger_trace):
        model, opt = make_mlp(), torch.optim.SGD(...)
        with torchledger_trace(model, optimizer=opt, tokens=x.shape[0]) as t:
            model(x).sum().backward(); opt.step(); opt.zero_grad()
        assert_step(t.record, max_peak_bytes="2GB", max_flops_per_token=5e10,
                    no_findings_at="warning")

``pytest --torchledger-report DIR`` writes the record of every step traced with the fixture
to ``DIR/<test id>-<n>.json`` (``n`` counts the traces of one test from 0) and lists them
in ``DIR/index.json``; DIR is created if missing, and a DIR that cannot take a file (read-only,
full) stops the run at start-up in one line. Records are written when the test ends, whether
it passed or failed; each index entry has the test's ``outcome`` (passed, failed, error for a
failure in setup or teardown, skipped), ``failed`` (the test failed or errored) and
``step_failed`` (the traced step itself raised). Under pytest-xdist the workers write the
records and the controller writes one ``index.json`` of them all and the summary line.

The plugin imports neither torch nor torchledger's tracer until a test uses the fixture, so
a suite that never traces pays nothing at startup.

Known limitations: files of earlier runs in DIR are left in place (the index lists this
run's only). A record that cannot be written later (the disk filled during the run) is a
warning and a summary line, not a test error.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import warnings

import pytest

__all__ = ["torchledger_trace"]

INDEX_SCHEMA = "torchledger.pytest/1"


class _Report:
    """Where ``--torchledger-report`` writes, and what it has written this run."""

    def __init__(self, directory: str, worker=None):
        self.directory = directory
        self.worker = worker
        self.entries: list = []
        self.outcomes: dict = {}        # nodeid -> passed | failed | error | skipped
        self.unwritten: list = []       # "file: reason" of records that could not be written
        self._names: dict = {}          # file stem -> nodeid, to keep two tests apart

    def stem(self, nodeid: str) -> str:
        stem = re.sub(r"[^A-Za-z0-9._-]+", "_", nodeid).strip("._-") or "test"
        digest = hashlib.sha1(nodeid.encode()).hexdigest()[:10]
        if len(stem) > 120:             # file names stop at 255 bytes; ids of parametrized tests do not
            stem = f"{stem[:100]}-{digest}"
        if self._names.setdefault(stem, nodeid) != nodeid:     # `a/b` and `a_b` read alike
            stem = f"{stem}-{digest}"
            self._names[stem] = nodeid
        return stem

    def write(self, nodeid: str, records: list) -> None:
        from .render.output import write_atomic  # lazy: the plugin loads with every pytest session
        stem = self.stem(nodeid) if records else None
        for i, record in enumerate(records):
            name = f"{stem}-{i}.json"
            try:
                write_atomic(os.path.join(self.directory, name), record.to_json() + "\n")
            except OSError as e:        # the disk filled during the run: not the test's failure
                self.unwritten.append(f"{name}: {e.strerror or e}")
                warnings.warn(f"torchledger: --torchledger-report: {name} not written ({e.strerror or e})",
                              RuntimeWarning, stacklevel=1)
                continue
            t = record.totals
            self.entries.append({"nodeid": nodeid, "trace": i, "file": name,
                                 "step_failed": bool(record.meta.get("failed")),
                                 "flops_total": t["flops"]["total"], "peak_bytes": t.get("peak_bytes"),
                                 "tokens": t.get("tokens")})

    def note(self, report) -> None:
        """A test phase's report: the test's outcome, the worst of its phases."""
        if report.when == "call":
            outcome = report.outcome
        elif report.failed:
            outcome = "error"           # setup or teardown failed
        elif report.skipped and report.when == "setup":
            outcome = "skipped"
        else:
            return
        if self.outcomes.get(report.nodeid) not in ("failed", "error") or outcome == "error":
            self.outcomes[report.nodeid] = outcome

    def finished_entries(self) -> list:
        """The entries with each test's outcome filled in."""
        out = []
        for e in self.entries:
            outcome = e.get("outcome") or self.outcomes.get(e["nodeid"], "unknown")
            out.append({**e, "outcome": outcome, "failed": outcome in ("failed", "error")})
        return out

    def write_index(self):
        """``DIR/index.json``; the path, or None when it could not be written (noted)."""
        from .render.output import write_atomic  # lazy: the plugin loads with every pytest session
        path = os.path.join(self.directory, "index.json")
        doc = {"schema": INDEX_SCHEMA, "records": self.finished_entries()}
        try:
            write_atomic(path, json.dumps(doc, indent=2) + "\n")
        except OSError as e:
            self.unwritten.append(f"index.json: {e.strerror or e}")
            return None
        return path


_REPORT = pytest.StashKey[_Report]()


def pytest_addoption(parser):
    group = parser.getgroup("torchledger", "torchledger: FLOPs and memory of traced steps")
    group.addoption("--torchledger-report", metavar="DIR", dest="torchledger_report", default=None,
                    help="write the record of every step traced with the torchledger_trace fixture "
                         "to DIR as JSON, one file per trace plus index.json (DIR is created if missing)")


def pytest_configure(config):
    option = config.getoption("torchledger_report", None)
    if option is None:
        return
    if not str(option).strip():
        raise pytest.UsageError("--torchledger-report: expected a directory, got an empty string")
    directory = os.path.join(str(config.invocation_params.dir), os.path.expanduser(str(option)))
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise pytest.UsageError(f"--torchledger-report {option}: exists and is not a directory; "
                                f"expected a directory to write the records into")
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise pytest.UsageError(f"--torchledger-report {option}: cannot create the directory "
                                f"({e.strerror or e})") from None
    worker = getattr(config, "workerinput", {}).get("workerid")     # pytest-xdist
    if worker is None:                  # the controller checks once, before any test runs
        problem = _cannot_write(directory)
        if problem:
            raise pytest.UsageError(f"--torchledger-report {option}: cannot write a file in the directory "
                                    f"({problem}); give a writable directory with free space")
    report = config.stash[_REPORT] = _Report(os.path.normpath(directory), worker)
    config.pluginmanager.register(_Outcomes(report), "torchledger-outcomes")


def _cannot_write(directory: str):
    """Why a record cannot be written in ``directory`` (read-only, full, ...), or None: a
    probe file is created, written, synced and removed (what ``write_atomic`` will do)."""
    import tempfile
    try:
        fd, probe = tempfile.mkstemp(prefix=".torchledger-probe-", dir=directory)
    except OSError as e:
        return e.strerror or str(e)
    try:
        os.write(fd, b"{}\n" * 1024)      # 3 KiB: a full disk refuses it (no free block)
        os.fsync(fd)
    except OSError as e:
        return e.strerror or str(e)
    finally:
        os.close(fd)
        try:
            os.unlink(probe)
        except OSError:
            pass
    return None


def pytest_report_header(config):
    report = config.stash.get(_REPORT, None)
    if report is not None:
        return f"torchledger: records of traced steps go to {report.directory}"
    return None


class _Outcomes:
    """Registered with ``--torchledger-report``: each test's outcome, for its index entries
    (in an xdist worker for its own tests)."""

    def __init__(self, report: _Report):
        self.report = report

    def pytest_runtest_logreport(self, report):
        self.report.note(report)


def pytest_sessionfinish(session):
    report = session.config.stash.get(_REPORT, None)
    if report is None:
        return
    output = getattr(session.config, "workeroutput", None)
    if report.worker is not None and output is not None:
        # pytest-xdist worker: the controller writes the one index (pytest_testnodedown)
        output["torchledger"] = {"entries": report.finished_entries(), "unwritten": report.unwritten}
        return
    report.write_index()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """pytest-xdist controller: a worker finished; take its records into this run's index."""
    report = node.config.stash.get(_REPORT, None)
    got = (getattr(node, "workeroutput", None) or {}).get("torchledger")
    if report is not None and isinstance(got, dict):
        report.entries.extend({**e} for e in got.get("entries", []))
        report.entries.sort(key=lambda e: (e["nodeid"], e["trace"]))   # workers finish in any order
        report.unwritten.extend(got.get("unwritten", []))


def pytest_terminal_summary(terminalreporter, config):
    report = config.stash.get(_REPORT, None)
    if report is not None and report.worker is None:
        n = len(report.entries)
        terminalreporter.write_line(f"torchledger: {n} record{'s' if n != 1 else ''} written to "
                                    f"{report.directory}")
        if report.unwritten:
            shown = "; ".join(report.unwritten[:3]) + ("; ..." if len(report.unwritten) > 3 else "")
            terminalreporter.write_line(f"torchledger: {len(report.unwritten)} file(s) not written: {shown}")


class _Trace:
    """One ``torchledger_trace(...)`` call: the context manager around ``torchledger.trace``
    that remembers whether it is still entered, so the fixture can close it."""

    def __init__(self, tracer):
        self.tracer = tracer
        self.entered = False

    def __enter__(self):
        t = self.tracer.__enter__()
        self.entered = True
        return t

    def __exit__(self, *exc):
        self.entered = False
        return self.tracer.__exit__(*exc)

    def __getattr__(self, name):        # t.record, t.report(), t.findings() without `as t`
        if name == "tracer":            # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.tracer, name)


class TraceFactory:
    """What the ``torchledger_trace`` fixture gives a test: call it as ``torchledger.trace``
    (same arguments) and use the result in a ``with`` block. ``records`` lists the records of
    the test's finished traces, in order."""

    def __init__(self):
        self._traces: list = []

    def __call__(self, model, optimizer=None, tokens=None, **options) -> _Trace:
        from . import trace  # lazy: the plugin loads with every pytest session
        t = _Trace(trace(model, optimizer=optimizer, tokens=tokens, **options))
        self._traces.append(t)
        return t

    @property
    def records(self) -> list:
        return [t.tracer.record for t in self._traces if t.tracer.record is not None]

    def close(self) -> None:
        """Exit every trace the test left entered (its hooks and modes come off), last first."""
        errors = []
        for t in reversed(self._traces):
            if not t.entered:
                continue
            warnings.warn("torchledger_trace: a trace was still active when the test ended; the "
                          "fixture removed its hooks (use it as `with torchledger_trace(...) as t:`)",
                          RuntimeWarning, stacklevel=1)
            try:
                t.__exit__(_Unfinished, _Unfinished(), None)
            except BaseException as e:  # noqa: BLE001 - close the others first
                errors.append(e)
        if errors:
            raise errors[0]


class _Unfinished(Exception):
    """The step a test left inside a trace: the record says ``failed``."""


@pytest.fixture
def torchledger_trace(request):
    """A factory of traces: ``with torchledger_trace(model, optimizer=opt, tokens=N) as t:``.

    Takes ``torchledger.trace``'s arguments. Nothing stays installed after the test, even if
    it fails inside the block. With ``--torchledger-report DIR`` the records are written there.
    """
    factory = TraceFactory()
    try:
        yield factory
    finally:
        try:
            factory.close()
        finally:
            report = request.config.stash.get(_REPORT, None)
            if report is not None:
                report.write(request.node.nodeid, factory.records)
