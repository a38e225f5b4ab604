"""CudaMemoryHistory and the allocator on a real GPU.

Tests marked ``cuda`` run only where CUDA is available (tests/conftest.py skips them
elsewhere; on a GPU machine `python -m pytest -q -m cuda` runs them). The others check, on any machine, the
no-CUDA statement and the start/stop/restore logic against a stand-in allocator API: they
never create a CUDA tensor.
"""
from __future__ import annotations

import gc
import os
import subprocess
import sys
import time

import pytest
import torch
from click.testing import CliRunner

import torchledger
from torchledger.analyzers.snapshot import join, load_snapshot, summarize_snapshot
from torchledger.cli import cli
from torchledger.models import build_model, example_inputs
from torchledger.tracer import cuda_history
from torchledger.tracer.cuda_history import UNAVAILABLE, CudaMemoryHistory

cuda = pytest.mark.cuda
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def step(model, opt, inputs):
    loss = model(**inputs)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def now_us() -> int:
    return time.time_ns() // 1000        # the allocator's time_us clock (Unix epoch, us)


# -- any machine ----------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_without_cuda_says_so_never_zero(tmp_path):
    with CudaMemoryHistory() as h:
        x = torch.ones(3) * 2                     # the block runs as usual
    assert x.sum().item() == 6 and h.available is False and not h.owns_recording
    for call in (h.snapshot, lambda: h.dump(tmp_path / "s.pickle")):
        with pytest.raises(RuntimeError) as e:
            call()
        assert str(e.value) == UNAVAILABLE
    assert not (tmp_path / "s.pickle").exists()


def test_arguments_and_order():
    with pytest.raises(ValueError, match="max_entries"):
        CudaMemoryHistory(max_entries=0)
    with pytest.raises(ValueError, match="stacks"):
        CudaMemoryHistory(stacks="cpp")
    with pytest.raises(RuntimeError, match="enter"):
        CudaMemoryHistory().snapshot()
    h = CudaMemoryHistory()
    with h:
        with pytest.raises(RuntimeError, match="already active"):
            h.__enter__()


class FakeAllocator:
    """Stands in for torch.cuda.memory's recording API (no CUDA involved)."""

    def __init__(self, recording=False):
        self.recording, self.calls, self.snapshots = recording, [], 0

    def record(self, enabled="all", context="all", stacks="all", max_entries=sys.maxsize,
               device=None, clear_history=False):
        self.calls.append(dict(enabled=enabled, context=context, stacks=stacks,
                               max_entries=max_entries, clear_history=clear_history))
        self.recording = enabled is not None

    def snapshot(self, device=None):
        self.snapshots += 1
        assert self.recording or self.calls == [], "snapshot taken after recording stopped"
        return {"segments": [], "device_traces": [[{"action": "alloc", "addr": 1, "size": 512}]]}


@pytest.fixture
def fake_allocator(monkeypatch):
    def install(recording=False, probe=True):
        fa = FakeAllocator(recording)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", fa.record)
        monkeypatch.setattr(torch.cuda.memory, "_snapshot", fa.snapshot)
        if probe:
            monkeypatch.setattr(torch._C, "_cuda_isHistoryEnabled", lambda: fa.recording, raising=False)
        else:
            monkeypatch.delattr(torch._C, "_cuda_isHistoryEnabled", raising=False)
        return fa
    return install


def test_starts_python_stacks_bounded_and_stops_after_the_snapshot(fake_allocator):
    fa = fake_allocator()
    with CudaMemoryHistory(max_entries=1234) as h:
        assert h.owns_recording and fa.recording
        assert h.snapshot()["device_traces"][0][0]["size"] == 512        # live inside the block
    assert fa.calls[0] == dict(enabled="all", context="all", stacks="python", max_entries=1234,
                               clear_history=True)
    assert fa.calls[-1]["enabled"] is None and not fa.recording and not h.owns_recording
    assert h.snapshot()["device_traces"][0] and h.notes == []


