"""The rule catalogue (torchledger/rules.py) is the one list: every id the code can emit is in it,
every entry's docs anchor names a real heading, and docs/findings.md's table lists every id."""
from __future__ import annotations

import os
import re

from torchledger.rules import RULES, rules_in, title

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _read(rel: str) -> str:
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


def test_every_emitted_rule_id_is_catalogued():
    ids = set()
    for folder, _, files in os.walk(os.path.join(ROOT, "torchledger")):
        for name in files:
            if name.endswith(".py") and name != "rules.py":
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    ids |= set(re.findall(r"TL-[A-Z]+-\d{3}", f.read()))
    assert ids, "no rule id found in the code"
    assert ids <= set(RULES), sorted(ids - set(RULES))


def test_every_anchor_names_a_heading():
    for rid, rule in RULES.items():
        assert rule.severity in ("error", "warning", "info") and rule.title and rule.doc, rid
        path, _, anchor = rule.anchor.partition("#")
        headings = {_slug(m) for m in re.findall(r"^#+ (.+)$", _read(path), re.M)}
        assert anchor in headings, f"{rid}: no heading #{anchor} in {path}"


def test_findings_table_lists_every_rule():
    table = _read("docs/findings.md").split("# Findings (stable rule ids)")[1]
    listed = set(re.findall(r"TL-[A-Z]+-\d{3}", table))
    for rid in RULES:
        if rid.startswith("TL-LINT-"):
            continue                                  # one row points at docs/lint-rules.md
        family = rid.rsplit("-", 1)[0]
        assert rid in listed or f"{family}-001/" in table, f"{rid} missing from docs/findings.md's table"


def test_lookups():
    assert set(rules_in("TL-LINT-")) == {f"TL-LINT-{i:03d}" for i in range(1, 10)}
    assert title("TL-LEAK-003") == "Gradients not cleared after the optimizer step"
    assert title("TL-NOPE-999") == "TL-NOPE-999"     # an unknown id is its own title
