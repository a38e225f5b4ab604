"""Layouts audited at simulated world sizes (fake tensors, fake process group) and judged
against the right references: DDP, HSDP, TP without FSDP, FSDP2 padding, mixed precision,
reshard_after_forward=False, a first step. Sizes are small; every expected number is worked
by hand in a comment."""
from __future__ import annotations

import textwrap

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch built without torch.distributed", allow_module_level=True)

from torchledger.audit import run_audit  # noqa: E402


def write(tmp_path, body, name="model.py"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(body))
    return str(p)


def findings(rec) -> dict:
    from torchledger.analyzers.comm import check_comm
    from torchledger.analyzers.compare import check_comparisons
    return {f.rule: f for f in check_comm(rec) + check_comparisons([rec])}


# 64 -> 130 -> 64 MLP: (64*130 + 130 + 130*64 + 64) = 16,834 params, 67,336 B of fp32.
MLP = """
    import torch, torchledger

    HOOK = None

    def ddp(model, mesh):
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(model, process_group=mesh.get_group())
        if HOOK is not None:
            model.register_comm_hook(None, HOOK)
        return model

    PARALLELIZE = ddp

    def audit_spec():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 130), torch.nn.ReLU(), torch.nn.Linear(130, 64))
        return torchledger.AuditSpec(model, torch.randn(4, 64), parallelize=PARALLELIZE)
"""
MLP_BYTES = 16_834 * 4


def test_ddp_simulates_on_fake_tensors(tmp_path):
    from torch.nn.parallel import distributed as ddp_mod
    before = (ddp_mod.DistributedDataParallel.__init__, ddp_mod._verify_param_shape_across_processes)
    run = run_audit(write(tmp_path, MLP), world_size=8, steps=2)
    for rec in run.records:            # the first step and the second (DDP's rebuilt buckets)
        ar = [c for c in rec.collectives if c["op"] == "all_reduce"]
        # every gradient all-reduced once, in backward: 67,336 B sent, x 2 x 7 / 8 on the bus
        assert sum(c["bytes"] for c in ar) == MLP_BYTES and {c["phase"] for c in ar} == {"backward"}
        assert sum(c["bus_bytes"] for c in ar) == MLP_BYTES * 2 * 7 // 8 == 117_838
        assert {c["group_size"] for c in ar} == {8}
        assert rec.totals["param_bytes"] == MLP_BYTES           # replicated: all of it
    f = findings(run.record)
    assert f["TL-COMM-001"].expected == MLP_BYTES and "(1.000x)" in f["TL-COMM-001"].message
    assert "TL-CMP-002" not in f
    # the patches last as long as the world
    assert (ddp_mod.DistributedDataParallel.__init__, ddp_mod._verify_param_shape_across_processes) == before
    assert not dist.is_initialized()


def test_ddp_user_comm_hook_still_runs(tmp_path):
    """torch's own allreduce_hook chains on the future's value, None under the fake group: it
    still runs (its all-reduce recorded) and the bucket stands in for the value."""
    body = MLP.replace("HOOK = None", "from torch.distributed.algorithms.ddp_comm_hooks.default_hooks "
                                      "import allreduce_hook as HOOK")
    run = run_audit(write(tmp_path, body), world_size=4, steps=1)
    ar = [c for c in run.record.collectives if c["op"] == "all_reduce"]
    assert sum(c["bytes"] for c in ar) == MLP_BYTES and {c["group_size"] for c in ar} == {4}


# llama-tiny (V 512, d 64, L 2, 4 heads, d_ff 176) with 4 KV heads; FSDP2 per block + root.
TINY = """
    import torch, torchledger
    from torchledger.models import build_model, get_config

    RESHARD = True
    MP = None

    def fsdp(model, mesh):
        from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy
        kw = {"mp_policy": MixedPrecisionPolicy(**MP)} if MP else {}
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=RESHARD, **kw)
        return fully_shard(model, mesh=mesh, **kw)

    PARALLELIZE = fsdp

    def audit_spec():
        cfg = get_config("llama-tiny").replace(n_kv_heads=4)
        model = build_model(cfg)
        idx = torch.randint(0, cfg.vocab_size, (2, 32))
        return torchledger.AuditSpec(model, {"idx": idx, "targets": idx}, parallelize=PARALLELIZE)
"""
# matmul weights: per block q, k, v, o 4 x 64 x 64 = 16,384 + gate, up, down 3 x 176 x 64 =
# 33,792 -> 50,176; 2 blocks + the 512 x 64 head = 100,352 + 32,768 = 133,120 (N of 6ND)
TINY_N = 133_120


@pytest.fixture(scope="module")
def tiny_single(tmp_path_factory):
    path = write(tmp_path_factory.mktemp("single"), TINY)
    return run_audit(path, steps=1).record


@pytest.mark.parametrize("world", [1, 8])
def test_fsdp2_gathered_weights_are_not_activations(tmp_path, tiny_single, world):
    """The weights FSDP2 all-gathers and a matmul saves for backward are parameters: the
    activations saved equal the unsharded step's (they were 533,760 B more at world 8)."""
    rec = run_audit(write(tmp_path, TINY), world_size=world, steps=1).record
    assert rec.totals["activation_bytes"] == tiny_single.totals["activation_bytes"]
    # N of 6ND: the unsharded weights the matmuls multiply, at world size 1 too (FSDP2 copies
    # the shard into the unsharded buffer without a collective there); was 0
    assert rec.totals["matmul_params"] == tiny_single.totals["matmul_params"] == TINY_N
    rows = {r["quantity"]: r for r in rec.predictions["comparisons"]}
    assert rows["training FLOPs vs 6ND + 12LTd"]["ratio"] == 1.0
