"""SARIF 2.1.0 for code-scanning dashboards (GitHub, GitLab, VS Code's SARIF viewer).

    >>> log = findings_to_sarif(findings, tool_version="0.1.0")   # a dict, for any finder
    >>> text = render_sarif(record, findings)                      # the same, as JSON text

Severity maps to ``level``: error -> error, warning -> warning, info -> note. A finding
located at ``path:line`` gets a physical location (relative paths stay relative, so code
scanning resolves them against the checkout); one that names only a module gets a logical
location instead. ``lint`` can reuse :func:`findings_to_sarif` as it is.

Known limitations: no ``partialFingerprints`` (code scanning computes its own); one run.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import PureWindowsPath
from urllib.parse import quote

from ..record import Finding
from .common import EMPTY_SENTENCE, as_findings, is_empty, with_hint

__all__ = ["findings_to_sarif", "render_sarif", "SARIF_SCHEMA", "LEVELS"]

SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"
LEVELS = {"error": "error", "warning": "warning", "info": "note"}
_LOCATION = re.compile(r"^(?P<path>.+?):(?P<line>[0-9]+)(?::(?P<col>[0-9]+))?$")


def findings_to_sarif(findings, tool_version: str, *, rules=None, notifications=(),
                      information_uri=None) -> dict:
    """A SARIF 2.1.0 log (a dict) with one run holding ``findings``.

    ``findings`` are :class:`Finding` objects or their dicts. ``rules`` maps a rule id to its
    one-line description (a string, a ``(severity, title, doc)`` tuple as in lint's ``RULES``,
    or a dict with ``title``); a rule without one is described by its first finding's message.
    ``notifications`` are strings reported as tool notes (e.g. "nothing was traced").
    ``information_uri``, if given, is the tool's home page.
    """
    items = [f if isinstance(f, Finding) else Finding.from_dict(f) for f in findings]
    rules = dict(rules or {})
    rule_ids: list = []
    for f in items:
        if f.rule not in rule_ids:
            rule_ids.append(f.rule)
    descriptors = []
    for rid in rule_ids:
        first = next(f for f in items if f.rule == rid)
        text = _describe(rules.get(rid)) or _first_sentence(first.message)
        descriptors.append({"id": rid, "shortDescription": {"text": text},
                            "defaultConfiguration": {"level": LEVELS.get(first.severity, "note")}})
    run = {
        "tool": {"driver": {"name": "torchledger", "version": str(tool_version), "rules": descriptors}},
        "results": [_result(f, rule_ids.index(f.rule)) for f in items],
    }
    if information_uri:
        run["tool"]["driver"]["informationUri"] = str(information_uri)
    if notifications:
        run["invocations"] = [{"executionSuccessful": True, "toolExecutionNotifications": [
            {"level": "note", "message": {"text": str(n)}} for n in notifications]}]
    return {"$schema": SARIF_SCHEMA, "version": "2.1.0", "runs": [run]}


def render_sarif(record, findings=None, **_options) -> str:
    """The findings of a record as SARIF text; an empty record adds a note saying so."""
    from .. import __version__

    notes = [EMPTY_SENTENCE] if is_empty(record) else []
    log = findings_to_sarif(as_findings(record, findings), __version__, notifications=notes)
    return json.dumps(log, indent=2, default=str)


def _result(f: Finding, rule_index: int) -> dict:
    text = with_hint(f.message, f.hint)
    result = {"ruleId": f.rule, "ruleIndex": rule_index, "level": LEVELS.get(f.severity, "note"),
              "message": {"text": text}}
    physical = _physical(f.location) if f.location else None
    logical = [{"fullyQualifiedName": f.module or "(root)", "kind": "module"}] if f.module is not None else []
    if physical or logical:
        loc = {}
        if physical:
            loc["physicalLocation"] = physical
        if logical:
            loc["logicalLocations"] = logical
        result["locations"] = [loc]
    props = {k: v for k, v in (("module", f.module), ("measured", f.measured), ("expected", f.expected))
             if v is not None}
    if props:
        result["properties"] = props
    return result


def _physical(location: str):
    """``'src/train.py:42'`` -> artifactLocation + region; a location without a line keeps the path."""
    m = _LOCATION.match(location.strip())
    path, line = (m.group("path"), int(m.group("line"))) if m else (location.strip(), None)
    phys = {"artifactLocation": {"uri": _uri(path)}}
    if line and line >= 1:
        region = {"startLine": line}
        if m.group("col"):
            region["startColumn"] = max(int(m.group("col")), 1)
        phys["region"] = region
    return phys


def _uri(path: str) -> str:
    """Relative paths as relative URIs (forward slashes); absolute ones as ``file://`` URIs."""
    if PureWindowsPath(path).drive:
        return PureWindowsPath(path).as_uri() if PureWindowsPath(path).is_absolute() else \
            quote(path.replace("\\", "/"))
    if os.path.isabs(path):
        return "file://" + quote(path)
    return quote(path.replace("\\", "/"))


def _first_sentence(message: str, limit: int = 120) -> str:
    """The message up to its first ``. ``, ``: `` or ``; `` outside brackets, at most ``limit`` long."""
    s = " ".join(message.split())
    depth = 0
    for i, ch in enumerate(s):
        depth += (ch in "([{") - (ch in ")]}")
        if depth <= 0 and ch in ".:;" and (i + 1 == len(s) or s[i + 1] == " "):
            s = s[:i]
            break
    return s if len(s) <= limit else s[: limit - 3].rstrip() + "..."


def _describe(entry) -> str:
    """A rule description from a string, a ``(severity, title, doc)`` tuple or a dict."""
    if isinstance(entry, str):
        return entry
    if isinstance(entry, (tuple, list)) and entry:
        return str(entry[1] if len(entry) >= 2 else entry[0])
    if isinstance(entry, dict):
        return str(entry.get("title") or entry.get("short") or entry.get("description") or "")
    return ""