def test_users_recording_is_left_alone(fake_allocator):
    fa = fake_allocator(recording=True)
    with CudaMemoryHistory() as h:
        pass
    assert fa.calls == [] and fa.recording and not h.owns_recording
    assert "already recording" in h.notes[0] and h.snapshot()


def test_no_probe_assumes_no_recording_and_says_so(fake_allocator):
    fa = fake_allocator(probe=False)
    with CudaMemoryHistory() as h:
        pass
    assert "cannot tell" in h.notes[0] and fa.calls[-1]["enabled"] is None


def test_stops_even_when_the_block_raises(fake_allocator):
    fa = fake_allocator()
    with pytest.raises(KeyError):
        with CudaMemoryHistory():
            raise KeyError("the user's error")
    assert not fa.recording and fa.snapshots == 1


@pytest.mark.parametrize("signature, expected", [
    ("enabled='all', context='all', stacks='all', max_entries=9, device=None, clear_history=False",
     {"context", "stacks", "max_entries", "clear_history"}),
    ("enabled='all', context='all', stacks='all', max_entries=9, device=None",       # torch 2.4
     {"context", "stacks", "max_entries"}),
    ("enabled='all', *args, **kwargs", {"context", "stacks", "max_entries"}),       # hidden
])
def test_start_adapts_to_the_signature(signature, expected):
    seen = {}
    ns = {}
    exec(f"def record({signature}):\n    seen.update(locals())", {"seen": seen}, ns)

    class T:
        class cuda:
            class memory:
                _record_memory_history = staticmethod(ns["record"])

    cuda_history._start(T, 77, "python")
    got = seen.get("kwargs") or {k: v for k, v in seen.items() if k not in ("enabled", "device", "args")}
    assert set(got) == expected and got["max_entries"] == 77 and got["stacks"] == "python"


