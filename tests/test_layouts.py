"""The named ``--mesh`` and the standard plan (no AuditSpec.parallelize): FSDP2, HSDP, DDP,
TP with sequence parallelism, context parallelism, mixed precision and checkpointing on
llama-tiny at small world sizes under the fake process group, checked by hand."""
from __future__ import annotations

import textwrap

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch built without torch.distributed", allow_module_level=True)

from click.testing import CliRunner  # noqa: E402

from torchledger.audit.engine import run_audit  # noqa: E402
from torchledger.cli import cli  # noqa: E402
from torchledger.parallel.layout import parse_layout  # noqa: E402
from torchledger.audit.world import WorldError, resolve_world  # noqa: E402
from test_audit_cli import one_line_error  # noqa: E402

# llama-tiny with 4 KV heads: V 512, d 64, L 2, h 4 (d_h 16), d_ff 176, batch 2 x 32 tokens.
# Per block: q, k, v, o 4 x 4,096 = 16,384; gate, up, down 3 x 11,264 = 33,792; two norms 128.
# tok_emb and lm_head 32,768 each; final norm 64. In all 166,208 params, 664,832 B of fp32.
TINY = """
    import torch, torchledger
    from torchledger.models import build_model, get_config

    def audit_spec():
        cfg = get_config("llama-tiny").replace(n_kv_heads=4)
        model = build_model(cfg)
        idx = torch.randint(0, cfg.vocab_size, (2, 32))
        return torchledger.AuditSpec(model, {"idx": idx, "targets": idx})
"""
FULL = 166_208 * 4
FLOPS_1 = 54_263_808          # the unsharded step's matmul FLOPs (one process)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    p = tmp_path_factory.mktemp("layouts") / "tiny.py"
    p.write_text(textwrap.dedent(TINY))
    return str(p)


def audit(path, mesh=None, **plan):
    run = run_audit(path, steps=1, mesh=mesh, plan=plan)
    assert not dist.is_initialized()
    return run.record


# -- parsing -----------------------------------------------------------------------------------
def test_named_mesh_is_made_outermost_first():
    lay = parse_layout("dp=4,cp=2,tp=8,pp=9")
    assert lay.names == ("pp", "dp", "cp", "tp") and lay.shape == (9, 4, 2, 8)
    assert lay.world_size == 576 and lay.size("dp_replicate") == 1
    assert parse_layout("tp=2,dp_shard=3,ddp=2").dims == (("dp_replicate", 2), ("dp", 3), ("tp", 2))
    assert parse_layout("8x8").dims == (("dp", 8), ("tp", 8))     # the unnamed form keeps its meaning
    assert parse_layout("ep=2,pp=2,dp=2").names == ("pp", "dp", "ep")
    assert resolve_world(None, "dp=4,cp=2,tp=8,pp=9", "fake") == (576, (9, 4, 2, 8))


@pytest.mark.parametrize("text,needle", [
    ("dp=4,xp=2", "unknown dimension 'xp'"), ("dp=4,dp=2", "given twice"), ("dp=four", "dp=four"),
    ("dp=0", ">= 1"), ("dp4", "expected")])
def test_bad_named_mesh_is_one_line(text, needle):
    with pytest.raises(WorldError, match=None) as e:
        parse_layout(text)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_pipeline_options_without_pp_are_one_line(tiny):
    one_line_error(CliRunner().invoke(cli, ["audit", tiny, "--mesh", "dp=2", "--virtual-stages", "2"]),
                   "--virtual-stages", "no pp dimension")


def test_micro_batches_without_pp_are_gradient_accumulation(tiny):
    rec = audit(tiny, "dp=2", global_batch=16)
    assert rec.totals["micro_batches"] == 16 // (2 * 2)       # G / (dp x the spec's batch of 2)
    assert rec.totals["tokens"] == 2 * 32                     # the record is one micro-batch
    assert "micro_batches" not in audit(tiny, "dp=2").totals


# -- the standard plan ------------------------------------------------------------------------
def test_fsdp_standard_plan_shards_by_hand(tiny):
    rec = audit(tiny, "dp=8")
    # every dim 0 divides by 8: 664,832 / 8 = 83,104 B of parameters and of gradients
    assert rec.totals["param_bytes"] == rec.totals["grad_bytes"] == FULL // 8
    # forward all-gathers each shard once: 83,104 B
    assert rec.totals["comm_bytes"]["forward"] == FULL // 8
    assert rec.totals["flops"]["total"] == FLOPS_1
    assert rec.meta["audit"]["plan"][0].startswith("FSDP2 over 8 ranks")


