"""A Ledger around a long training loop: it keeps no user tensor alive, and what it keeps
of its own is bounded."""
from __future__ import annotations

import gc
import types
import weakref

import pytest
import torch
import torch.nn as nn

import torchledger
from torchledger.ledger import LEAK_WINDOW, TIMES_KEPT
from torchledger.models import build_model, example_inputs, get_config

# gpt2-tiny with one block: every op kind of the two-block preset, half the ops a step to trace
GPT = get_config("gpt2-tiny").replace(n_layers=1)


def make():
    torch.manual_seed(0)
    model = build_model(GPT)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def batch():
    return example_inputs(GPT, batch=2, seq_len=8)


def saved_storages(out, model) -> list:
    """Weakrefs to the storages that ``out``'s autograd graph saved, but the model's own."""
    own = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
    refs, seen, todo = [], set(), [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for name in dir(node):
            if name.startswith("_saved_"):
                try:
                    v = getattr(node, name)
                except Exception:     # noqa: BLE001 (saved ints, freed buffers)
                    continue
                if isinstance(v, torch.Tensor) and v.untyped_storage()._cdata not in own:
                    refs.append(weakref.ref(v.untyped_storage()))
        todo += [n for n, _ in node.next_functions]
    return refs


def eval_forward_loop(ledger, model, opt, steps: int, kept: list | None = None):
    """Train ``steps`` steps; each also runs an evaluation forward that is never
    backpropagated (no ``no_grad``: the case that leaked). Returns weakrefs to the eval
    outputs and to the storages their graphs saved."""
    outs, saved, losses = [], [], []
    for _ in range(steps):
        with ledger.step(tokens=16):
            loss = model(**batch())                                   # TRAIN-LOSS
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            ev = model(**batch())                                     # EVAL-LOSS
            outs.append(weakref.ref(ev))
            if kept is not None:
                kept.append(loss)                                     # a real leak
            losses.append(loss.item())
        saved += saved_storages(ev, model)
        del ev, loss
    return outs, saved, losses


def test_eval_forward_without_backward_is_freed_and_not_blamed():
    model, opt = make()
    ledger = torchledger.Ledger(model, optimizer=opt, sample_every=1)
    outs, saved, losses = eval_forward_loop(ledger, model, opt, 5)
    assert len(saved) >= 5 * 10          # 28 a forward of the block: softmax, gelu, layer norms...
    # no gc.collect(): reference counting alone frees them, as it does untraced
    assert [r() for r in outs] == [None] * 5
    assert sum(r() is not None for r in saved) == 0
    rules = {f.rule for f in ledger.findings()}
    assert not rules & {"TL-LEAK-001", "TL-LEAK-002"}, ledger.findings()


def test_losses_are_those_of_the_untraced_loop():
    runs = []
    for every in (1, 10**9):                     # traced at every step, never traced
        model, opt = make()
        torch.manual_seed(1)
        runs.append(eval_forward_loop(torchledger.Ledger(model, optimizer=opt, sample_every=every),
                                      model, opt, 3)[2])
    assert runs[0] == runs[1]


def test_kept_loss_is_still_reported_on_the_same_loop():
    model, opt = make()
    ledger = torchledger.Ledger(model, optimizer=opt, sample_every=1)
    kept = []
    eval_forward_loop(ledger, model, opt, 5, kept=kept)
    found = [f for f in ledger.findings() if f.rule == "TL-LEAK-002"]
    assert len(found) == 1
    assert found[0].location.endswith(f"test_ledger_longrun.py:{_line('TRAIN-LOSS')}")
    assert "step(s) 0, 1, 2, 3" in found[0].message


def test_a_saved_output_is_freed_with_its_graph():
    # exp saves its own output: returning it from the pack hook made output -> grad_fn ->
    # saved output, a cycle through C++ that even gc.collect() never freed
    x = torch.randn(64, 64, requires_grad=True)
    with torchledger.trace(nn.Identity()):
        y = x.exp()
        ref = weakref.ref(y.untyped_storage())
        del y
    assert ref() is None


def _line(marker):
    return next(i for i, s in enumerate(open(__file__).read().splitlines(), 1)
                if s.rstrip().endswith(f"# {marker}"))


def test_gradients_unchanged_by_the_saved_tensor_hook():
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4), nn.Softmax(-1))
    model(x).pow(2).sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    with torchledger.trace(model):
        model(x).pow(2).sum().backward()
    for p, g in zip(model.parameters(), expected):
        assert torch.equal(p.grad, g)


def tensors_reachable(root, skip=()) -> list:
    """Paths from ``root`` to every tensor or storage it references (not through modules,
    optimizers or the objects in ``skip``)."""
    seen, out, todo = {id(s) for s in skip}, [], [(root, "")]
    while todo:
        o, path = todo.pop()
        if id(o) in seen or isinstance(o, (type, types.ModuleType, types.FunctionType,
                                           nn.Module, torch.optim.Optimizer)):
            continue
        seen.add(id(o))
        if isinstance(o, (torch.Tensor, torch.UntypedStorage)):
            out.append(path)
            continue
        todo += [(r, f"{path}>{type(r).__name__}") for r in gc.get_referents(o)]
    return out


def test_tracer_and_ledger_hold_no_tensor_after_the_step():
    model, opt = make()
    ledger = torchledger.Ledger(model, optimizer=opt)
    eval_forward_loop(ledger, model, opt, 2)
    with ledger.step() as t:
        model(**batch()).backward()
    assert tensors_reachable(ledger, skip=[model, opt]) == []
    assert tensors_reachable(t) == []           # the tracer dropped the parameters it listed


