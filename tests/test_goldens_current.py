"""The golden reports' inputs are current: tests/data/make_records.py, run now in a temporary
folder, writes the committed tests/data/<scenario>/record.json byte for byte. A tracer
change that alters a record fails here (rerun the script, then
``pytest tests/test_render.py --update-goldens``), as the snapshot fixtures' check does
(tests/test_snapshot.py::test_committed_files_match_the_script)."""
from __future__ import annotations

import difflib
import importlib.util
import os

import pytest

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
_spec = importlib.util.spec_from_file_location("make_records", os.path.join(DATA, "make_records.py"))
make_records = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_records)


@pytest.mark.parametrize("name", sorted(make_records.SCENARIOS))
def test_committed_records_match_the_script(name, tmp_path):
    make_records.main([name], out=str(tmp_path))
    with open(os.path.join(tmp_path, name, "record.json"), encoding="utf-8") as f:
        fresh = f.read()
    with open(os.path.join(DATA, name, "record.json"), encoding="utf-8") as f:
        committed = f.read()
    if fresh != committed:
        diff = "".join(list(difflib.unified_diff(committed.splitlines(True), fresh.splitlines(True),
                                                 "committed", "regenerated"))[:40])
        pytest.fail(f"tests/data/{name}/record.json is stale: run python tests/data/make_records.py "
                    f"and pytest tests/test_render.py --update-goldens\n{diff}")


def test_the_check_sees_a_change(tmp_path, monkeypatch):
    # a tracer whose record differed by one field would fail the comparison above
    real = make_records.normalise

    def changed(rec):
        rec = real(rec)
        rec.totals["grad_bytes"] += 1
        return rec
    monkeypatch.setattr(make_records, "normalise", changed)
    make_records.main(["empty"], out=str(tmp_path))
    with open(os.path.join(tmp_path, "empty", "record.json"), encoding="utf-8") as f:
        fresh = f.read()
    with open(os.path.join(DATA, "empty", "record.json"), encoding="utf-8") as f:
        assert f.read() != fresh
