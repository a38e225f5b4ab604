"""``torchledger snapshot`` on hostile input: files that are not regular files, malformed
shapes, and pickles whose shared references would make the work explode. Every input gives
exit 0 with valid output or exit 2 with one line on stderr."""
import copy
import json
import os
import pickle
import subprocess
import sys

import pytest
from click.testing import CliRunner

from torchledger.analyzers.snapshot import SnapshotError, load_snapshot
from torchledger.cli import cli

from _optional_hypothesis import given, settings, st

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "data", "snapshots"))
import make  # noqa: E402  (tests/data/snapshots/make.py: the synthetic snapshots)


def run(*args):
    return CliRunner().invoke(cli, ["snapshot", *args])


def one_line(r, *needles) -> str:
    assert r.exit_code == 2, (r.exit_code, r.output)
    assert r.stdout == "" and "Traceback" not in r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("torchledger: error: "), r.stderr
    for n in needles:
        assert n in r.stderr, r.stderr
    return r.stderr


# -- not a regular file (item 6) ---------------------------------------------------------------
def test_dev_zero_is_refused_not_read():
    one_line(run("/dev/zero"), "/dev/zero: is a device")
    with pytest.raises(SnapshotError, match="is a device"):
        load_snapshot("/dev/zero")


def test_a_fifo_is_refused_without_hanging(tmp_path):
    fifo = tmp_path / "snap.pickle"
    os.mkfifo(fifo)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-m", "torchledger", "snapshot", str(fifo)],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and "is a FIFO" in out.stderr


def test_a_directory_is_one_line(tmp_path):
    one_line(run(str(tmp_path)), "is a directory")


# -- malformed shapes (item 4) -----------------------------------------------------------------
def _snap(**edits):
    """history.pickle's snapshot with ``edits`` applied: {"segments.0.device": value, ...}."""
    snap = copy.deepcopy(make.history())      # NB: make.py's frames are shared module globals
    for dotted, value in edits.items():
        *path, last = dotted.split(".")
        node = snap
        for p in path:
            node = node[int(p)] if isinstance(node, list) else node[p]
        node[int(last) if isinstance(node, list) else last] = value
    return snap


def _self_referencing_settings():
    settings = {"expandable_segments": False}
    settings["again"] = settings
    return _snap(allocator_settings=settings)


def _deep_settings_pickle(depth=100_000) -> bytes:
    """A snapshot whose allocator_settings["x"] is a list nested ``depth`` deep, written with
    raw opcodes (pickle.dumps itself would recurse that deep): EMPTY_LIST ``]`` ``depth``
    times, then APPEND ``a`` ``depth - 1`` times puts each list in the one below it."""
    head = pickle.dumps({"segments": [], "device_traces": []}, protocol=2)[:-2]  # ... up to SETITEMS
    key = b"X" + len(b"allocator_settings").to_bytes(4, "little") + b"allocator_settings"
    inner = b"}X\x01\x00\x00\x00x" + b"]" * depth + b"a" * (depth - 1) + b"s"   # {"x": [[[...]]]}
    return head + key + inner + b"u."


BIG = 10**4000                                          # a 4,001-digit int
MALFORMED = {
    "device as a list": (lambda: _snap(**{"segments.0.device": [0]}), "segments[0].device is a list"),
    "stream as a dict": (lambda: _snap(**{"segments.1.stream": {"id": 7}}), "segments[1].stream is a dict"),
    "frames as an int": (lambda: _snap(**{"segments.0.blocks.0.frames": 3}),
                         "segments[0].blocks[0].frames is the int 3"),
    "event frames as an int": (lambda: _snap(**{"device_traces.0.1.frames": 3}),
                               "device_traces[0][1].frames is the int 3"),
    "total_size as a string": (lambda: _snap(**{"segments.0.total_size": "20971520"}),
                               "segments[0].total_size is the string '20971520'"),
    "requested_size as a string": (lambda: _snap(**{"segments.0.blocks.0.requested_size": "4 MiB"}),
                                   "segments[0].blocks[0].requested_size is the string"),
    "event size as a string": (lambda: _snap(**{"device_traces.0.2.size": "6291456"}),
                               "device_traces[0][2].size is the string"),
    "block size of 4,001 digits": (lambda: _snap(**{"segments.0.blocks.0.size": BIG}),
                                   "segments[0].blocks[0].size is an int of over 100 digits"),
    "event addr of 4,001 digits": (lambda: _snap(**{"device_traces.0.1.addr": BIG}),
                                   "device_traces[0][1].addr is an int of over 100 digits"),
    "negative size": (lambda: _snap(**{"segments.0.blocks.1.size": -1}), "blocks[1].size is the int -1"),
    "time_us as a float": (lambda: _snap(**{"device_traces.0.0.time_us": 1.5}), "time_us is a float"),
    "frame line as a string": (lambda: _snap(**{"segments.0.blocks.0.frames.0.line": "12"}),
                               "frames[0].line is the string '12'"),
    "frame without a name": (lambda: _snap(**{"segments.0.blocks.0.frames.1": {"filename": "a.py", "line": 1}}),
                             "frames[1] (keys 'filename', 'line') is a dict; expected a dict with 'name'"),
    "unknown block state": (lambda: _snap(**{"segments.0.blocks.0.state": "allocated"}),
                            "state is the string 'allocated'; expected one of active_allocated"),
    "self-referencing allocator_settings": (_self_referencing_settings, "allocator_settings"),
    "NaN in allocator_settings": (lambda: _snap(allocator_settings={"gc": float("nan")}),
                                  "allocator_settings['gc'] is a float; expected a finite number"),
    "a block whose frames are its segment's blocks": (None, "segments[0].blocks[0].frames[0] (keys "
                                                      "'address', 'size'"),
}