def test_hsdp_2x4_replicates_then_shards(tiny):
    rec = audit(tiny, "dp_replicate=2,dp=4")
    # shards over dp=4 only: 664,832 / 4 = 166,208 B
    assert rec.totals["param_bytes"] == FULL // 4
    # forward all-gather of the shards 166,208; backward: all-gather 166,208 + reduce-scatter of
    # the full gradients 664,832 + all-reduce of the gradient shards over the 2 replicas 166,208
    assert rec.totals["comm_bytes"]["forward"] == 166_208
    assert rec.totals["comm_bytes"]["backward"] == 166_208 + 664_832 + 166_208
    reduce = [c for c in rec.collectives if c["op"] == "all_reduce"]
    assert reduce and {c["group_size"] for c in reduce} == {2}


def test_ddp_replicates_and_all_reduces_gradients(tiny):
    rec = audit(tiny, "dp_replicate=8")
    assert rec.totals["param_bytes"] == FULL
    # gradients all-reduced once, whole: 664,832 B; nothing in forward
    assert rec.totals["comm_bytes"]["forward"] == 0
    assert rec.totals["comm_bytes"]["backward"] == FULL


def test_tp_with_sequence_parallel_by_hand(tiny):
    rec = audit(tiny, "tp=4")
    assert rec.totals["flops"]["total"] == FLOPS_1 // 4
    # per block: attention and MLP each all-gather their Shard(1) input (2 x 8 x 64 fp32 =
    # 4,096) and reduce-scatter their output (2 x 32 x 64 fp32 = 16,384): 2 x 20,480 = 40,960;
    # 2 blocks 81,920. Root: the embedding reduce-scatters 16,384, the head all-gathers its
    # input 4,096 and its Shard(-1) logits to Replicate (2 x 32 x 128 fp32 = 32,768).
    assert rec.totals["comm_bytes"]["forward"] == 81_920 + 16_384 + 4_096 + 32_768
    assert "sequence parallel" in rec.meta["audit"]["plan"][0]


def test_tp_x_fsdp_params_by_hand(tiny):
    rec = audit(tiny, "dp=2,tp=4")
    # per block TP'd weights 50,176 / (4 x 2) = 6,272, norms 128 / 2 = 64: 6,336 x 2 = 12,672;
    # embedding and head split by TP (4) and FSDP (2): 2 x 4,096; final norm 64 / 2 = 32
    assert rec.totals["param_bytes"] == (12_672 + 8_192 + 32) * 4           # 83,584
    assert rec.meta["audit"]["mesh_dims"] == ["dp", "tp"]
    assert rec.totals["parallel_dims"] == {"dp": 2, "tp": 4}


def test_heads_not_dividing_tp_is_one_line(tiny):
    one_line_error(CliRunner().invoke(cli, ["audit", tiny, "--mesh", "tp=8", "--steps", "1"]),
                   "4 attention heads", "tp=8")


def test_context_parallel_by_hand(tiny):
    rec = audit(tiny, "cp=4")
    assert rec.totals["tokens"] == 2 * 32 // 4                     # this rank's quarter: 16
    assert rec.totals["flops"]["total"] == FLOPS_1 // 4            # matmuls and attention (T/4 x T)
    # FSDP over the 4 cp ranks (they hold the same weights): forward all-gather 166,208; K and V
    # all-gathered per layer: local 2 x 4 heads x 8 x 16 fp32 = 4,096 each, 2 layers: 16,384
    assert rec.totals["comm_bytes"]["forward"] == 166_208 + 16_384
    # backward: FSDP all-gather 166,208 + reduce-scatter 664,832; dK, dV reduce-scattered
    # (their full 2 x 4 x 32 x 16 fp32 = 16,384 each, 2 per layer, 2 layers)
    assert rec.totals["comm_bytes"]["backward"] == 166_208 + 664_832 + 4 * 16_384