def test_a_cycle_that_gc_frees_is_not_a_kept_graph():
    model, opt = make()
    ledger = torchledger.Ledger(model, optimizer=opt)
    gc.disable()                      # the cycle below outlives the next step unless collected
    try:
        for _ in range(3):
            with ledger.step(tokens=16):
                loss = model(**batch())
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                log = {"loss": loss}
                log["self"] = log     # only gc frees this loss (and its graph)
                del log
    finally:
        gc.enable()
    assert "TL-LEAK-002" not in {f.rule for f in ledger.findings()}


# -- long runs: bounded history, incremental analysis ------------------------------------------

def small():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def train(ledger, model, opt, steps: int, kept: list | None = None):
    for _ in range(steps):
        with ledger.step(tokens=4):
            loss = model(torch.randn(4, 8)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if kept is not None:
                kept.append(torch.randn(256))          # 1 KiB made in the step, kept
                kept.append(loss)


def test_records_are_bounded_by_keep_and_dropped_ones_are_freed():
    model, opt = small()
    ledger = torchledger.Ledger(model, optimizer=opt, keep=3)
    train(ledger, model, opt, 1)
    first = weakref.ref(ledger.records[0])
    train(ledger, model, opt, 11)                   # 12 traced steps in all
    assert [r.meta["step_index"] for r in ledger.records] == [9, 10, 11]
    gc.collect()
    assert first() is None                          # nothing else (window, carry) holds it
    assert torchledger.Ledger(model).keep == 20     # the documented default


def test_keep_is_checked():
    model, _ = small()
    for bad in (0, -1, 2.5, True, "3"):
        with pytest.raises(ValueError, match="keep must be an int >= 1"):
            torchledger.Ledger(model, keep=bad)


def test_each_traced_step_analyses_only_the_leak_window(monkeypatch):
    from torchledger.analyzers import checks
    seen = []
    monkeypatch.setattr(checks, "ALL_CHECKS", [*checks.ALL_CHECKS,
                                               lambda records, options: seen.append(len(records)) or []])
    model, opt = small()
    ledger = torchledger.Ledger(model, optimizer=opt, keep=100)
    train(ledger, model, opt, 12)
    # one analysis per traced step, over the new record and at most 7 before it
    assert seen == [1, 2, 3, 4, 5, 6, 7, 8, 8, 8, 8, 8]
    ledger.findings()
    assert seen[-1] == LEAK_WINDOW == 8


def test_leaks_are_still_found_past_the_window():
    model, opt = small()
    ledger = torchledger.Ledger(model, optimizer=opt, keep=2)
    kept = []
    train(ledger, model, opt, 12, kept=kept)
    found = {f.rule: f for f in ledger.findings()}
    assert set(found) == {"TL-LEAK-001", "TL-LEAK-002"}
    # 256 * 4 = 1024 bytes of randn and a 4-byte loss kept per step
    assert found["TL-LEAK-001"].measured == 1024 + 4
    assert "since step 5" in found["TL-LEAK-001"].message    # window: steps 4..11, 4 is the base
    # the kept losses of every step (their origins travel with the carry, not the records)
    assert "step(s) 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10 are" in found["TL-LEAK-002"].message
    assert ledger.records[-1].findings == ledger.findings()


def test_untraced_step_times_are_bounded():
    model, _ = small()
    ledger = torchledger.Ledger(model, sample_every=10**9)
    for _ in range(1500):
        with ledger.step():
            pass
    assert ledger.steps == 1500 and len(ledger.records) == 1    # step 0 is traced
    assert len(ledger.untraced_seconds) == TIMES_KEPT == 1000


def test_memory_timeline_rows_add_up_and_end_at_the_step_end():
    model, opt = small()
    with torchledger.trace(model, optimizer=opt) as t:
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
    mem = t.record.memory
    rows = mem["timeline"]
    cats = mem["categories"]
    assert [r["op_index"] for r in rows] == sorted({r["op_index"] for r in rows})
    assert all(r["total"] == sum(r[c] for c in cats) and all(type(r[c]) is int for c in cats)
               for r in rows)
    assert rows[-1]["phase"] == "end" and {r["phase"] for r in rows[:-1]} <= {"forward", "backward",
                                                                             "optimizer", "other"}
    assert {c: rows[-1][c] for c in cats} == mem["end_breakdown"]
    assert max(r["total"] for r in rows) == mem["peak_bytes"]


def test_rss_benchmark_runs_and_reports_each_mode(tmp_path, monkeypatch, capsys):
    # The parent runs in this process (its three RSS children still run in fresh processes, as
    # the benchmark does): each python that imports torch and builds an optimizer costs ~3.5 s CPU.
    import importlib.util
    import json
    import os
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    spec = importlib.util.spec_from_file_location("ledger_rss", root / "benchmarks" / "ledger_rss.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    threads = torch.get_num_threads()            # the timing part runs torch on one thread

    def main(*args):
        monkeypatch.setattr("sys.argv", ["ledger_rss.py", *args])
        try:
            bench.main()
        finally:
            torch.set_num_threads(threads)
        return capsys.readouterr()

    p = main("--steps", "3", "--warmup", "1", "--repeats", "1", "--block", "3",
             "--json", str(tmp_path / "out.json"))
    out = json.loads((tmp_path / "out.json").read_text())
    assert [(r["mode"], r["records"], r["findings"]) for r in out["rss"]] == [
        ("untraced", 0, []), ("Ledger(sample_every=1)", 3, []), ("Ledger(sample_every=50)", 1, [])]
    assert out["time"]["traced_steps"] == 1          # one block of 3 steps, sample_every=3
    assert "amortised overhead per step" in p.out
    with pytest.raises(SystemExit) as bad:
        main("--steps", "5", "--warmup", "5")
    assert bad.value.code == 2
    assert "--warmup must be between 1 and --steps - 1 (4), got 5" in capsys.readouterr().err