def _malformed_bytes(kind) -> bytes:
    if kind == "a block whose frames are its segment's blocks":
        snap = copy.deepcopy(make.history())
        blocks = snap["segments"][0]["blocks"]
        blocks[0]["frames"] = blocks            # a cycle: the schema meets a block where a frame goes
        return pickle.dumps(snap, protocol=4)
    return pickle.dumps(MALFORMED[kind][0](), protocol=4)


@pytest.mark.parametrize("kind", sorted(MALFORMED))
def test_malformed_shape_is_one_line(tmp_path, kind):
    f = tmp_path / "bad.pickle"
    f.write_bytes(_malformed_bytes(kind))
    for fmt in ("json", "table"):
        one_line(run(str(f), "--format", fmt), MALFORMED[kind][1])
    with pytest.raises(SnapshotError, match="expected"):
        load_snapshot(str(f))


def test_deeply_nested_allocator_settings_is_one_line(tmp_path):
    f = tmp_path / "deep.pickle"
    f.write_bytes(_deep_settings_pickle())
    one_line(run(str(f)), "allocator_settings['x'][0][0]", "nested at most 3 deep")


def test_a_lone_surrogate_in_a_frame_is_written_escaped(tmp_path):
    snap = _snap(**{"segments.0.blocks.0.frames.1": {"filename": "tr\udc80in.py", "line": 12, "name": "build"}})
    f = tmp_path / "s.pickle"
    f.write_bytes(pickle.dumps(snap, protocol=4))
    r = run(str(f), "--format", "json")
    assert r.exit_code == 0, r.output
    frames = json.loads(r.stdout)["top_allocations"][0]["frames"]
    assert "tr\\udc80in.py:12 build" in frames
    assert run(str(f)).exit_code == 0                     # the table is printable too


# -- shared references: a few bytes that read as billions of nodes -----------------------------
def _laughs_segments(n=1000) -> bytes:
    """n segments, each the same one of n blocks, each the same one with n frames, each the
    same frame: n**3 = 10**9 frames for a few bytes per reference."""
    frame = {"filename": "a.py", "line": 1, "name": "f"}
    block = {"size": 512, "requested_size": 512, "state": "active_allocated", "frames": [frame] * n}
    seg = {"device": 0, "address": 0, "total_size": 512 * n, "stream": 0, "blocks": [block] * n}
    return pickle.dumps({"segments": [seg] * n, "device_traces": []}, protocol=4)


def _laughs_traces(n=1000) -> bytes:
    frame = {"filename": "a.py", "line": 1, "name": "f"}
    event = {"action": "alloc", "addr": 0, "size": 512, "stream": 0, "time_us": 1, "frames": [frame] * n}
    return pickle.dumps({"segments": [], "device_traces": [[event] * n] * n}, protocol=4)


@pytest.mark.parametrize("build", [_laughs_segments, _laughs_traces])
def test_billion_laughs_is_refused_in_under_a_second(tmp_path, build):
    import time
    data = build()
    assert len(data) < 8_000                              # about 6 KB: 3 x 1000 two-byte references
    f = tmp_path / "laughs.pickle"
    f.write_bytes(data)
    t0 = time.perf_counter()
    r = run(str(f), "--format", "json")
    seconds = time.perf_counter() - t0
    one_line(r, "billion laughs", "refused unread")
    assert seconds < 1.0, seconds


