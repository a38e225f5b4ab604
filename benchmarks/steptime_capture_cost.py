"""What the step-time model's per-op capture (tracer/opshapes.py, one call per recorded op from
dispatch.py) costs the tracer, two ways: (a) the time spent inside the capture calls, summed
with a timer around each, against the whole traced step (both process CPU time); (b) the same
traced step with the capture and with it replaced by a no-op, interleaved, median of
``--repeats`` (noisy on a shared host: (a) is the figure to read).

    PYTHONPATH=$PWD python benchmarks/steptime_capture_cost.py [--repeats 5]

1. gpt-mini on CPU (batch 8 x 128, AdamW): a real step.
2. llama2-7b on fake tensors (batch 1 x 2048): ~3,800 op rows, the audit's own hot path.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import torchledger
from torchledger.models import build_model, get_config
from torchledger.tracer import dispatch


def _step(model, opt, idx):
    loss = model(idx, targets=idx)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _timed(model, opt, idx):
    t0 = time.process_time()
    with torchledger.trace(model, optimizer=opt, tokens=idx.numel()):
        _step(model, opt, idx)
    return time.process_time() - t0


def compare(make, repeats):
    real = dispatch.note_op
    on, off = [], []
    model, opt, idx = make()
    _timed(model, opt, idx)                       # warm-up
    try:
        for _ in range(repeats):
            dispatch.note_op = real
            on.append(_timed(model, opt, idx))
            dispatch.note_op = lambda *a: None
            off.append(_timed(model, opt, idx))
    finally:
        dispatch.note_op = real
    return statistics.median(on), statistics.median(off)


def inside(make):
    """(seconds inside the capture, calls, seconds of the traced step)."""
    real = dispatch.note_op
    spent = [0.0, 0]

    def timed(*a):
        t0 = time.process_time()
        real(*a)
        spent[0] += time.process_time() - t0
        spent[1] += 1
    model, opt, idx = make()
    _timed(model, opt, idx)
    dispatch.note_op = timed
    try:
        total = _timed(model, opt, idx)
    finally:
        dispatch.note_op = real
    return spent[0], spent[1], total


def small():
    torch.manual_seed(0)
    cfg = get_config("gpt-mini")
    model = build_model(cfg)
    return model, torch.optim.AdamW(model.parameters()), torch.randint(0, cfg.vocab_size, (8, 128))


def fake_7b():
    from torch._subclasses.fake_tensor import FakeTensorMode
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        cfg = get_config("llama2-7b")
        model = build_model(cfg)
        idx = torch.randint(0, cfg.vocab_size, (1, 2048))
        opt = torch.optim.AdamW(model.parameters())
    return _Fake(model, mode), opt, idx


class _Fake(torch.nn.Module):
    def __init__(self, model, mode):
        super().__init__()
        self.model, self.mode = model, mode

    def forward(self, idx, targets=None):
        with self.mode:
            return self.model(idx, targets=targets)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    for name, make, reps in (("gpt-mini CPU step", small, args.repeats), ("llama2-7b fake step", fake_7b, 3)):
        spent, calls, total = inside(make)
        print(f"{name}: {calls:,} capture calls take {spent * 1e3:.1f} ms of the {total:.3f} s traced step "
              f"({100 * spent / total:.1f}%), CPU time", flush=True)
        with_capture, without = compare(make, reps)
        print(f"{name}: traced {with_capture:.3f} s with the capture, {without:.3f} s without "
              f"({100 * (with_capture - without) / without:+.1f}%), CPU time, median of {reps}", flush=True)


if __name__ == "__main__":
    main()
