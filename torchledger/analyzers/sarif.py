"""Findings as SARIF 2.1.0, the format code-scanning services (GitHub, GitLab, IDEs) read.

    >>> from torchledger.analyzers.lint import RULES, lint_source
    >>> log = findings_to_sarif(lint_source("import torch\\ntorch.load('a.pt')\\n", "a.py"), RULES)
    >>> log["runs"][0]["results"][0]["locations"][0]["physicalLocation"]["region"]
    {'startLine': 2}

Shared by ``lint --format sarif`` and ``audit --format sarif``: findings may be
:class:`~torchledger.record.Finding` objects or their dicts, and a finding whose rule is not in
``rules`` still gets a rule entry (its id as description), so every ``ruleIndex`` is valid.

Known limitations: findings carry a line but no column; a finding with no ``path:line``
location (an audit finding about a module) gets a logical location (the module name) only.
"""
from __future__ import annotations

import os
from urllib.parse import quote

__all__ = ["findings_to_sarif", "SARIF_SCHEMA"]

SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"
_LEVELS = {"error": "error", "warning": "warning", "info": "note"}


def findings_to_sarif(findings, rules=None, *, tool_version=None) -> dict:
    """One SARIF log (a JSON-ready dict) with one run of tool ``torchledger``.

    ``rules`` maps rule id -> ``(severity, title, doc)`` (the shape of ``lint.RULES``); every
    rule given is listed in ``tool.driver.rules``, followed by any other rule a finding names.
    """
    items = [f.to_dict() if hasattr(f, "to_dict") else dict(f) for f in findings]
    table = dict(rules or {})
    for item in items:
        table.setdefault(item["rule"], (item.get("severity", "warning"), item["rule"], ""))
    index = {rule: i for i, rule in enumerate(table)}
    driver = {"name": "torchledger", "version": tool_version or _version(),
              "rules": [_rule(rule, *spec) for rule, spec in table.items()]}
    return {"$schema": SARIF_SCHEMA, "version": "2.1.0",
            "runs": [{"tool": {"driver": driver},
                      "results": [_result(item, index) for item in items]}]}


def _rule(rule: str, severity: str, title: str, doc: str) -> dict:
    out = {"id": rule, "name": rule,
           "shortDescription": {"text": title or rule},
           "defaultConfiguration": {"level": _LEVELS.get(severity, "warning")}}
    if doc:
        out["fullDescription"] = {"text": doc}
        out["help"] = {"text": doc}
    return out


def _result(item: dict, index: dict) -> dict:
    text = item["message"]
    if item.get("hint"):
        text = f"{text} (hint: {item['hint']})"
    out = {"ruleId": item["rule"], "ruleIndex": index[item["rule"]],
           "level": _LEVELS.get(item.get("severity"), "warning"), "message": {"text": text}}
    location = item.get("location")
    if location:
        path, _, line = str(location).rpartition(":")
        if not (path and line.isdigit()):
            path, line = str(location), ""
        physical = {"artifactLocation": {"uri": _uri(path)}}
        if line:
            physical["region"] = {"startLine": max(1, int(line))}
        out["locations"] = [{"physicalLocation": physical}]
    elif item.get("module") is not None:
        out["locations"] = [{"logicalLocations": [
            {"fullyQualifiedName": item["module"] or "<root>", "kind": "module"}]}]
    props = {k: item[k] for k in ("measured", "expected", "module") if item.get(k) is not None}
    if props:
        out["properties"] = props
    return out


def _uri(path: str) -> str:
    """A relative, forward-slash URI for paths under the working directory; never ``../``."""
    if os.path.isabs(path) or ".." in path.replace(os.sep, "/").split("/"):
        try:
            rel = os.path.relpath(path)
        except ValueError:                      # another drive on Windows
            rel = None
        if rel is None or rel.startswith(".."):
            # outside the working directory: from the git work tree's root, else file://
            from ..render.sarif import artifact_uri
            return artifact_uri(path)
        path = rel
    return quote(path.replace(os.sep, "/"), safe="/:@!$&'()*+,;=-._~")


def _version() -> str:
    try:
        from torchledger import __version__
        return __version__
    except ImportError:                         # NB: vendored copies without the package
        return "0"
