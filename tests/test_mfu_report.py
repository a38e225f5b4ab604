"""One MFU per report: the header and TL-MFU-001 print the same figure, say which steps its
time comes from, and say why there is none."""
from __future__ import annotations

import re

import torch

import torchledger
from torchledger.models import build_model


def _ledger_run(peak=None, steps=4):
    """cruncher under a Ledger tracing every other step, on a clock where a traced step takes
    5 s and an untraced one 1 s."""
    torch.manual_seed(0)
    model = build_model("cruncher")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    now = [0.0]

    def clock():
        return now[0]

    ledger = torchledger.Ledger(model, optimizer=opt, sample_every=2, clock=clock,
                                peak_flops=peak)
    for i in range(steps):
        with ledger.step(tokens=4):
            model(torch.randn(4, 128)).sum().backward()
            opt.step()
            opt.zero_grad()
            now[0] += 5.0 if i % 2 == 0 else 1.0
    return ledger


def _mfus(text):
    return set(re.findall(r"MFU:? ([0-9.e+-]+)", text))


def test_ledger_report_prints_the_untraced_mfu_once():
    flops = _ledger_run().records[-1].totals["flops"]["total"]
    ledger = _ledger_run(peak=flops * 100)      # untraced: flops / 1 s / (100 flops/s) = 0.01
    text = ledger.report()                      # traced would be flops / 5 s / peak = 0.002
    assert _mfus(text) == {"0.01"}, text
    assert "MFU: 0.01 (HFU 0.01) from median of 2 untraced steps, 1 s (min 1 s, max 1 s: spread 0.0%)" in text
    assert "TL-MFU-001" in text and "0.002" not in text
    assert ledger.records[-1].totals["mfu"] == ledger.findings()[0].measured
    assert ledger.records[-1].to_dict()["totals"]["mfu_source"].startswith("median of 2 untraced")


def test_trace_says_its_time_is_the_traced_step():
    model = build_model("cruncher")
    ticks = iter([10.0, 10.25])
    with torchledger.trace(model, peak_flops=1e12, clock=lambda: next(ticks)) as t:
        model(torch.randn(4, 128)).sum().backward()
    f = t.record.totals["flops"]["total"]
    mfu = f / 0.25 / 1e12
    text = t.report()
    assert f"MFU: {mfu:.3g}" in text and _mfus(text) == {f"{mfu:.3g}"}
    assert "from the traced step, 250 ms, tracer overhead included" in text


def test_no_peak_says_so():
    text = _ledger_run().report()
    assert "MFU: none: no peak FLOP/s given (peak_flops=, or --peak-flops / --gpu)" in text
    assert not _mfus(text)


def test_fake_device_says_so():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        model = build_model("cruncher")
        x = torch.randn(4, 128)
    with torchledger.trace(model, peak_flops=1e12) as t:
        model(x).sum().backward()
    text = t.report()
    assert "MFU: none on a fake (cpu) device: no real step time" in text
    assert t.record.totals["mfu"] is None
