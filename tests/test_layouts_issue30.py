"""Layouts off the main path (issue 30 items 8 and 9).

Item 8, tied embeddings under pp: GPT-2's wte is its lm_head's weight; cut into stages, the
first stage holds it as the embedding and the last as the head, each a copy with its own
gradient. Megatron-LM all-reduces that gradient between the two once a step
(``finalize_model_grads`` -> ``_allreduce_word_embedding_grads``); PyTorch's pipelining leaves
it to the training loop (``torch/distributed/pipelining/_IR.py``: "investigate gradient sync
for shared parameters" is a TODO). The audit models Megatron's all-reduce and says so."""
from __future__ import annotations

import copy

import pytest

from _pipeline_models import write_model

GPT = """
    import torch, torchledger
    from torchledger.models import build_model, get_config

    def audit_spec():
        cfg = get_config("gpt2-tiny").replace(n_layers=2)
        model = build_model(cfg)
        idx = torch.randint(0, cfg.vocab_size, (2, 32))
        return torchledger.AuditSpec(model, {"idx": idx, "targets": idx})
"""
# gpt2-tiny: V = 512, d = 64, fp32: the tied weight's gradient 512 x 64 x 4 B = 131,072 B
V, D = 512, 64
TIED_GRAD = V * D * 4


def _tied_rows(rec):
    return [c for c in rec.collectives if c["op"] == "all_reduce"]


@pytest.fixture(scope="module")
def gpt_pp2(tmp_path_factory):
    from torchledger.audit.engine import run_audit
    path = write_model(tmp_path_factory.mktemp("tied"), GPT, "gpt.py")
    return run_audit(path, mesh="pp=2", plan={"micro_batches": 2})


@pytest.mark.slow
def test_tied_embedding_gradient_all_reduced_between_end_stages(gpt_pp2):
    for r, rec in gpt_pp2.stage_records.items():
        rows = _tied_rows(rec)
        # one all-reduce a step (the last micro-step only), between the 2 end stages, of the
        # whole tied gradient: 512 x 64 x 4 = 131,072 B, after the backward
        assert [(c["bytes"], c["group_size"], c["count"], c["micro_steps"], c["phase"]) for c in rows] == \
            [(TIED_GRAD, 2, 1, 1, "other")], (r, rows)
        assert rec.totals["comm_bytes"]["other"] == TIED_GRAD
        assert any("tied embedding under pp" in n and "diverge" in n for n in rec.meta["audit"]["plan"])


@pytest.mark.slow
def test_tied_sync_counts_in_the_step_time(gpt_pp2):
    from torchledger.steptime.predict import predict_step_time
    rec = gpt_pp2.stage_records[0]
    pred = predict_step_time(rec, "h100")
    with_sync = pred["seconds"]
    without = copy.deepcopy(rec)
    without.collectives = [c for c in without.collectives if c["op"] != "all_reduce"]
    (i,) = [k for k, c in enumerate(rec.collectives) if c["op"] == "all_reduce"]
    secs = pred["_collectives"][i][0]       # the row's priced seconds
    # exposed once, after the passes (as Megatron runs it: after the backward, before the step)
    assert secs > 0
    assert with_sync - predict_step_time(without, "h100")["seconds"] == pytest.approx(secs, rel=1e-9)


