"""The references of a layout, off the plain data-parallel path: context parallelism's FLOP
row (a rank's T/cp queries attend all T keys) and expert parallelism's all-to-alls in the
communication closed form. Real audits (``torchledger audit --mesh ... --fail-on warning``)
checked against hand arithmetic: no false warning, the reference equal to the measurement."""
from __future__ import annotations

import json
import textwrap

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch built without torch.distributed", allow_module_level=True)

from click.testing import CliRunner  # noqa: E402

from torchledger.cli import cli  # noqa: E402

# llama-tiny with 4 KV heads (V 512, d 64, L 2, h 4), batch 2 x 128 tokens, fp32.
TINY_128 = """
    import torch, torchledger
    from torchledger.models import build_model, get_config

    def audit_spec():
        cfg = get_config("llama-tiny").replace(n_kv_heads=4)
        model = build_model(cfg)
        idx = torch.randint(0, cfg.vocab_size, (2, 128))
        return torchledger.AuditSpec(model, {"idx": idx, "targets": idx})
"""


def audit_json(tmp_path, body, *args):
    """``torchledger audit FILE --steps 1 --fail-on warning ARGS``: (exit code, the record)."""
    model = tmp_path / "model.py"
    model.write_text(textwrap.dedent(body))
    out = tmp_path / "out.json"
    result = CliRunner().invoke(cli, ["audit", str(model), "--steps", "1", "--fail-on", "warning",
                                      "--output", str(out), *args])
    return result.exit_code, json.loads(out.read_text())


def _row(rec, quantity):
    return next(r for r in rec["predictions"]["comparisons"] if r["quantity"] == quantity)


def _codes(rec):
    return {f["rule"] for f in rec["findings"]}


def test_context_parallel_flops_reference_attends_every_key(tmp_path):
    code, rec = audit_json(tmp_path, TINY_128, "--mesh", "cp=2")
    # this rank: 2 x 64 tokens (its half of each sequence). 6ND = 6 x 133,120 matmul params x
    # 128 tokens = 102,236,160. Attention: each local query against all T = 128 keys, per layer
    # and token Q K^T 2 x 128 x 64 + x V 2 x 128 x 64 = 32,768 forward, x 3 for training, x 128
    # tokens x 2 layers = 25,165,824; (T/cp)^2 would say half: 12,582,912 (11.0% below)
    assert rec["totals"]["tokens"] == 128
    assert rec["totals"]["flops"]["total"] == 102_236_160 + 25_165_824 == 127_401_984
    row = _row(rec, "training FLOPs vs 6ND + 12LTd")
    assert row["predicted"] == 127_401_984 and row["ratio"] == 1.0
    assert "attend all T = 2 x 64 = 128 keys" in row["explanation"]
    assert "TL-CMP-001" not in _codes(rec) and code == 0


TINY4_128 = TINY_128.replace('replace(n_kv_heads=4)', 'replace(n_kv_heads=4, n_layers=4)')


@pytest.mark.slow
def test_context_parallel_flops_reference_on_a_pipeline_stage(tmp_path):
    _, rec = audit_json(tmp_path, TINY4_128, "--mesh", "pp=2,cp=2")
    # the bounding stage is rank 0: blocks 0 and 1 (2 x 50,176 matmul params) and the
    # embedding (a lookup); 2 micro-batches (pp) of 2 x 64 tokens = 256. 6ND = 6 x 100,352 x
    # 256 = 154,140,672; attention 6 x 2 layers x 128 keys x 128 x 256 tokens = 50,331,648
    assert rec["totals"]["pipeline"]["bounding_rank"] == 0 and rec["totals"]["tokens"] == 256
    assert rec["totals"]["flops"]["total"] == 154_140_672 + 50_331_648
    row = _row(rec, "training FLOPs vs 6ND + 12LTd")
    assert row["predicted"] == 204_472_320 and row["ratio"] == 1.0
    assert "TL-CMP-001" not in _codes(rec)