def test_benchmark_without_cuda_skips(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("checks the machine without CUDA")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu.py"), "--out", str(tmp_path)],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT}, timeout=120)
    assert r.returncode == 0 and r.stdout == "no CUDA device: skipping\n", r.stderr


# -- a real GPU ------------------------------------------------------------------------------
def _device():
    return torch.device("cuda", torch.cuda.current_device())


def _gpt(dev, batch=4, seq=128, name="gpt-mini"):
    torch.manual_seed(0)
    model = build_model(name, device=dev)
    return model, torch.optim.AdamW(model.parameters(), foreach=True), \
        example_inputs(name, batch=batch, seq_len=seq, device=dev)


def _warm_up(dev):
    """One throwaway step: cuBLAS workspaces and kernels are set up outside the measurement."""
    model, opt, inputs = _gpt(dev)
    step(model, opt, inputs)
    del model, opt, inputs
    gc.collect()
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()


@cuda
def test_history_end_to_end(tmp_path):
    dev = _device()
    _warm_up(dev)
    model, opt, inputs = _gpt(dev)
    torch.cuda.synchronize(dev)
    before = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    with CudaMemoryHistory(max_entries=50_000, device=dev) as h:
        step(model, opt, inputs)
        torch.cuda.synchronize(dev)
    assert h.available
    s = summarize_snapshot(h.snapshot(), device=dev.index)
    allocated, reserved = torch.cuda.memory_allocated(dev), torch.cuda.memory_reserved(dev)
    assert s["allocated_bytes"] <= s["allocated_block_bytes"] <= s["reserved_bytes"]
    assert s["allocated_block_bytes"] == allocated, (s["allocated_block_bytes"], allocated)
    assert s["reserved_bytes"] == reserved, (s["reserved_bytes"], reserved)
    hist = [x for x in s["history"] if x["device"] == dev.index]
    assert hist and hist[0]["entries"] > 0
    start, peak = hist[0]["start"], hist[0]["peak"]
    assert 0 < start["allocated_bytes"] <= before               # requested <= rounded blocks
    measured = torch.cuda.max_memory_allocated(dev)
    assert 0.85 * measured <= peak["allocated_bytes"] <= measured, (peak["allocated_bytes"], measured)
    assert peak["reserved_bytes"] <= hist[0]["max_reserved_bytes"] <= reserved + measured
    # stacks are Python frames that reach this file (optimizer state, gradients)
    frames = [f for g in s["top_allocations"] for f in g["frames"]]
    assert any("test_cuda.py" in f for f in frames)
    if hasattr(torch._C, "_cuda_isHistoryEnabled"):
        assert not torch._C._cuda_isHistoryEnabled()            # switched off again
    path = h.dump(tmp_path / "step.pickle")
    again = summarize_snapshot(load_snapshot(path), device=dev.index)
    assert again["reserved_bytes"] == s["reserved_bytes"] and again["history"][0]["peak"] == peak
    r = CliRunner().invoke(cli, ["snapshot", path, "--format", "json"])
    assert r.exit_code == 0, r.output


@cuda
def test_users_own_recording_survives():
    if not hasattr(torch._C, "_cuda_isHistoryEnabled"):
        pytest.skip("this torch cannot tell whether the allocator records")
    dev = _device()
    torch.cuda.memory._record_memory_history(max_entries=1000)
    try:
        with CudaMemoryHistory() as h:
            x = torch.empty(1 << 20, device=dev)
            del x
        assert not h.owns_recording and torch._C._cuda_isHistoryEnabled()
        assert any(e["action"] == "alloc" for e in h.snapshot()["device_traces"][dev.index])
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


@cuda
def test_time_us_is_host_wall_clock_and_join_attributes_modules():
    dev = _device()
    _warm_up(dev)
    model, opt, inputs = _gpt(dev)
    marks, stack = [], []

    def pre(name):
        def hook(mod, args):
            stack.append(name)
            marks.append({"time_us": now_us(), "module": name, "phase": "forward"})
        return hook

    def post(mod, args, out):
        stack.pop()
        marks.append({"time_us": now_us(), "module": stack[-1] if stack else None, "phase": "forward"})

    handles = [h for name, m in model.named_modules()
               for h in (m.register_forward_pre_hook(pre(name)), m.register_forward_hook(post))]
    try:
        with CudaMemoryHistory() as h:
            t0 = now_us()
            loss = model(**inputs)
            marks.append({"time_us": now_us(), "module": None, "phase": "backward"})
            loss.backward()
            marks.append({"time_us": now_us(), "module": None, "phase": "optimizer"})
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize(dev)
            t1 = now_us()
    finally:
        for handle in handles:
            handle.remove()
    snap = h.snapshot()
    times = [e["time_us"] for e in snap["device_traces"][dev.index] if e["action"] == "alloc"]
    assert times and t0 - 2000 <= min(times) and max(times) <= t1 + 2000, (t0, min(times), max(times), t1)
    rows = join(snap, marks, device=dev.index)
    fwd = [r for r in rows if r["phase"] == "forward"]
    assert fwd and sum(r["module"] is not None for r in fwd) >= 0.9 * len(fwd)
    cats = {r["category"] for r in rows}
    assert {"activations", "gradients", "optimizer_state"} <= cats, cats


@cuda
def test_tracer_cuda_marks_and_peak_within_10_percent():
    dev = _device()
    _warm_up(dev)
    model, opt, inputs = _gpt(dev, batch=8, seq=128)
    torch.cuda.synchronize(dev)
    before = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    with torchledger.trace(model, optimizer=opt, tokens=8 * 128) as t:
        step(model, opt, inputs)
    torch.cuda.synchronize(dev)
    rec = t.record
    marks = rec.memory["cuda"]
    assert marks and marks[0]["at"] == "start" and marks[-1]["at"] == "end"
    assert all(m["allocated_bytes"] <= m["reserved_bytes"] for m in marks)
    assert marks[-1]["max_allocated_bytes"] == torch.cuda.max_memory_allocated(dev)
    measured = torch.cuda.max_memory_allocated(dev) - before            # what the step added
    static = rec.totals["param_bytes"] + rec.totals.get("buffer_bytes", 0)
    predicted = rec.totals["peak_bytes"] - static
    assert abs(predicted - measured) <= 0.10 * measured, (predicted, measured)