def test_mixed_precision_gathers_in_bf16_reduces_in_fp32(tiny):
    rec = audit(tiny, "dp=8", precision="bf16-mixed")
    assert rec.totals["param_bytes"] == FULL // 8                  # fp32 shards kept
    assert rec.totals["comm_bytes"]["forward"] == FULL // 8 // 2   # all-gathered in bf16: 41,552
    rs = sum(c["bytes"] * 1 for c in rec.collectives if c["op"] == "reduce_scatter")
    assert rs == FULL                                              # reduced in fp32: 664,832


def test_checkpointing_full_keeps_less(tiny):
    plain = audit(tiny)
    full = audit(tiny, checkpointing="full")
    assert full.totals["activation_bytes"] < plain.totals["activation_bytes"]
    assert full.totals["flops"]["total"] == plain.totals["flops"]["total"]     # recompute is not counted twice
    assert "checkpointing full: 2 of 2 blocks" in full.meta["audit"]["plan"][0]


def test_unknown_model_with_tp_is_one_line(tmp_path):
    p = tmp_path / "mlp.py"
    p.write_text(textwrap.dedent("""
        import torch, torchledger
        def audit_spec():
            return torchledger.AuditSpec(torch.nn.Sequential(torch.nn.Linear(8, 8)), torch.randn(4, 8))
    """))
    one_line_error(CliRunner().invoke(cli, ["audit", str(p), "--mesh", "tp=2", "--steps", "1"]),
                   "tp=2", "Sequential", "parallelize")


HF_LLAMA = """
    import torch, torchledger
    from transformers import LlamaConfig, LlamaForCausalLM

    def audit_spec():
        cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                          attn_implementation="sdpa")
        idx = torch.randint(0, 512, (2, 32))
        return torchledger.AuditSpec(LlamaForCausalLM(cfg), {"input_ids": idx, "labels": idx})
"""


def test_hf_llama_standard_plan_tp_x_fsdp(tmp_path):
    pytest.importorskip("transformers")
    p = tmp_path / "hf.py"
    p.write_text(textwrap.dedent(HF_LLAMA))
    rec = audit(str(p), "dp=2,tp=2")
    # the same shapes as llama-tiny; TP on the blocks only (no SP for HF decoders): per block
    # 50,176 / (2 x 2) = 12,544 + norms 128 / 2 = 64; embedding, head 32,768 / 2 each, final
    # norm 64 / 2: 2 x 12,608 + 2 x 16,384 + 32 = 58,016 params
    assert rec.totals["param_bytes"] == 58_016 * 4
    # forward: FSDP2 all-gathers each shard once (232,064 B) and TP all-reduces o_proj's and
    # down_proj's outputs, 2 x 32 x 64 fp32 = 16,384 B each, once each per block: 4 x 16,384
    assert rec.totals["comm_bytes"]["forward"] == 58_016 * 4 + 4 * 16_384
    assert "no sequence parallelism: a Hugging Face decoder" in rec.meta["audit"]["plan"][0]


def test_hf_llama_context_parallel_equals_the_reference_model(tmp_path, tiny):
    pytest.importorskip("transformers")
    p = tmp_path / "hf.py"
    p.write_text(textwrap.dedent(HF_LLAMA))
    hf, ref = audit(str(p), "cp=4"), audit(tiny, "cp=4")
    # the same shapes, the same plan: a quarter of the sequence per rank, K/V all-gathered
    for key in ("tokens", "param_bytes"):
        assert hf.totals[key] == ref.totals[key], key
    # but not the norms' saves: nn.RMSNorm runs CUDA's fused kernel (input and rstd kept), HF's
    # LlamaRMSNorm is written out in Python ops that keep the normalized x too, on a GPU as here:
    # 5 norms (2 per block, the final one) x B 2 x T/cp 8 x d 64 x 4 B = 20,480 B more
    assert hf.totals["activation_bytes"] - ref.totals["activation_bytes"] == 5 * 2 * 8 * 64 * 4
    assert hf.totals["flops"]["total"] == ref.totals["flops"]["total"] == FLOPS_1 // 4
    assert hf.totals["comm_bytes"] == ref.totals["comm_bytes"]