@pytest.mark.slow
def test_tied_sync_under_fsdp_is_the_shard(tmp_path):
    from torchledger.audit.engine import run_audit
    path = write_model(tmp_path, GPT, "gpt.py")
    run = run_audit(path, mesh="pp=2,dp=2", plan={"micro_batches": 2})
    for r, rec in run.stage_records.items():
        # FSDP2 shards the weight over dp = 2 (both ends alike): 131,072 / 2 = 65,536 B
        assert [(c["bytes"], c["group_size"]) for c in _tied_rows(rec)
                if c["group_size"] == 2 and c["phase"] == "other"] == [(TIED_GRAD // 2, 2)], r


def test_tied_weight_found_on_the_end_stages_only():
    import torch
    from torchledger.audit.pipeline import tied_weight
    from torchledger.models import build_model, get_config
    from torchledger.parallel.plan import find_decoder
    with torch.device("meta"):
        gpt = build_model(get_config("gpt2-tiny"))
        llama = build_model(get_config("llama-tiny"))
    dec = find_decoder(gpt)
    assert tied_weight(gpt, dec, has_first=True, has_last=False) == "tok_emb.weight"
    assert tied_weight(gpt, dec, has_first=False, has_last=True) == "lm_head.weight"
    assert tied_weight(gpt, dec, has_first=False, has_last=False) is None      # a middle stage
    assert tied_weight(llama, find_decoder(llama), has_first=True, has_last=False) is None  # untied


# -- item 9c: collectives issued in backward outside every module's nodes -----------------------
LLAMA = """
    import torch, torchledger
    from torchledger.models import build_model, get_config

    def audit_spec():
        cfg = get_config("llama-tiny").replace(n_kv_heads=4, n_layers=2)
        model = build_model(cfg)
        idx = torch.randint(0, cfg.vocab_size, (2, 32))
        return torchledger.AuditSpec(model, {"idx": idx, "targets": idx})
"""


def test_fsdp_root_reductions_under_tp_belong_to_the_root(tmp_path):
    """FSDP2 x TP: the root unit's post-backward runs in the engine's final callback (the
    root's forward inputs, token ids, need no gradient): its reduce-scatter and the final
    norm's Partial -> Replicate all-reduce were "(no module)"; they are the root's ("")."""
    from torchledger.audit.engine import run_audit
    rec = run_audit(write_model(tmp_path, LLAMA, "llama.py"), mesh="dp=2,tp=2").record
    back = [c for c in rec.collectives if c["phase"] == "backward"]
    assert not [c for c in back if c["module"] == "(no module)"], back
    root = sorted((c["op"], c["bytes"]) for c in back if c["module"] == "")
    # the root unit's parameters on a tp rank: the embedding and the head V x d / tp each,
    # the final norm d whole: 512 x 64 / 2 x 2 + 64 = 32,832 x 4 B = 131,328 B reduce-scattered;
    # the final norm's gradient (Partial over tp) all-reduced first: 64 x 4 = 256 B
    assert ("reduce_scatter", 131_328) in root and ("all_reduce", 256) in root, root
    # the blocks' units: their own post-backward, each with its two norms' all-reduces (2 x 256)
    assert sorted((c["module"], c["bytes"]) for c in back if c["op"] == "all_reduce") == \
        [("", 256), ("blocks.0", 512), ("blocks.1", 512)]


# -- item 9d: FSDP2's accumulated gradients under pp ---------------------------------------------
@pytest.mark.slow
def test_fsdp_accumulated_gradients_are_gradients_under_pp(tmp_path):
    """pp=2 x dp=2 under bf16-mixed: between micro-batches FSDP2 keeps each unsharded gradient
    upcast to fp32 in ``FSDPParam.unsharded_accumulated_grad``; they were "temporaries"."""
    from torchledger.audit.engine import run_audit
    run = run_audit(write_model(tmp_path, LLAMA, "llama.py"), mesh="pp=2,dp=2",
                    plan={"micro_batches": 4, "precision": "bf16-mixed"})
    last = run.stage_records[1]
    assert last.totals["pipeline"]["per_stage"][1]["peak_micro_step"] == "steady"
    # the last stage's parameters: block 1 (50,176 matmul weights + 2 norms of 64), the final
    # norm 64, the head 512 x 64: 83,136 x 4 B (fp32, unsharded) = 332,544 B, all of them
    # accumulated at a steady micro-step's peak (its own bf16 gradients are folded in by then)
    assert last.memory["peak_breakdown"]["gradients"] == (50_176 + 128 + 64 + 512 * 64) * 4
    first = run.stage_records[0]
    # the first stage's: the embedding 512 x 64 and block 0: 83,072 x 4 = 332,288 B at least
    assert first.memory["peak_breakdown"]["gradients"] >= (512 * 64 + 50_176 + 128) * 4


# -- item 9: --mesh dp_replicate=N alone is torchtitan's DDP ------------------------------------
# torchtitan's apply_ddp (torchtitan/models/llama3/infra/parallelize.py) for dp_replicate alone:
# ``replicate(model, device_mesh=dp_mesh, bucket_cap_mb=100)`` from torch.distributed._composable
# .replicate, a DistributedDataParallel: gradients all-reduced in buckets cut in reverse
# registration order; a bucket closes once its size reaches the cap (the tensor that crosses it
# stays in). The 1 MiB first bucket (dist._DEFAULT_FIRST_BUCKET_BYTES) is only DDP's default:
# torch 2.13's _BucketCapacityConfig.create sets the first cap to bucket_cap_mb when one is given,
# so under torchtitan every cap is 100 MiB = 104,857,600 B. Fake tensors: 64 MiB layers cost nothing.
LINEARS = """
    import torch, torchledger

    def audit_spec():
        model = torch.nn.Sequential(*(torch.nn.Linear(4096, 4096, bias=False) for _ in range(3)),
                                    torch.nn.Linear(4096, 64, bias=False), torch.nn.Linear(64, 64, bias=False))
        return torchledger.AuditSpec(model, torch.randn(2, 4096))
"""
BIG, MID, SMALL = 4096 * 4096 * 4, 4096 * 64 * 4, 64 * 64 * 4   # 67,108,864; 1,048,576; 16,384 B
GRADS = 3 * BIG + MID + SMALL
assert GRADS == 202_391_552


def _all_reduces(rec):
    return sorted((c["bytes"], c["group_size"], c["phase"]) for c in rec.collectives
                  for _ in range(c["count"]) if c["op"] == "all_reduce")


@pytest.fixture(scope="module")
def linears(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("ddp"), LINEARS, "linears.py")


def test_dp_replicate_alone_all_reduces_ddp_buckets(linears):
    from torchledger.audit.engine import run_audit
    rec = run_audit(linears, steps=1, mesh="dp_replicate=4").record
    # cap 104,857,600, reverse order: layer 4 + 3 + 2 = 16,384 + 1,048,576 + 67,108,864 =
    # 68,173,824 (under the cap) + layer 1 = 135,282,688 >= cap: bucket 1; layer 0: bucket 2
    assert _all_reduces(rec) == sorted([(SMALL + MID + 2 * BIG, 4, "backward"), (BIG, 4, "backward")])
    # every gradient once, nothing in forward (DDP's setup broadcast is not a step)
    assert rec.totals["comm_bytes"]["backward"] == GRADS and rec.totals["comm_bytes"]["forward"] == 0
    assert any("DistributedDataParallel" in n and "up to 100 MiB" in n for n in rec.meta["audit"]["plan"])


def test_ddp_bucket_cap_follows_the_plan_constant(linears, monkeypatch):
    from torchledger.audit.engine import run_audit
    from torchledger.parallel import plan
    # cap 64 MiB = 67,108,864 B: layer 4 + 3 + 2 = 68,173,824 >= cap: bucket 1; layer 1 reaches
    # the cap alone: bucket 2; layer 0: bucket 3 (three all-reduces, 202,391,552 B in all)
    monkeypatch.setattr(plan, "DDP_BUCKET_CAP_MB", 64)
    rec = run_audit(linears, steps=1, mesh="dp_replicate=2").record
    assert _all_reduces(rec) == sorted([(SMALL + MID + BIG, 2, "backward")] + [(BIG, 2, "backward")] * 2)
    assert rec.totals["comm_bytes"]["backward"] == GRADS


def test_ddp_mixed_precision_is_autocast_as_torchtitan(linears):
    # torchtitan's maybe_enable_amp: no FSDP -> torch.autocast; the gradients of the fp32
    # parameters stay fp32, so the buckets are the bytes of the first test
    from torchledger.audit.engine import run_audit
    rec = run_audit(linears, steps=1, mesh="dp_replicate=4", plan={"precision": "bf16-mixed"}).record
    assert [b for b, _, _ in _all_reduces(rec)] == sorted([SMALL + MID + 2 * BIG, BIG])
    assert any("autocast" in n for n in rec.meta["audit"]["plan"])


def test_dp_replicate_with_tp_keeps_fsdp2_replicate(tmp_path):
    # torchtitan's parallelize_llama raises "DDP has not supported > 1D parallelism" when the
    # world is more than dp_replicate; the audit keeps FSDP2's replicate there and says so
    from torchledger.audit.engine import run_audit
    rec = run_audit(write_model(tmp_path), steps=1, mesh="dp_replicate=2,tp=2").record
    assert any("FSDP2's replicate" in n for n in rec.meta["audit"]["plan"])
    assert not any("DistributedDataParallel" in n for n in rec.meta["audit"]["plan"])
    assert {c["group_size"] for c in rec.collectives if c["op"] == "all_reduce"} >= {2}
