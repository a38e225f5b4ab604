"""CUDA memory snapshots on CPU: the restricted unpickler, figures checked by hand on the
synthetic snapshots of tests/data/snapshots (see make.py there), replay, leaks, join, CLI."""
from __future__ import annotations

import builtins
import gzip
import importlib.util
import io
import json
import os
import pickle
import subprocess
import zipfile

import pytest
from click.testing import CliRunner

from torchledger.analyzers.snapshot import (SnapshotError, check_snapshot, join, load_snapshot,
                                            module_peaks, never_freed, replay, summarize_snapshot)
from torchledger.cli import cli

MiB = 2**20
DATA = os.path.join(os.path.dirname(__file__), "data", "snapshots")
_spec = importlib.util.spec_from_file_location("make_snapshots", os.path.join(DATA, "make.py"))
make = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make)


def path(name):
    return os.path.join(DATA, name)


def run(*args):
    return CliRunner().invoke(cli, ["snapshot", *args])


# -- crafted pickles: refused before anything runs -----------------------------------------
class _Reduce:
    def __init__(self, fn, args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def gadgets(marker: str) -> dict:
    touch = f"open({marker!r}, 'w').close()"
    inst = f"(S'touch {marker}'\nios\nsystem\n.".encode()            # protocol 0, INST opcode

    class Persistent(pickle.Pickler):
        def persistent_id(self, obj):
            return "storage" if obj == "x" else None

    buf = io.BytesIO()
    Persistent(buf).dump({"segments": ["x"]})
    return {
        "os.system": pickle.dumps(_Reduce(os.system, (f"touch {marker}",))),
        "builtins.eval": pickle.dumps(_Reduce(builtins.eval, (touch,))),
        "builtins.exec": pickle.dumps(_Reduce(builtins.exec, (touch,)), protocol=2),
        "subprocess.Popen": pickle.dumps(_Reduce(subprocess.Popen, (["touch", marker],))),
        "nested": pickle.dumps({"segments": [{"total_size": 0, "blocks": [
            {"size": 1, "state": "inactive", "frames": [_Reduce(builtins.eval, (touch,))]}]}],
            "device_traces": []}),
        "a bare global": pickle.dumps(os.system),
        "protocol 0 INST": inst,
        "persistent id": buf.getvalue(),
    }


def test_gadget_would_run_with_plain_pickle(tmp_path):
    # the teeth of the tests below: the same bytes do run code through pickle.loads
    marker = tmp_path / "ran"
    pickle.loads(gadgets(str(marker))["builtins.eval"])
    assert marker.exists()


@pytest.mark.parametrize("kind", list(gadgets("m")))
def test_crafted_pickle_is_refused_and_nothing_runs(tmp_path, kind):
    marker = tmp_path / "ran"
    data = gadgets(str(marker))[kind]
    with pytest.raises(SnapshotError) as e:
        load_snapshot(data)
    msg = str(e.value)
    assert "\n" not in msg and "nothing in it was run" in msg
    assert not marker.exists()
    f = tmp_path / "evil.pickle"
    f.write_bytes(data)
    r = run(str(f))
    assert r.exit_code == 2 and not marker.exists()
    assert r.output.count("\n") == 1 and "Traceback" not in r.output and "refused" in r.output


def test_refusal_names_the_global():
    with pytest.raises(SnapshotError, match=r"builtins\.eval"):
        load_snapshot(gadgets("m")["builtins.eval"])
    with pytest.raises(SnapshotError, match=r"subprocess\.Popen"):
        load_snapshot(gadgets("m")["subprocess.Popen"])


_BAD_INPUTS = [
    (b"", "is empty"),
    (pickle.dumps(make.history())[:-40], "truncated"),
    (b"hello, this is text", "not a valid pickle"),
    (json.dumps({"schema": "torchledger/1"}).encode(), "it is JSON"),
    (gzip.compress(pickle.dumps(make.history())), "gzip"),
    (pickle.dumps(42), "holds a int"),
    (pickle.dumps("segments"), "holds a str"),
    (pickle.dumps([1, 2]), "holds a list"),
    (pickle.dumps({"device_traces": []}), "no 'segments' key"),
    (pickle.dumps({"segments": {}}), "must be lists"),
    (pickle.dumps({"segments": [{"blocks": []}]}), "segments[0]"),
    (pickle.dumps({"segments": [{"total_size": 4, "blocks": [{"size": 4}]}]}), "segments[0].blocks[0]"),
    (pickle.dumps({"segments": [], "device_traces": [[{"action": "alloc", "addr": 1}]]}), "device_traces[0][0]"),
]


# ids from the words: the data holds pickles of timed histories and gzip's mtime, which differ
# between processes, and pytest-xdist's workers must collect the same ids
@pytest.mark.parametrize("data, words", _BAD_INPUTS, ids=[words for _, words in _BAD_INPUTS])
def test_bad_input_is_one_line(tmp_path, data, words):
    with pytest.raises(SnapshotError) as e:
        load_snapshot(data)
    assert words in str(e.value) and "\n" not in str(e.value)
    f = tmp_path / "bad.pickle"
    f.write_bytes(data)
    r = run(str(f))
    assert r.exit_code == 2, r.output
    assert r.output.startswith("torchledger: error: ") and r.output.count("\n") == 1


def test_zip_and_missing_file(tmp_path):
    z = tmp_path / "model.pt"
    with zipfile.ZipFile(z, "w") as f:
        f.writestr("archive/data.pkl", b"x")
    with pytest.raises(SnapshotError, match="zip archive"):
        load_snapshot(z)
    r = run(str(tmp_path / "missing.pickle"))
    assert r.exit_code == 2 and "cannot read" in r.output and r.output.count("\n") == 1


# -- figures, checked by hand --------------------------------------------------------------
def test_committed_files_match_the_script():
    for name, fn in make.SNAPSHOTS.items():
        with open(path(name), "rb") as f:
            assert f.read() == pickle.dumps(fn(), protocol=4), f"{name}: rerun make.py"


def test_fragmented_segment_by_hand():
    # one 20 MiB segment: 2 MiB active, 6 MiB free, 4 MiB active (4 MiB - 100 requested), 8 MiB free
    s = summarize_snapshot(load_snapshot(path("fragmented.pickle")))
    assert s["segments"] == 1 and s["reserved_bytes"] == 20 * MiB
    assert s["allocated_bytes"] == 6 * MiB - 100          # requested bytes of active blocks
    assert s["allocated_block_bytes"] == s["active_bytes"] == 6 * MiB
    assert s["free_bytes"] == 14 * MiB and s["free_blocks"] == 2
    assert s["largest_free_bytes"] == 8 * MiB
    assert s["fragmentation"] == pytest.approx(1 - 8 / 14)
    top = s["top_allocations"]
    assert [g["size"] for g in top] == [4 * MiB, 2 * MiB]
    assert top[0]["location"] == "model.py:41 forward" and top[0]["requested_size"] == 4 * MiB - 100
    # the frame inside torch is skipped for the location, kept in the frames
    assert top[1]["location"] == "model.py:40 forward" and "linear.py:125 forward" in top[1]["frames"][0]
    assert s["history"] == []


def test_legacy_list_of_segments_reads_like_the_dict():
    a = summarize_snapshot(load_snapshot(path("legacy.pickle")))
    b = summarize_snapshot(load_snapshot(path("fragmented.pickle")))
    assert a["fragmentation"] == b["fragmentation"] and a["top_allocations"] == b["top_allocations"]


def test_devices_and_streams():
    blk = make.block
    segs = [make.segment(0, [blk(0, 4 * MiB, "active_allocated"), blk(4 * MiB, 4 * MiB, "inactive")]),
            make.segment(2**30, [blk(2**30, 2 * MiB, "active_pending_free")], stream=7),
            make.segment(2**31, [blk(2**31, 1 * MiB, "inactive"), blk(2**31 + MiB, MiB, "inactive")], device=1)]
    s = summarize_snapshot({"segments": segs, "device_traces": []})
    assert [d["device"] for d in s["devices"]] == [0, 1]
    d0, d1 = s["devices"]
    assert (d0["reserved_bytes"], d0["allocated_bytes"], d0["pending_free_bytes"]) == (10 * MiB, 4 * MiB, 2 * MiB)
    assert d0["active_bytes"] == 6 * MiB and d0["fragmentation"] == 0.0
    assert d1["free_bytes"] == 2 * MiB and d1["fragmentation"] == pytest.approx(0.5)
    assert [(r["device"], r["stream"]) for r in s["streams"]] == [(0, 0), (0, 7), (1, 0)]
    assert summarize_snapshot({"segments": segs, "device_traces": []}, device=1)["segments"] == 1


def test_other_tools_blocks_without_address_or_requested_size():
    seg = {"device": 0, "address": 0, "total_size": 3 * MiB, "stream": 0, "blocks": [
        {"size": MiB, "state": "active_allocated", "frames": []}, {"size": 2 * MiB, "state": "inactive"}]}
    s = summarize_snapshot({"segments": [seg]})
    assert s["allocated_bytes"] == MiB and s["largest_free_bytes"] == 2 * MiB
    assert s["top_allocations"][0]["location"] is None


def test_empty_snapshot():
    s = summarize_snapshot({"segments": [], "device_traces": [[]]})
    assert s["segments"] == s["reserved_bytes"] == s["fragmentation"] == 0 and s["history"] == []
    assert check_snapshot(s) == []


# -- history: replay, peak, fragmentation at the peak, never freed --------------------------
def test_replay_by_hand():
    snap = load_snapshot(path("history.pickle"))
    h = replay(snap, 0)
    assert h["entries"] == 27
    # before recording: the small segment (2 MiB) with its 1000-byte allocation
    assert h["start"] == {"allocated_bytes": 1000, "reserved_bytes": 2 * MiB}
    p = h["peak"]
    assert p["index"] == 8 and p["time_us"] == make.T0 + 80
    assert p["allocated_bytes"] == 1000 + (4 + 6 + 4 + 12) * MiB      # W + A + G + X
    assert p["reserved_bytes"] == (2 + 20 + 16) * MiB                   # small + S + S2
    # free at the peak: S [14, 20) MiB, S2 [12, 16) MiB, the small segment's 2 MiB - 1 KiB
    assert p["free_bytes"] == 12 * MiB - 1024 and p["free_blocks"] == 3
    assert p["largest_free_bytes"] == 6 * MiB
    assert p["fragmentation"] == pytest.approx(1 - 6 * MiB / (12 * MiB - 1024))
    assert p["location"] == "model.py:41 forward"
    assert h["max_reserved_bytes"] == 38 * MiB
    last = h["timeline"][-1]
    assert last["index"] == 26 and last["allocated_bytes"] == 12 * MiB + 1000 and last["reserved_bytes"] == 22 * MiB
    assert any(r["index"] == 8 for r in h["timeline"])


def test_expandable_segment_mapped_in_pieces_is_one_range():
    x = 2**40
    ev = [{"action": "segment_map", "addr": x, "size": 2 * MiB}, {"action": "alloc", "addr": x, "size": MiB},
          {"action": "segment_map", "addr": x + 2 * MiB, "size": 2 * MiB},
          {"action": "alloc", "addr": x + 3 * MiB, "size": MiB},
          {"action": "free_requested", "addr": x + 3 * MiB, "size": MiB},
          {"action": "segment_unmap", "addr": x + 2 * MiB, "size": 2 * MiB}]
    seg = {"device": 0, "address": x, "total_size": 2 * MiB, "is_expandable": True, "blocks": [
        {"address": x, "size": MiB, "state": "active_allocated"}, {"size": MiB, "state": "inactive"}]}
    p = replay({"segments": [seg], "device_traces": [ev]}, 0)["peak"]
    # at the peak (event 3): mapped [x, x+4 MiB) holds [x, x+1) and [x+3, x+4): one 2 MiB gap
    assert p["index"] == 3 and p["reserved_bytes"] == 4 * MiB and p["allocated_bytes"] == 2 * MiB
    assert (p["free_bytes"], p["largest_free_bytes"], p["segments"]) == (2 * MiB, 2 * MiB, 1)


STEPS = [2, 15, 19, 23]          # step starts in history.pickle (make.py docstring)


def test_never_freed_and_steps():
    snap = load_snapshot(path("history.pickle"))
    nf = never_freed(snap, 0)
    assert nf["count"] == 6 and nf["bytes"] == (4 + 4 + 4) * MiB       # W, G, L0..L3
    assert {g["location"]: g["count"] for g in nf["groups"]}["train.py:30 step"] == 4
    by_time = never_freed(snap, 0, steps=[{"time_us": make.T0 + 10 * i - 3} for i in STEPS])
    assert by_time["steps"] == never_freed(snap, 0, steps=STEPS)["steps"]
    kept = [(s["start_index"], s["end_index"], s["retained_bytes"]) for s in by_time["steps"]]
    assert kept == [(2, 15, 5 * MiB), (15, 19, MiB), (19, 23, MiB), (23, 27, MiB)]   # G + L0, then L1..L3


def test_check_snapshot_findings():
    snap = load_snapshot(path("history.pickle"))
    leak = check_snapshot(summarize_snapshot(snap, steps=STEPS))
    assert [(f.rule, f.severity) for f in leak] == [("TL-CUDA-002", "warning")]
    assert leak[0].location == "train.py:30 step" and leak[0].measured == [5 * MiB, MiB, MiB, MiB]
    once = check_snapshot(summarize_snapshot(snap))                # no steps: info only
    assert [(f.rule, f.severity) for f in once] == [("TL-CUDA-002", "info")]
    frag = summarize_snapshot(load_snapshot(path("fragmented.pickle")))
    assert check_snapshot(frag) == []                              # 14 MiB free: below 64 MiB
    f = check_snapshot(frag, {"min_free_bytes": 0})
    assert [x.rule for x in f] == ["TL-CUDA-001"] and f[0].measured == pytest.approx(1 - 8 / 14, abs=1e-4)


def test_fragmentation_finding_at_gib_scale():
    GiB, blk = 2**30, make.block
    # 3 x (1 GiB used + 2 GiB free): 9 GiB reserved for 3 allocated, largest free 2 of 6 GiB
    seg = make.segment(0, [b for k in range(3) for b in (blk(3 * k * GiB, GiB, "active_allocated"),
                                                         blk((3 * k + 1) * GiB, 2 * GiB, "inactive"))])
    f = check_snapshot(summarize_snapshot({"segments": [seg], "device_traces": []}))
    assert [(x.rule, x.severity) for x in f] == [("TL-CUDA-001", "warning")]
    assert f[0].measured == pytest.approx(1 - 2 / 6, abs=1e-4) and "9.00 GiB reserved" in f[0].message
    healthy = make.segment(0, [blk(0, GiB, "active_allocated"), blk(GiB, 5 * GiB, "inactive")])
    assert check_snapshot(summarize_snapshot({"segments": [healthy], "device_traces": []})) == []


# -- join and per-module peaks ---------------------------------------------------------------
def marks():
    t = lambda i: make.T0 + 10 * i - 5                            # just before event i
    return [{"time_us": t(2), "module": "blocks.0", "phase": "forward"},
            {"time_us": t(3), "module": "blocks.0.mlp", "phase": "forward"},
            {"time_us": t(6), "module": "blocks.0.mlp", "phase": "backward"},
            {"time_us": t(12), "module": None, "phase": "optimizer"},
            {"time_us": t(14), "module": None, "phase": None},
            {"time_us": t(15), "module": "", "phase": "forward", "category": "inputs"}]


def test_join_by_hand():
    rows = {r["index"]: r for r in join(load_snapshot(path("history.pickle")), marks())}
    got = {i: (r["module"], r["phase"], r["category"]) for i, r in rows.items() if i <= 15}
    assert got == {
        1: (None, None, "unknown"),                          # before the first mark: weights
        2: ("blocks.0", "forward", "activations"),            # freed at 12, after forward ended (6)
        3: ("blocks.0.mlp", "forward", "temporaries"),        # freed at 4, inside forward
        6: ("blocks.0.mlp", "backward", "gradients"),         # never freed
        8: ("blocks.0.mlp", "backward", "temporaries"),       # freed at 9, before optimizer (12)
        14: (None, None, "unknown"),
        15: ("", "forward", "inputs"),                        # the mark's own category wins
    }
    assert rows[2]["freed_index"] == 12 and rows[6]["freed_index"] is None
    assert rows[2]["location"] == "model.py:40 forward" and rows[2]["size"] == 6 * MiB


def test_join_accepts_indices_and_a_trace_list():
    snap = load_snapshot(path("history.pickle"))
    by_index = [{**m, "index": i} for m, i in zip(marks(), [2, 3, 6, 12, 14, 15])]
    for m in by_index:
        del m["time_us"]
    assert join(snap["device_traces"][0], by_index) == join(snap, marks())
    with pytest.raises(ValueError, match="sorted"):
        join(snap, list(reversed(marks())))
    with pytest.raises(ValueError, match="time_us"):
        join([{"action": "alloc", "addr": 1, "size": 1}], [{"time_us": 5, "module": "m", "phase": None}])


def test_module_peaks():
    rows = {r["module"]: r for r in module_peaks(load_snapshot(path("history.pickle")), marks())}
    assert rows["blocks.0"]["peak_allocated_bytes"] == 10 * MiB + 1000            # W + A at event 2
    assert rows["blocks.0.mlp"]["peak_allocated_bytes"] == 26 * MiB + 1000        # X at event 8
    assert rows["blocks.0"]["inclusive_peak_allocated_bytes"] == 26 * MiB + 1000
    assert rows["blocks"]["peak_allocated_bytes"] is None
    assert rows[""]["inclusive_peak_allocated_bytes"] == 26 * MiB + 1000


# -- the command ---------------------------------------------------------------------------------
def test_cli_table():
    r = run(path("history.pickle"))
    assert r.exit_code == 0, r.output
    for words in ("reserved", "22.0 MiB", "fragmentation  0.40", "26.0 MiB allocated, 38.0 MiB reserved at event 8",
                  "train.py:30 step", "TL-CUDA-002"):
        assert words in r.output, words


def test_cli_json_and_output(tmp_path):
    r = run(path("fragmented.pickle"), "--format", "json", "--top", "1")
    assert r.exit_code == 0
    d = json.loads(r.output)
    assert (d["segments"], d["reserved_bytes"], d["allocated_bytes"], d["largest_free_bytes"]) == \
        (1, 20 * MiB, 6 * MiB - 100, 8 * MiB)
    assert len(d["top_allocations"]) == 1 and d["top_allocations"][0]["frames"]
    out = tmp_path / "s.json"
    r = run(path("history.pickle"), "--output", str(out))
    assert r.exit_code == 0 and json.loads(out.read_text())["history"][0]["peak"]["index"] == 8
    r = run(path("history.pickle"), "-o", str(tmp_path / "s.txt"))
    assert "History, device 0" in (tmp_path / "s.txt").read_text()


def test_cli_usage_errors_are_one_line():
    for args in (["--top", "0"], ["--format", "csv"]):
        r = run(path("history.pickle"), *args)
        assert r.exit_code == 2 and r.output.count("\n") == 1 and "Traceback" not in r.output


# -- property: replaying a simulated allocator reproduces its own figures ----------------------
def simulate(seed: int, n_events: int = 300):
    """A first-fit allocator over cudaMalloc'd segments (freed when idle, now and then),
    recorded in the snapshot format.

    Sizes are multiples of 512 so blocks equal requests; returns the snapshot and, per
    event, (allocated, reserved, free, largest free) as the simulator itself saw them.
    """
    import random
    rng = random.Random(seed)
    segs, live, ev, seen = [], {}, [], []          # segs: [address, size]; live: addr -> size

    def gaps():
        out = []
        for base, size in segs:
            cur = base
            for a in sorted(x for x in live if base <= x < base + size):
                out += [(cur, a - cur)] if a > cur else []
                cur = a + live[a]
            out += [(cur, base + size - cur)] if base + size > cur else []
        return out

    def emit(e):
        ev.append(e)
        g = [s for _, s in gaps()]
        seen.append((sum(live.values()), sum(s for _, s in segs), sum(g), max(g, default=0)))

    for i in range(n_events):
        empty = [sg for sg in segs if not any(sg[0] <= a < sg[0] + sg[1] for a in live)]
        if empty and rng.random() < 0.1:                # empty_cache(): cudaFree of idle segments
            for sg in empty:
                segs.remove(sg)
                emit({"action": "segment_free", "addr": sg[0], "size": sg[1]})
        elif live and rng.random() < 0.45:
            a = rng.choice(sorted(live))
            n = live.pop(a)
            emit({"action": "free_requested", "addr": a, "size": n})
        else:
            n = 512 * rng.randint(1, 4096)
            fit = next((a for a, g in gaps() if g >= n), None)
            if fit is None:
                fit = (i + 1) << 32
                segs.append([fit, max(n, 2 * MiB)])
                emit({"action": "segment_alloc", "addr": fit, "size": segs[-1][1]})
            live[fit] = n
            emit({"action": "alloc", "addr": fit, "size": n})
    segments = []
    for base, size in segs:
        blocks = [{"address": a, "size": live[a], "state": "active_allocated"}
                  for a in live if base <= a < base + size]
        blocks += [{"address": a, "size": s, "state": "inactive"} for a, s in gaps() if base <= a < base + size]
        segments.append({"device": 0, "address": base, "total_size": size,
                         "blocks": sorted(blocks, key=lambda b: b["address"])})
    return {"segments": segments, "device_traces": [ev]}, seen


@pytest.mark.parametrize("seed", range(6))
def test_replay_matches_a_simulated_allocator(seed):
    snap, seen = simulate(seed)
    snap = load_snapshot(pickle.dumps(snap))
    h = replay(snap, 0)
    k = max(range(len(seen)), key=lambda i: seen[i][0])
    p = h["peak"]
    assert p["index"] == k and h["start"] == {"allocated_bytes": 0, "reserved_bytes": 0}
    assert (p["allocated_bytes"], p["reserved_bytes"], p["free_bytes"], p["largest_free_bytes"]) == seen[k]
    end = summarize_snapshot(snap)
    assert (end["allocated_bytes"], end["reserved_bytes"], end["free_bytes"], end["largest_free_bytes"]) == seen[-1]
    assert [r["allocated_bytes"] for r in h["timeline"]] == [seen[r["index"]][0] for r in h["timeline"]]


@pytest.mark.parametrize("name", ["fragmented.pickle", "history.pickle"])
def test_synthetic_snapshots_are_read_by_pytorchs_own_viewer(name, capsys):
    """An independent check of the format our synthetic snapshots (and so our parser) assume:
    PyTorch's memory_viz functions, which read real allocator snapshots, accept them and see
    the same segments and bytes."""
    _memory_viz = pytest.importorskip("torch.cuda._memory_viz")
    snap = load_snapshot(path(name))
    summary = summarize_snapshot(snap)
    table = _memory_viz.segsum(snap)                  # PyTorch's own per-segment summary
    assert f"segments: {summary['segments']}\n" in table
    assert f"total_reserved: {summary['reserved_bytes'] / 2**20:.1f}MiB" in table
    for plot in (_memory_viz.trace_plot, _memory_viz.segment_plot):
        html = plot(snap)
        assert isinstance(html, str) and "<html" in html.lower()
    _memory_viz.trace(snap)                           # the textual event trace
    capsys.readouterr()
