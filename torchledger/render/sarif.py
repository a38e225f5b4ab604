"""SARIF 2.1.0 for code-scanning dashboards (GitHub, GitLab, VS Code's SARIF viewer).

    >>> log = findings_to_sarif(findings, tool_version="0.1.0")   # a dict, for any finder
    >>> text = render_sarif(record, findings)                      # the same, as JSON text

Severity maps to ``level``: error -> error, warning -> warning, info -> note. Every result has
a ``physicalLocation`` (GitHub code scanning rejects a result without one): a finding located at
``path:line`` points there; one without a line (a model-level finding such as TL-MFU-001, or one
naming only a module) points at the audited model file, at its ``audit_spec`` definition (the
line the audit stored in ``meta.audit.spec_line``, else line 1; the file is never opened here),
and keeps the module as a logical location. A record that names no model
file (a ``torchledger.trace`` record) has nowhere to point such findings, so they are reported as
tool notifications (``invocations[0].toolExecutionNotifications``, with their rule id) instead of
results. Paths under the working directory become relative URIs; a file outside it becomes
relative to the root of the git work tree holding the working directory, else a ``file://`` URI,
never a ``../`` path. Each rule's ``shortDescription`` is its fixed title and its
``fullDescription``/``help`` its doc, from the one catalogue (:mod:`torchledger.rules`),
identical from run to run; this run's numbers are only in the results. ``lint --format sarif``
uses the same :func:`findings_to_sarif`.

Known limitations: no ``partialFingerprints`` (code scanning computes its own); one run.
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path, PureWindowsPath
from urllib.parse import quote

from ..record import Finding
from ..rules import RULES, title
from .common import EMPTY_SENTENCE, as_findings, is_empty, with_hint
from .common import tool_version as current_version
from ..inputs import SOURCE_MAX_BYTES, InputFileError, read_input

__all__ = ["findings_to_sarif", "render_sarif", "SARIF_SCHEMA", "LEVELS", "artifact_uri", "spec_location"]

SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"
LEVELS = {"error": "error", "warning": "warning", "info": "note"}
_LOCATION = re.compile(r"^(?P<path>.+?):(?P<line>[0-9]+)(?::(?P<col>[0-9]+))?$")


def findings_to_sarif(findings, tool_version=None, *, rules=None, notifications=(),
                      information_uri=None, source=None) -> dict:
    """A SARIF 2.1.0 log (a dict) with one run holding ``findings``: the one SARIF writer, for
    ``audit``, ``report`` and ``lint``.

    ``findings`` are :class:`Finding` objects or their dicts. ``rules`` lists rule ids to
    describe even when no finding names them (``lint`` lists all of its rules), or maps a rule id
    to its one-line description (a string, a ``(severity, title, ...)`` tuple or a dict with
    ``title``). Every rule's title, doc and default level come from the catalogue
    (:mod:`torchledger.rules`; an id it does not know is its own title), never from a run's
    message. ``source`` is ``(path, line)`` (or a path: line 1), where a finding without a
    ``path:line`` points (the audited model file); without it such findings become tool
    notifications. ``notifications`` are strings reported as tool notes (e.g. "nothing was
    traced"). ``information_uri``, if given, is the tool's home page. ``tool_version`` defaults
    to torchledger's.
    """
    if tool_version is None:
        tool_version = current_version()
    items = [f if isinstance(f, Finding) else Finding.from_dict(f) for f in findings]
    listed = list(rules or ())
    described = dict(rules) if isinstance(rules, Mapping) else {}
    if isinstance(source, (str, os.PathLike)):
        source = (os.fspath(source), 1)
    rule_ids: list = []
    for rid in listed + [f.rule for f in items]:
        if rid not in rule_ids:
            rule_ids.append(rid)
    descriptors = [_descriptor(rid, described.get(rid), next((f for f in items if f.rule == rid), None))
                   for rid in rule_ids]
    results, unlocated = [], []
    for f in items:
        result = _result(f, rule_ids.index(f.rule), source)
        (results if "locations" in result else unlocated).append((f, result))
    run = {
        "tool": {"driver": {"name": "torchledger", "version": str(tool_version), "rules": descriptors}},
        "results": [r for _, r in results],
    }
    if information_uri:
        run["tool"]["driver"]["informationUri"] = str(information_uri)
    notes = [{"level": "note", "message": {"text": str(n)}} for n in notifications]
    notes += [{"level": r["level"], "message": r["message"],
               "associatedRule": {"id": f.rule, "index": r["ruleIndex"]},
               **({"properties": r["properties"]} if "properties" in r else {})} for f, r in unlocated]
    if notes:
        run["invocations"] = [{"executionSuccessful": True, "toolExecutionNotifications": notes}]
    return {"$schema": SARIF_SCHEMA, "version": "2.1.0", "runs": [run]}


def _descriptor(rule_id: str, described, first) -> dict:
    """A ``reportingDescriptor``: the catalogue's title (or ``described``), its doc as the full
    description and help (with the docs' anchor), and the level of the first finding naming the
    rule (else the catalogue's default severity)."""
    rule = RULES.get(rule_id)
    out = {"id": rule_id, "shortDescription": {"text": _describe(described) or title(rule_id)}}
    if rule is not None and rule.doc:
        out["fullDescription"] = {"text": rule.doc}
        out["help"] = {"text": f"{rule.doc} (docs: {rule.anchor})"}
    severity = first.severity if first is not None else (rule.severity if rule else "warning")
    out["defaultConfiguration"] = {"level": LEVELS.get(severity, "note")}
    return out


def render_sarif(record, findings=None, *, source=None, **_options) -> str:
    """The findings of a record as SARIF text; an empty record adds a note saying so.

    Findings without a source line point at ``source`` (a path, or ``(path, line)``), by
    default the model file an audit record names (``meta.audit.file``) at the ``audit_spec``
    line the audit stored (``meta.audit.spec_line``; line 1 in records made before it). The
    file itself is never opened: a record is data, and a path in it may name a FIFO or a device.
    """

    notes = [EMPTY_SENTENCE] if is_empty(record) else []
    if source is None:                  # never open the file a record names: its line is in the record
        audit = (record.meta or {}).get("audit") or {}
        if isinstance(audit.get("file"), str) and audit["file"].strip():
            source = (audit["file"], audit.get("spec_line") or 1)
    log = findings_to_sarif(as_findings(record, findings), current_version(), notifications=notes,
                            source=source)
    return json.dumps(log, indent=2, default=str)


def spec_location(path: str, entry: str = "audit_spec") -> tuple:
    """``(path, line)`` of ``def entry`` (or ``entry = ...``) in ``path``; line 1 if not found.

    For ``audit``, which reads the model file it was given: the file is read as a regular file
    of bounded size (a FIFO or device gives line 1, never a hang)."""
    pattern = re.compile(r"^\s*(?:(?:async\s+)?def\s+" + re.escape(entry) + r"\b|" + re.escape(entry)
                         + r"\s*(?::[^=]*)?=[^=])")
    try:
        text = read_input(path, what="model", max_bytes=SOURCE_MAX_BYTES).decode("utf-8", "replace")
    except InputFileError:
        return path, 1
    for number, line in enumerate(text.split("\n"), 1):
        if pattern.match(line):
            return path, number
    return path, 1


def _result(f: Finding, rule_index: int, source=None) -> dict:
    text = with_hint(f.message, f.hint)
    result = {"ruleId": f.rule, "ruleIndex": rule_index, "level": LEVELS.get(f.severity, "note"),
              "message": {"text": text}}
    physical = _physical(f.location) if f.location else None
    if physical is None and source:
        physical = _physical(str(source[0]), source[1])
    logical = [{"fullyQualifiedName": f.module or "(root)", "kind": "module"}] if f.module is not None else []
    if physical:
        loc = {"physicalLocation": physical}
        if logical:
            loc["logicalLocations"] = logical
        result["locations"] = [loc]
    props = {k: v for k, v in (("module", f.module), ("measured", f.measured), ("expected", f.expected))
             if v is not None}
    if props:
        result["properties"] = props
    return result


#: SARIF lines and columns are positive; code scanning reads them as 32-bit ints.
MAX_LINE = 2**31 - 1


def _physical(location: str, line=None):
    """``'src/train.py:42'`` -> artifactLocation + region, or None for a blank location (no
    empty URI). A line that is no positive 32-bit int (``a.py:0``, ``a.py:99999999999999``)
    becomes line 1 of the file: code scanning needs a ``startLine``; a bad column is dropped.
    ``line``, if given, is the line of ``location`` (a bare path)."""
    text = location.strip()
    m = _LOCATION.match(text) if line is None else None
    path = m.group("path") if m else text
    if line is None:
        line = m.group("line") if m else 1
    region = {"startLine": _positive(line) or 1}
    if m and m.group("col") and _positive(m.group("col")):
        region["startColumn"] = _positive(m.group("col"))
    uri = artifact_uri(path) if path.strip() else ""
    if not uri:
        return None
    return {"artifactLocation": {"uri": uri}, "region": region}


def _positive(value):
    """``value`` (an int or digits) as an int in 1..MAX_LINE, else None."""
    if isinstance(value, str):
        if not (value.isascii() and value.isdigit()) or len(value) > 10:
            return None
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value if 1 <= value <= MAX_LINE else None


def artifact_uri(path: str, cwd=None) -> str:
    """A percent-encoded URI code scanning can resolve, never with ``..`` segments.

    A path under the working directory is relative to it (forward slashes); one outside it
    is relative to the root of the git work tree holding the working directory, if it is in
    that tree; anything else is an absolute ``file://`` URI.
    """
    win = PureWindowsPath(path)
    if win.drive and os.sep != "\\":
        return win.as_uri() if win.is_absolute() else quote(path.replace("\\", "/"))
    cwd = os.path.abspath(cwd or os.getcwd())
    parts = path.replace("\\", "/").split("/")
    if not os.path.isabs(path) and ".." not in parts:
        return quote("/".join(p for p in parts if p not in ("", ".")) if parts != ["."] else ".")
    full = os.path.normpath(os.path.join(cwd, path))
    for base in (cwd, _git_root(cwd)):
        if base is None:
            continue
        try:
            rel = os.path.relpath(full, base)
        except ValueError:                      # another drive on Windows
            continue
        if rel != ".." and not rel.startswith(".." + os.sep) and not os.path.isabs(rel):
            return quote(rel.replace(os.sep, "/"))
    return Path(full).as_uri()


def _git_root(start: str):
    """The top of the git work tree holding ``start`` (a ``.git`` directory or file), or None."""
    here = start
    while True:
        if os.path.exists(os.path.join(here, ".git")):
            return here
        parent = os.path.dirname(here)
        if parent == here:
            return None
        here = parent


def _describe(entry) -> str:
    """A rule description from a string, a ``(severity, title, doc)`` tuple or a dict."""
    if isinstance(entry, str):
        return entry
    if isinstance(entry, (tuple, list)) and entry:
        return str(entry[1] if len(entry) >= 2 else entry[0])
    if isinstance(entry, dict):
        return str(entry.get("title") or entry.get("short") or entry.get("description") or "")
    return ""
