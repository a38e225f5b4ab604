"""Regenerate the scenario records the golden reports are rendered from.

    python tests/data/make_records.py            # then: pytest tests/test_render.py --update-goldens

Each scenario traces one real training step on the CPU and writes
``tests/data/<scenario>/record.json``. Fields that change from run to run or machine to
machine are pinned (step time 0.125 s, torch "2.x", MFU none, copy locations relative to
the repository root), so the same torch build gives the same bytes.

Scenarios:

* ``gpt2-tiny``: the preset Transformer, batch 2, seq 16, one AdamW step.
* ``cruncher-copy``: the course's Cruncher (dim 32, 4 layers) with a transpose-contiguous
  copy in its forward and a ``torch.sort`` (no FLOP formula) on its output, one SGD-momentum
  step: copies with source lines, an uncounted op, located findings.

Findings are whatever ``run_checks`` gives at the time, stored in the record's ``findings``.
* ``empty``: ``StepRecord()``, what a traced block that ran nothing gives.
"""
from __future__ import annotations

import os
import sys

import torch

import torchledger
from torchledger.analyzers.checks import run_checks
from torchledger.models import build_model, example_inputs, get_config
from torchledger.models.cruncher import Cruncher
from torchledger.record import StepRecord

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


class CopyCruncher(Cruncher):
    """Cruncher whose second layer's output goes through a transpose and ``.contiguous()``."""

    def forward(self, x):                                        # x: (B, dim)
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i == 1:
                x = x.t().contiguous().t()                       # a real copy: (dim, B) strided
        return self.final(x).squeeze(-1)                         # (B,)


def gpt2_tiny() -> StepRecord:
    cfg = get_config("gpt2-tiny")
    B, T = 2, 16
    torch.manual_seed(0)
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = example_inputs(cfg, batch=B, seq_len=T)
    with torchledger.trace(model, optimizer=opt, tokens=B * T) as t:
        model(**batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    rec = t.record
    rec.findings = run_checks([rec])
    return rec


def cruncher_copy() -> StepRecord:
    cfg = get_config("cruncher").replace(dim=32, num_layers=4)
    torch.manual_seed(0)
    model = CopyCruncher(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(8, cfg.dim)
    with torchledger.trace(model, optimizer=opt, tokens=8) as t:
        y = model(x)
        torch.sort(y)[0].sum().backward()                       # sort: no FLOP formula
        opt.step()
        opt.zero_grad(set_to_none=True)
    rec = t.record
    rec.findings = run_checks([rec])
    return rec


def normalise(rec: StepRecord) -> StepRecord:
    """Pin what differs between runs and machines."""
    rec.totals["step_seconds"] = 0.125
    rec.totals["mfu"] = None
    rec.meta["torch"] = "2.x"
    for c in rec.copies:
        c["location"] = _relative(c.get("location"))
    for f in rec.findings:
        f.location = _relative(f.location)
    return rec


def _relative(location):
    """``../../x/tests/data/make_records.py:12`` (relative to the cwd) -> ``tests/data/make_records.py:12``."""
    if not location or ":" not in location:
        return location
    path, line = location.rsplit(":", 1)
    full = os.path.abspath(path)
    if full.startswith(ROOT + os.sep):
        path = os.path.relpath(full, ROOT).replace(os.sep, "/")
    return f"{path}:{line}"


SCENARIOS = {"gpt2-tiny": gpt2_tiny, "cruncher-copy": cruncher_copy, "empty": StepRecord}


def main(names, out: str = HERE) -> None:
    """Write ``<out>/<scenario>/record.json`` for each scenario named (all by default);
    tests/test_goldens_current.py writes to a temporary ``out`` and compares."""
    for name in names or SCENARIOS:
        rec = normalise(SCENARIOS[name]())
        folder = os.path.join(out, name)
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "record.json"), "w", encoding="utf-8", newline="\n") as fh:
            fh.write(rec.to_json() + "\n")
        print(f"wrote {os.path.join(folder, 'record.json')}")


if __name__ == "__main__":
    main(sys.argv[1:])