def test_selective_op_counts_the_outputs_its_policy_saves(tiny):
    full = audit(tiny, checkpointing="full")
    sel = audit(tiny, checkpointing="selective-op")
    # the policy saves every other matmul's output: less is recomputed than under full
    block = lambda rec: next(m for m in rec.modules if m["name"] == "blocks.0")
    assert 0 < block(sel)["flops_recompute"] < block(full)["flops_recompute"]
    # 64 tokens, fp32. Full: the block's input, 64 x 64 x 4 = 16,384 B. Selective-op adds what
    # the policy keeps in PyTorch's checkpoint storage: mm outputs 1, 3, 5, 7 of q, k, v, o,
    # gate, up, down (q, v, gate, down: 16,384 + 16,384 + 64 x 176 x 4 = 45,056 + 16,384) and
    # the attention's output (16,384) and log-sum-exp (2 x 4 x 32 x 4 = 1,024): 128,000 B
    assert block(full)["activation_bytes"] == 16_384
    assert block(sel)["activation_bytes"] == 16_384 + (16_384 + 16_384 + 45_056 + 16_384) + 16_384 + 1_024
    assert not any("selective" in w for w in sel.warnings)


def test_selective_op_under_fsdp2_mixed_precision_runs(tiny):
    """FSDP2's mixed-precision input cast sits in a record_function outside the checkpointed
    region in forward and inside it in the recompute: selective-op used to fail every such
    step ("profiler._record_function_enter_new ... not found in storage")."""
    rec = audit(tiny, "dp=4", checkpointing="selective-op", precision="bf16-mixed")
    assert rec.totals["flops"]["total"] == FLOPS_1              # the spec's inputs are each rank's batch
    block = next(m for m in rec.modules if m["name"] == "blocks.0")
    assert block["flops_recompute"] > 0


# MoE-tiny: d 64, 2 layers, 4 SwiGLU experts of width 32, top-2, capacity factor 1. Per layer:
# attention 16,384, router 256, norms 128 (dense 16,768); experts 3 x 4 x 64 x 32 = 24,576.
# Dense in all: 2 x 16,768 + embedding, head 2 x 32,768 + norm 64 = 99,136 params.
# Capacity: ceil(1.0 x 64 tokens x 2 / 4) = 32; dispatch buffer 4 x 32 x 64 fp32 = 32,768 B.
MOE = """
    import torch, torchledger
    from torchledger.models import build_model
    from torchledger.models.moe import MoEConfig

    def audit_spec():
        cfg = MoEConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4, d_ff=32, mlp="swiglu",
                        norm="rmsnorm", bias=False, tie_embeddings=False, n_experts=4, top_k=2,
                        capacity_factor=1.0, name="moe-tiny")
        idx = torch.randint(0, 512, (2, 32))
        return torchledger.AuditSpec(build_model(cfg), {"idx": idx, "targets": idx})
"""


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    p = tmp_path_factory.mktemp("moe") / "moe.py"
    p.write_text(textwrap.dedent(MOE))
    return str(p)


