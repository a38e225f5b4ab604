"""Property: any mutation of a scenario record gives exit 0 with valid output, or exit 2 with
exactly one line on stderr, for ``report`` in every format and for ``--baseline``.

Bounded to seconds here; the long run is ``python tests/_record_fuzz.py 20000``.
"""
from __future__ import annotations

import json
import os
import tempfile

from _optional_hypothesis import given, settings, st
from _record_fuzz import (LITERALS, MUTATIONS, PREDICTION_LITERALS, SCENARIOS, STEP_TIME, check_case, load,
                          mutate, paths, prediction_paths, with_predictions)

RECORDS = {os.path.basename(os.path.dirname(p)): load(p) for p in SCENARIOS}


@st.composite
def mutated_records(draw):
    record = RECORDS[draw(st.sampled_from(sorted(RECORDS)))]
    steps = draw(st.lists(st.tuples(st.sampled_from(MUTATIONS), st.integers(0, 2**30),
                                    st.sampled_from(LITERALS)), min_size=1, max_size=3))
    return mutate(record, steps)


@settings(max_examples=15, deadline=None)
@given(mutated_records())
def test_mutated_record_renders_or_is_refused_in_one_line(text):
    with tempfile.TemporaryDirectory() as tmp:
        assert check_case(text, tmp) == []


#: Text a record carries into outputs: drawn characters, and the strings known to bite
#: (formulas, a lone surrogate, blank or root-only paths, devices, a line past int32).
ANY_TEXT = st.one_of(
    st.text(st.characters(codec=None, exclude_categories=()), max_size=30),
    st.sampled_from(["=1+1", "+x", "-y", "@SUM(A1)", "\tz", "\rz", "a\rb", "\ud800", "x\udfff", "", "   ",
                     "./", ".", "/", "..", "../../x.py", "/dev/zero", "C:\\m.py", "\\\\srv\\s\\m.py",
                     "a.py:0", "a.py:2147483648", "a.py:" + "9" * 5000, "a.py:3:0", "a\x00b"]))
LINES = st.one_of(st.none(), st.sampled_from([-1, 0, 1, 2**31 - 1, 2**31, 2**63]), st.integers(1, 10**6))


@st.composite
def records_with_hostile_text(draw):
    """cruncher-copy with drawn text in the fields that reach CSV cells and SARIF locations."""
    d = json.loads(json.dumps(RECORDS["cruncher-copy"]))
    d["modules"][draw(st.integers(0, len(d["modules"]) - 1))]["name"] = draw(ANY_TEXT)
    d["modules"][draw(st.integers(0, len(d["modules"]) - 1))]["type"] = draw(ANY_TEXT)
    for f in d["findings"]:
        f["location"] = draw(st.one_of(st.none(), ANY_TEXT,
                                       st.builds("{}:{}".format, ANY_TEXT, st.integers(-5, 10**30))))
    d["meta"]["audit"] = {"file": draw(ANY_TEXT), "entry": "audit_spec",
                          "spec_line": draw(LINES)}
    return json.dumps(d)


@settings(max_examples=15, deadline=None)
@given(records_with_hostile_text())
def test_hostile_text_gives_safe_csv_and_valid_sarif_or_one_line(text):
    with tempfile.TemporaryDirectory() as tmp:
        assert check_case(text, tmp) == []


def test_the_mutations_reach_both_outcomes():
    """Not a fuzz that only ever refuses: of these fixed cases some load, some are refused."""
    from click.testing import CliRunner

    from torchledger.cli import cli
    codes = []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "r.json")
        for i, literal in enumerate(LITERALS[:20]):
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(mutate(RECORDS["cruncher-copy"], [("replace", 7 * i + 3, literal)]))
            codes.append(CliRunner().invoke(cli, ["report", path, "--format", "json"]).exit_code)
    assert set(codes) == {0, 2}, codes


# -- the prediction fields (audit --gpu): predictions.step_time, predicted_seconds --------------
PREDICTED = {name: with_predictions(record) for name, record in RECORDS.items()}


@st.composite
def mutated_predictions(draw):
    record = PREDICTED[draw(st.sampled_from(sorted(PREDICTED)))]
    steps = draw(st.lists(st.tuples(st.sampled_from(MUTATIONS), st.integers(0, 2**30),
                                    st.sampled_from(PREDICTION_LITERALS + LITERALS)), min_size=1, max_size=3))
    return mutate(record, steps, prediction_paths(record))


@settings(max_examples=15, deadline=None)
@given(mutated_predictions())
def test_mutated_predictions_render_or_are_refused_in_one_line(text):
    with tempfile.TemporaryDirectory() as tmp:
        assert check_case(text, tmp) == []


#: Values the schema accepts for most prediction fields (and "drop": the field left out).
EDGE_VALUES = [None, 0, 1e308, 2**63 - 1, "drop"]


def test_every_step_time_field_at_its_edges():
    """Each field of predictions.step_time (nested ones too) null, 0, huge or missing, in the
    formats that print the prediction. Was: TypeError in table, markdown and html for
    ``measured_seconds`` set and ``predicted_over_measured: null``."""
    problems = []
    with tempfile.TemporaryDirectory() as tmp:
        for path in paths(STEP_TIME):
            for value in EDGE_VALUES:
                d = json.loads(json.dumps(PREDICTED["cruncher-copy"]))
                parent = d["predictions"]["step_time"]
                for key in path[:-1]:
                    parent = parent[key]
                if value == "drop":
                    del parent[path[-1]]
                else:
                    parent[path[-1]] = value
                found = check_case(json.dumps(d), tmp, ("table", "markdown", "html", "json"))
                problems += [f"{'.'.join(map(str, path))}={value}: {p}" for p in found]
    assert problems == []
