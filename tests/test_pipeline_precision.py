"""Every precision on every mesh shape with ``pp``: the stage runner computes in the plan's
dtype (it used to replace the autocast-wrapped forward and trace fp32 matmuls under
``--precision bf16-mixed`` without dp), and what one stage sends is what the next receives.

TL-PREC-001 (matmuls in fp32 under a 16-bit plan) checked on hand-made records."""
import pytest

from _pipeline_models import write_model

from torchledger.analyzers.precision import check_precision, matmul_flops_by_dtype
from torchledger.record import StepRecord

torch = pytest.importorskip("torch")

# llama-tiny, 4 blocks, batch 2 x 32 tokens, d = 64 (tests/_pipeline_models.py): an activation
# between stages holds 2 x 32 x 64 = 4,096 elements; under tp (sequence parallel) or cp a
# rank's is T/2: 2,048.
M = 4
COMPUTE = {"fp32": "fp32", "bf16": "bf16", "bf16-mixed": "bf16", "fp16-mixed": "fp16"}
# (mesh, virtual stages, elements of one activation, data parallel wraps the model)
MESHES = [("pp=2", 1, 4096, False), ("dp=2,pp=2", 1, 4096, True), ("tp=2,pp=2", 1, 2048, False),
          ("cp=2,pp=2", 1, 2048, True), ("dp_replicate=2,pp=2", 1, 4096, True), ("pp=2", 2, 4096, False)]


def _stream_bytes(precision: str, data_parallel: bool) -> int:
    """Bytes per element of what flows between stages: fp32 and bf16 weights keep their
    dtype; under FSDP2/DDP's MixedPrecisionPolicy the blocks compute (and return) 16 bits;
    under autocast on fp32 weights (no data parallelism) the residual stream stays fp32
    (fp32 embeddings plus 16-bit block outputs promote to fp32)."""
    if precision == "bf16" or (precision.endswith("-mixed") and data_parallel):
        return 2
    return 4


@pytest.fixture(scope="module")
def tiny4(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("ppprec"))


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("mesh,v,elements,dp", MESHES, ids=[f"{m}-v{v}" for m, v, _, _ in MESHES])
def test_every_precision_on_every_pipeline_mesh(tiny4, precision, mesh, v, elements, dp):
    """fp32 and bf16 weights here; the mixed precisions in test_pipeline_mixed_precision.py
    (two files: the suite's workers run them side by side)."""
    check_pipeline_precision(tiny4, precision, mesh, v, elements, dp)


def check_pipeline_precision(tiny4, precision, mesh, v, elements, dp):
    from torchledger.audit.engine import run_audit
    from torchledger.analyzers.checks import run_checks
    rec = run_audit(tiny4, mesh=mesh, plan={"micro_batches": M, "precision": precision,
                                            "virtual_stages": v}).record
    # every matmul of the bounding stage in the plan's compute dtype
    assert set(matmul_flops_by_dtype(rec)) == {COMPUTE[precision]}
    assert rec.meta["audit"]["precision"] == precision
    assert not [f for f in run_checks([rec]) if f.rule == "TL-PREC-001"]
    # p2p per stage: each of the v chunks receives and sends (the ends one of the two), in
    # forward the activation, in backward its gradient: 2 x (2v - 1) tensors a micro-batch.
    # pp=2 v=1 bf16-mixed without dp: 4 x 2 x 1 x 4,096 x 4 B = 131,072
    want = M * 2 * (2 * v - 1) * elements * _stream_bytes(precision, dp)
    assert [s["p2p_bytes"] for s in rec.totals["pipeline"]["per_stage"]] == [want, want]


def _record(dtypes: dict, precision=None, autocast=None) -> StepRecord:
    rec = StepRecord()
    rec.ops = [{"op": "aten.mm.default", "kind": "matmul", "phase": "forward", "count": len(dtypes),
                "flops": sum(dtypes.values()),
                "shapes": [{"mnk": [1, 8, 8, 8], "dtype": d, "flops": f, "count": 1} for d, f in dtypes.items()]}]
    rec.meta["audit"] = {"file": "m.py", "entry": "audit_spec", "device": "fake", "steps": 1,
                         "precision": precision}
    rec.meta["autocast"] = autocast
    return rec


def test_fp32_matmuls_under_a_16_bit_plan_warn():
    # 990 of 1,000 FLOPs in fp32 under bf16-mixed: 99.0%
    found = check_precision([_record({"fp32": 990, "bf16": 10}, precision="bf16-mixed")], {})
    assert [f.rule for f in found] == ["TL-PREC-001"]
    assert found[0].measured == 990 and "99.0%" in found[0].message and "--precision bf16-mixed" in found[0].message
    # autocast seen in the step (no --precision) is a 16-bit intent too
    found = check_precision([_record({"fp32": 500, "fp16": 500}, autocast={"device_type": "cuda",
                                                                          "dtype": "float16"})], {})
    assert [f.rule for f in found] == ["TL-PREC-001"] and "not fp16" in found[0].message


def test_no_warning_when_the_plan_is_fp32_or_the_share_is_small():
    assert check_precision([_record({"fp32": 1000}, precision="fp32")], {}) == []
    assert check_precision([_record({"fp32": 1000})], {}) == []
    # 10 of 1,010 = 0.99%: at or under the 1% default
    assert check_precision([_record({"fp32": 10, "bf16": 1000}, precision="bf16")], {}) == []
    # 11 of 1,011 = 1.09%: over it; a larger share setting silences it
    assert check_precision([_record({"fp32": 11, "bf16": 1000}, precision="bf16")], {})
    assert check_precision([_record({"fp32": 11, "bf16": 1000}, precision="bf16")],
                           {"fp32_matmul_share": 0.02}) == []