def test_nested_shared_lists_in_a_key_nothing_reads_cost_nothing(tmp_path):
    # the shape: a list of 10 references to a list of 10 references ..., 200 deep
    laughs = ["x"]
    for _ in range(200):
        laughs = [laughs] * 10
    snap = copy.deepcopy(make.history())
    snap["user_metadata"] = laughs                        # a key the format does not define
    data = pickle.dumps(snap, protocol=4)
    assert len(data) < 10_000                             # 10**200 lists in under 10 KB
    f = tmp_path / "s.pickle"
    f.write_bytes(data)
    r = run(str(f), "--format", "json")
    assert r.exit_code == 0 and "user_metadata" not in json.loads(r.stdout)
    snap["allocator_settings"] = {"roundup_power2_divisions": laughs}   # where it is read: refused
    f.write_bytes(pickle.dumps(snap, protocol=4))
    one_line(run(str(f)), "nested at most 3 deep")


def test_thousands_of_device_traces_are_refused(tmp_path):
    # each device's trace is summarised on its own (a history section of the report): 5,000
    # one-event traces in 35 KB took 10 s to print; a machine has at most a few dozen GPUs
    event = {"action": "alloc", "addr": 0, "size": 512, "stream": 0, "time_us": 1, "frames": []}
    f = tmp_path / "s.pickle"
    f.write_bytes(pickle.dumps({"segments": [], "device_traces": [[event] for _ in range(1025)]}))
    one_line(run(str(f)), "'device_traces' holds 1,025 traces; expected one per CUDA device, at most 1,024")
    f.write_bytes(pickle.dumps({"segments": [], "device_traces": [[event] for _ in range(8)]}))
    r = run(str(f), "--format", "json")
    assert r.exit_code == 0 and len(json.loads(r.stdout)["history"]) == 8


# -- the budget: what real snapshots cost, against what it allows ------------------------------
def _nodes(data: bytes) -> int:
    from torchledger.analyzers import snapshot_format as fmt
    seen = []
    real = fmt._Check

    class Counting(real):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            seen.append(self)

    fmt._Check = Counting
    try:
        fmt.validate_snapshot(pickle.loads(data))
    finally:
        fmt._Check = real
    return seen[0].nodes


def _dense_history(events=1000, depth=150) -> bytes:
    """A recorded trace as PyTorch writes one with context='all', stacks='all': every alloc
    shares its block's traceback list (py_symbolize hands out one list per traceback) and
    the free events reuse it, 150 frames deep, frame dicts shared between tracebacks."""
    pool = [{"filename": f"/src/f{k}.py", "line": k, "name": f"fn{k}"} for k in range(400)]
    blocks, trace = [], []
    for i in range(events):
        frames = [pool[(i + k) % len(pool)] for k in range(depth)]
        addr = 2**40 + 512 * i
        trace.append({"action": "alloc", "addr": addr, "size": 512, "stream": 0, "time_us": i, "frames": frames})
        if i % 2:
            trace.append({"action": "free_requested", "addr": addr, "size": 512, "stream": 0,
                          "time_us": i, "frames": frames})
        blocks.append({"address": addr, "size": 512, "requested_size": 512,
                       "state": "inactive" if i % 2 else "active_allocated", "frames": frames})
    seg = {"device": 0, "address": 2**40, "total_size": 512 * events, "stream": 0,
           "segment_type": "small", "is_expandable": False, "blocks": blocks}
    return pickle.dumps({"segments": [seg], "device_traces": [trace]}, protocol=4)


def test_real_snapshots_stay_far_below_the_budget():
    from torchledger.analyzers.snapshot_format import NODES_PER_BYTE
    ratios = {}
    for name in make.SNAPSHOTS:
        with open(os.path.join(ROOT, "tests", "data", "snapshots", name), "rb") as f:
            data = f.read()
        ratios[name] = _nodes(data) / len(data)
    data = _dense_history()
    ratios["dense"] = _nodes(data) / len(data)
    # history.pickle: 152 nodes in 2,658 bytes (0.057 a byte). The dense trace, whose shared
    # 150-frame tracebacks are the most sharing PyTorch writes: each traceback list costs
    # 1 + 150 frames = 151 at every use; 1000 allocs use theirs twice (event, block) and the
    # 500 freed once more: 2500 * 151 = 377,500, plus 1500 events, 1000 blocks and 5 lists
    # and dicts around them = 380,005 nodes in 794,707 bytes (0.48 a byte)
    assert ratios["history.pickle"] == 152 / 2658 and ratios["dense"] == 380_005 / 794_707
    assert max(ratios.values()) < NODES_PER_BYTE / 32, ratios
    r = run_bytes(data)
    assert r.exit_code == 0, r.output