def test_expert_parallel_by_hand(moe):
    single = audit(moe)
    assert single.totals["params"] == 99_136 + 2 * 24_576          # 148,288
    rec = audit(moe, "ep=4")
    # each rank keeps 1 of 4 experts per layer (3 x 64 x 32 x 2 layers = 12,288, whole: not
    # sharded over ranks holding other experts) and a quarter of the dense weights (24,784)
    assert rec.totals["params"] == 99_136 + 12_288
    assert rec.totals["param_bytes"] == (99_136 // 4 + 12_288) * 4
    a2a = [c for c in rec.collectives if c["op"] == "all_to_all"]
    # per layer: dispatch and combine in forward, their transposes in backward: 32,768 B each
    assert sum(c["count"] for c in a2a) == 2 * 2 * 2
    assert {c["bytes"] // c["count"] for c in a2a} == {32_768}
    assert {c["group_size"] for c in a2a} == {4}
    assert rec.totals["flops"]["total"] == single.totals["flops"]["total"]   # the same work, moved
    assert rec.meta["audit"]["plan"][0].startswith("ep=4: each rank holds 1 of 4 experts")


def test_expert_parallel_with_fsdp_shards_experts_over_dp(moe):
    rec = audit(moe, "dp=2,ep=2")
    # 2 of 4 experts per layer (24,576 params), sharded over dp=2; dense over dp x ep = 4
    assert rec.totals["param_bytes"] == (99_136 // 4 + 24_576 // 2) * 4
    experts = [c for c in rec.collectives if c["module"] and c["module"].endswith("mlp.experts")
               and c["op"] == "reduce_scatter"]
    assert experts and {c["group_size"] for c in experts} == {2}


def test_expert_parallel_without_dp_in_mixed_precision(moe):
    """ep alone under bf16-mixed: the experts stay outside FSDP2 (fp32) while the block gets
    bf16 activations; they compute in bf16 (the step failed, blaming the inputs)."""
    rec = audit(moe, "ep=4", precision="bf16-mixed")
    a2a = [c for c in rec.collectives if c["op"] == "all_to_all"]
    assert {c["bytes"] // c["count"] for c in a2a} == {32_768 // 2}      # bf16 dispatch buffer
    assert rec.totals["param_bytes"] == (99_136 // 4 + 12_288) * 4       # fp32 experts kept


def test_expert_parallel_with_context_parallel(moe):
    rec = audit(moe, "ep=2,cp=2")
    # dense over ep x cp = 4 (24,784); 2 of 4 experts a layer sharded over cp=2 (12,288)
    assert rec.totals["param_bytes"] == (99_136 // 4 + 24_576 // 2) * 4
    # 32 tokens a rank: capacity ceil(32 x 2 / 4) = 16, dispatch buffer 4 x 16 x 64 x 4 B
    a2a = [c for c in rec.collectives if c["op"] == "all_to_all"]
    assert {c["bytes"] // c["count"] for c in a2a} == {16_384}


def test_tp_on_the_bundled_moe_is_one_line(moe):
    # it failed in the step ("mixed torch.Tensor and DTensor ... check the inputs")
    one_line_error(CliRunner().invoke(cli, ["audit", moe, "--mesh", "tp=2", "--steps", "1"]),
                   "tp=2", "torchledger's MoE layers")


def test_ep_on_a_dense_model_is_one_line(tiny):
    one_line_error(CliRunner().invoke(cli, ["audit", tiny, "--mesh", "ep=2", "--steps", "1"]),
                   "ep=2", "no mixture-of-experts layers")


# What failed before (issue 22, items 1 and 2): PyTorch's own schedules and context_parallel on
# fake tensors ended in a misleading line ("try --device cpu", "check the inputs").
USER_PIPELINE = """
import torch, torchledger
import torch.distributed as dist

def step(model, inputs, opt):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    stage = PipelineStage(model, dist.get_rank(), 2, torch.device("cpu"))
    sched = Schedule1F1B(stage, n_microbatches=2, loss_fn=lambda out, tgt: out.float().mean())
    sched.step(inputs)
    opt.step(); opt.zero_grad()

def audit_spec():
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU())
    return torchledger.AuditSpec(model, torch.randn(4, 16), step=step, parallelize=lambda m, mesh: m)
"""

USER_CONTEXT_PARALLEL = """
import torch, torchledger
import torch.nn.functional as F

class Attn(torch.nn.Module):
    def __init__(self):
        super().__init__(); self.qkv = torch.nn.Linear(64, 192)
    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, 4, 16).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).sum()

MESH = {}
def parallelize(model, mesh):
    MESH["m"] = mesh
    return model

def step(model, inputs, opt):
    from torch.distributed.tensor.experimental import context_parallel
    with context_parallel(MESH["m"], buffers=[inputs], buffer_seq_dims=[1]):
        loss = model(inputs)
    loss.backward(); opt.step(); opt.zero_grad()

def audit_spec():
    return torchledger.AuditSpec(Attn(), torch.randn(2, 32, 64), step=step, parallelize=parallelize)
"""


@pytest.mark.parametrize("body,needles", [
    (USER_PIPELINE, ("pipelining schedules cannot run on fake tensors", "--mesh with pp=N")),
    (USER_CONTEXT_PARALLEL, ("context_parallel has no sharding rule", "--mesh with cp=N"))],
    ids=["pipelining", "context_parallel"])
def test_torch_pipelining_and_context_parallel_say_what_to_do(tmp_path, body, needles):
    p = tmp_path / "user.py"
    p.write_text(body)
    err = one_line_error(CliRunner().invoke(cli, ["audit", str(p), "--world-size", "2", "--steps", "1"]),
                         *needles)
    assert "check the inputs" not in err and "try --device cpu" not in err
    assert not dist.is_initialized()