def run_bytes(data: bytes, *args):
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        f = os.path.join(d, "s.pickle")
        with open(f, "wb") as fh:
            fh.write(data)
        return run(f, *args)


# -- property: any mutation of a real snapshot is read or refused in one line ------------------
HOSTILE = [None, True, 0, -1, 1.5, float("nan"), float("inf"), 2**70, 10**4000, "", "x", "\udc80",
           "active_allocated", "alloc", [], {}, [1, 2], {"a": 1}, (1, 2), [[[[]]]],
           {"filename": 1}, b"bytes"]
KEYS = ["device", "stream", "frames", "size", "addr", "requested_size", "time_us", "line", "state",
        "action", "blocks", "total_size", "allocator_settings", "device_traces", "segments"]


def _containers(obj, out, seen):
    if id(obj) in seen:
        return out
    seen.add(id(obj))
    out.append(obj)
    for v in (obj.values() if isinstance(obj, dict) else obj):
        if isinstance(v, (dict, list)):
            _containers(v, out, seen)
    return out


def mutate(rng, snap, edits: int):
    """``edits`` random hostile edits to a copy of ``snap``: a value replaced by one of
    HOSTILE, by its own container (a cycle) or by another node (a shared reference), a key
    or item deleted, or a list of repeated values put in."""
    snap = copy.deepcopy(snap)
    for _ in range(edits):
        nodes = _containers(snap, [], set())
        node = rng.choice(nodes)
        if isinstance(node, dict):
            key = rng.choice(list(node) + KEYS)
        elif node:
            key = rng.randrange(len(node))
        else:
            node.append(copy.deepcopy(rng.choice(HOSTILE)))
            continue
        kind = rng.random()
        if kind < 0.1:
            if isinstance(node, dict):
                node.pop(key, None)
            else:
                del node[key]
            continue
        value = (copy.deepcopy(rng.choice(HOSTILE)) if kind < 0.6 else node if kind < 0.7
                 else rng.choice(nodes) if kind < 0.9 else [copy.deepcopy(rng.choice(HOSTILE))] * rng.randint(0, 4))
        node[key] = value
    return snap


def _no_constants(c):
    raise ValueError(f"invalid JSON constant {c}")


def check_exit_0_valid_or_exit_2_one_line(data: bytes, fmt: str):
    r = run_bytes(data, "--format", fmt)
    if r.exit_code == 0:
        assert r.stderr == ""
        if fmt == "json":
            try:
                out = json.loads(r.stdout, parse_constant=_no_constants)   # no NaN or Infinity
            except ValueError as e:
                raise AssertionError(f"exit 0 with invalid JSON: {e}") from None
            assert out["schema"] == "torchledger.snapshot/1"
        else:
            assert r.stdout.startswith("CUDA memory snapshot")
    else:
        assert r.exit_code == 2, (r.exit_code, r.output, r.exception)
        assert r.stdout == "" and r.stderr.count("\n") == 1, r.stderr
        assert r.stderr.startswith("torchledger: error: ")


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(sorted(make.SNAPSHOTS)), st.integers(0, 2**32), st.integers(1, 3),
       st.sampled_from([2, 4]), st.sampled_from(["json", "table"]))
def test_any_mutated_snapshot_is_read_or_refused_in_one_line(name, seed, edits, protocol, fmt):
    import random
    snap = mutate(random.Random(seed), make.SNAPSHOTS[name](), edits)
    check_exit_0_valid_or_exit_2_one_line(pickle.dumps(snap, protocol=protocol), fmt)


def test_a_huge_key_is_shortened_in_the_message(tmp_path):
    f = tmp_path / "s.pickle"
    f.write_bytes(pickle.dumps(_snap(allocator_settings={"k" * 100_000: float("inf")})))
    line = one_line(run(str(f)), "allocator_settings['kkkk", "is a float; expected a finite number")
    assert len(line) < 500
