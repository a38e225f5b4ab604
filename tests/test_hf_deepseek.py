"""DeepSeek-V3 (transformers 5.x ``DeepseekV3ForCausalLM``: multi-head latent attention, a shared
expert, dense first layers) under the standard plan (issue 29, item 7), checked by hand on a small
config built from its config alone at ``--mesh ep=2``, ``dp=2,ep=2``, ``pp=2``, ``cp=2`` and ``tp=2``."""
from __future__ import annotations

import json
import textwrap

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
transformers = pytest.importorskip("transformers")
if not dist.is_available():
    pytest.skip("torch built without torch.distributed", allow_module_level=True)
if not hasattr(transformers, "DeepseekV3Config"):
    pytest.skip("transformers without DeepSeek-V3", allow_module_level=True)

from click.testing import CliRunner  # noqa: E402

from torchledger.audit.engine import run_audit  # noqa: E402
from torchledger.cli import cli  # noqa: E402
from torchledger.parallel.plan import find_decoder  # noqa: E402

SPEC = """
    import torch, torchledger, transformers

    def audit_spec():
        cfg = transformers.{config}
        model = transformers.AutoModelForCausalLM.from_config(cfg)
        ids = torch.randint(0, cfg.vocab_size, (2, 32))
        return torchledger.AuditSpec(model, {{"input_ids": ids, "labels": ids}}, tokens=64, seq_len=32)
"""

# DeepSeek-V3 small: V 512, d 64, L 3 of which the first (first_k_dense_replace=1) dense, h 4,
# q_lora_rank 24, kv_lora_rank 16, q/k head dim 16 nope + 8 rope = 24, v head dim 12; MoE layers:
# 8 routed experts of width 32, top-2, one shared expert of width 32; batch 2 x 32 = N 64 tokens.
DSV3 = ("DeepseekV3Config(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, "
        "num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, "
        "n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1, "
        "q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, "
        "max_position_embeddings=128, tie_word_embeddings=False)")
# Per layer, attention: q_a_proj 64 x 24 = 1,536, q_a_layernorm 24, q_b_proj 24 x 4 x 24 = 2,304,
# kv_a_proj_with_mqa 64 x (16 + 8) = 1,536, kv_a_layernorm 16, kv_b_proj 16 x 4 x (16 + 12) = 1,792,
# o_proj 4 x 12 x 64 = 3,072: 10,280; two norms 128: 10,408.
LAYER = 10_408
DENSE_MLP = 3 * 64 * 128                 # layer 0: 24,576
ROUTER, SHARED = 8 * 64, 3 * 64 * 32     # layers 1, 2: 512 and 6,144
EXPERTS_LAYER = 8 * 3 * 64 * 32          # 49,152 routed (gate_up (8, 64, 64), down (8, 64, 32))
EMBED = HEAD = 512 * 64                  # 32,768 each; the final norm 64
DENSE = 3 * LAYER + DENSE_MLP + 2 * (ROUTER + SHARED) + EMBED + HEAD + 64      # 134,712
EXPERTS = 2 * EXPERTS_LAYER                                                    # 98,304

# Matmul FLOPs forward, N = 64 tokens: per layer the projections 2 x 64 x (1,536 + 2,304 + 1,536
# + 1,792 + 3,072) = 1,310,720; scores and values 2 x B 2 x h 4 x T 32 x T 32 x (d 24 + dv 12)
# = 589,824 (the q/k head dim and the v head dim apart); layer 0's MLP 2 x 64 x 24,576 =
# 3,145,728; a MoE layer: router 2 x 64 x 512 = 65,536, shared expert 2 x 64 x 6,144 = 786,432,
# routed experts 2 x (N k = 128) x d 64 x f 32 x 3 = 1,572,864; head 2 x 64 x 64 x 512 =
# 4,194,304. Backward twice the forward.
ATTN_FLOPS = 1_310_720 + 589_824
MOE_FLOPS = 65_536 + 786_432 + 2 * 128 * 64 * 32 * 3
HEAD_FLOPS = 4_194_304
FLOPS = 3 * (3 * ATTN_FLOPS + 3_145_728 + 2 * MOE_FLOPS + HEAD_FLOPS)          # 53,673,984
# All-to-all: every rank sends its N x k = 128 routed rows of d = 64 (balanced), 4 B in fp32:
# 32,768 B; per MoE layer dispatch and combine in forward, their transposes in backward.
A2A_BYTES = 64 * 2 * 64 * 4


@pytest.fixture(scope="module")
def dsv3(tmp_path_factory):
    p = tmp_path_factory.mktemp("hf_deepseek") / "dsv3.py"
    p.write_text(textwrap.dedent(SPEC.format(config=DSV3)))
    return str(p)


def audit(path, mesh, **plan):
    return run_audit(path, steps=1, mesh=mesh, plan=plan)


def _all_to_all(rec):
    return [c for c in rec.collectives if c["op"] == "all_to_all"]


def test_decoder_recognised_with_latent_attention():
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(eval("transformers." + DSV3))
    dec = find_decoder(model)
    assert dec is not None and dec.attention == "mla"
    assert (dec.experts, dec.top_k, dec.n_heads, dec.d_ff) == (8, 2, 4, 128)   # d_ff: layer 0's MLP


def test_expert_parallel_by_hand(dsv3):
    rec = audit(dsv3, "ep=2").record
    assert DENSE == 134_712 and FLOPS == 53_673_984
    # each rank holds 4 of the 8 routed experts of both MoE layers, whole (49,152 params, 196,608
    # B = 98,304 x 4 B / ep 2); the dense weights (attention, layer 0's MLP, routers, shared
    # experts, embedding, head) FSDP-sharded over ep=2
    assert rec.totals["params"] == DENSE + EXPERTS // 2
    assert rec.totals["param_bytes"] == (DENSE // 2 + EXPERTS // 2) * 4
    a2a = _all_to_all(rec)
    assert sum(c["count"] for c in a2a) == 2 * 4               # 2 MoE layers x (2 fwd + 2 bwd)
    assert {c["bytes"] // c["count"] for c in a2a} == {A2A_BYTES}
    assert {c["group_size"] for c in a2a} == {2}
    assert {c["module"] for c in a2a} == {"model.layers.1.mlp.experts", "model.layers.2.mlp.experts"}
    assert rec.totals["flops"]["total"] == FLOPS
    notes = rec.meta["audit"]["plan"]
    assert any(n.startswith("experts: 2 mixture-of-experts layers") for n in notes)   # layer 0 dense


def test_expert_parallel_with_fsdp_bf16(dsv3):
    rec = audit(dsv3, "dp=2,ep=2", precision="bf16-mixed").record
    # 4 experts a rank sharded over dp=2 (a quarter of the routed bytes); dense over dp x ep = 4
    assert rec.totals["param_bytes"] == (DENSE // 4 + EXPERTS // 4) * 4 == 233_016
    a2a = _all_to_all(rec)
    assert {c["bytes"] // c["count"] for c in a2a} == {A2A_BYTES // 2}     # bf16 rows: 16,384 B
    reduced = [c for c in rec.collectives if c["op"] == "reduce_scatter"
               and (c["module"] or "").endswith("mlp.experts")]
    assert reduced and {c["group_size"] for c in reduced} == {2}          # expert grads over dp
    # the fp32 gradients of a rank's 4 experts of a layer: 24,576 x 4 B = 98,304 B reduce-scattered
    assert {c["bytes"] // c["count"] for c in reduced} == {98_304}
    assert rec.totals["flops"]["total"] == FLOPS


@pytest.mark.slow
def test_pipeline_cuts_dense_and_moe_blocks(dsv3):
    run = audit(dsv3, "pp=2")
    stages = {s["rank"]: s for s in run.record.totals["pipeline"]["per_stage"]}
    assert {r: s["blocks"] for r, s in stages.items()} == {0: 2, 1: 1}
    first, last = run.stage_records[0], run.stage_records[1]
    # stage 0: layers 0 (dense MLP) and 1 (MoE) and the embedding; stage 1: layer 2 (MoE), the
    # final norm and the head
    assert first.totals["params"] == 2 * LAYER + DENSE_MLP + ROUTER + SHARED + EXPERTS_LAYER + EMBED
    assert last.totals["params"] == LAYER + ROUTER + SHARED + EXPERTS_LAYER + HEAD + 64
    assert any(n.startswith("experts: 1 mixture-of-experts layers") for n in first.meta["audit"]["plan"])
    assert any(n.startswith("experts: 1 mixture-of-experts layers") for n in last.meta["audit"]["plan"])
    # 2 micro-batches (the spec's inputs each) x 3 x forward
    assert stages[0]["flops"]["total"] == 2 * 3 * (2 * ATTN_FLOPS + 3_145_728 + MOE_FLOPS)
    assert stages[1]["flops"]["total"] == 2 * 3 * (ATTN_FLOPS + MOE_FLOPS + HEAD_FLOPS)


def test_context_parallel_gathers_keys_and_values_at_their_widths(dsv3):
    rec = audit(dsv3, "cp=2").record
    assert rec.totals["flops"]["total"] == FLOPS // 2           # half the queries, half the tokens
    gathered = [c for c in rec.collectives if c["op"] == "all_gather"
                and (c["module"] or "").endswith("self_attn") and c["phase"] == "forward"]
    # per layer K (2 x 4 heads x 16 positions x 24) and V (x 12) in fp32: 12,288 + 6,144 B
    assert sum(c["bytes"] for c in gathered) == 3 * (12_288 + 6_144)


def test_full_checkpointing_recomputes_without_a_cache(dsv3):
    rec = audit(dsv3, "ep=2", checkpointing="full", precision="bf16-mixed").record
    # the recomputed forward dispatches and combines again: 6 a MoE layer, bf16 rows
    a2a = _all_to_all(rec)
    assert sum(c["count"] for c in a2a) == 2 * 6
    assert {c["bytes"] // c["count"] for c in a2a} == {A2A_BYTES // 2}
    assert any("use_cache=False" in n for n in rec.meta["audit"]["plan"])


@pytest.mark.parametrize("mode", ["selective-op", "selective-layer", "selective-attention"])
def test_selective_checkpointing_runs(dsv3, mode):
    rec = audit(dsv3, "ep=2", checkpointing=mode, precision="bf16-mixed").record
    assert rec.totals["flops"]["total"] == FLOPS
    assert any(n.startswith(f"checkpointing {mode}") for n in rec.meta["audit"]["plan"])


# Under tp=2 (no sequence parallelism on Hugging Face decoders) latent attention is split by heads:
# q_b_proj and kv_b_proj column-parallel (1,152 and 896 a rank), o_proj row-parallel (1,536);
# q_a_proj, kv_a_proj_with_mqa (1,536 each) and their norms (24, 16) whole: 6,696 + norms 128 a
# layer. Layer 0's MLP 24,576 / 2, the shared experts 6,144 / 2, routers 512 whole, embedding, head
# and final norm 65,600 whole; the routed experts whole on every tp rank, FSDP-sharded over tp.
TP_DENSE = 3 * (6_696 + 128) + DENSE_MLP // 2 + 2 * (ROUTER + SHARED // 2) + EMBED + HEAD + 64      # 105,528
# FLOPs: the split projections (1,152 + 896 + 1,536) and scores halved, q_a/kv_a (2 x 1,536) whole:
# 2 x 64 x 6,656 + 589,824 / 2 a layer; MLP, shared experts and routed tokens halved, router and
# head whole.
TP_FLOPS = 3 * (3 * (2 * 64 * 6_656 + 589_824 // 2) + 3_145_728 // 2
                + 2 * (65_536 + 786_432 // 2 + 1_572_864 // 2) + HEAD_FLOPS)        # 35,094,528


@pytest.mark.parametrize("mesh, param_bytes", [
    ("tp=2", (TP_DENSE + EXPERTS // 2) * 4),                     # 618,720 B
    ("ep=2,tp=2", (TP_DENSE // 2 + EXPERTS // 2 // 2) * 4)])     # dense over ep; 4 experts over tp
def test_tensor_parallel_splits_latent_attention_by_heads(dsv3, mesh, param_bytes):
    rec = audit(dsv3, mesh).record
    assert rec.totals["param_bytes"] == param_bytes
    assert rec.totals["flops"]["total"] == TP_FLOPS == 35_094_528
    attn = {(c["op"], c["phase"], c["module"].rsplit(".", 1)[-1], c["bytes"] // c["count"])
            for c in rec.collectives if "layers.1.self_attn" in (c["module"] or "")}
    # forward: o_proj's partial sums all-reduced, 64 tokens x 64 x 4 B; backward: the gradients of
    # q_b_proj's input (64 x 24 x 4 B) and kv_b_proj's (64 x 16 x 4 B) all-reduced by
    # ColwiseParallel, and the rotary key's (64 x 8 x 4 B), shared by the rank's heads only
    assert attn == {("all_reduce", "forward", "self_attn", 16_384), ("all_reduce", "backward", "q_b_proj", 6_144),
                    ("all_reduce", "backward", "kv_b_proj", 4_096), ("all_reduce", "backward", "self_attn", 2_048)}
    assert any(n.startswith("tp=2: latent attention") for n in rec.meta["audit"]["plan"])


def test_cli_expert_parallel_prices_a_step(dsv3, tmp_path):
    out = tmp_path / "out.json"
    result = CliRunner().invoke(cli, ["audit", dsv3, "--world-size", "4", "--mesh", "ep=4", "--gpu", "h100",
                                      "--precision", "bf16-mixed", "--format", "json", "--output", str(out)])
    assert result.exit_code in (0, 1), result.output
    rec = json.loads(out.read_text())
    assert rec["predictions"]["step_time"]["seconds"] > 0
    # 2 of the 8 routed experts a rank: 98,304 / 4 params
    assert rec["totals"]["params"] == DENSE + EXPERTS // 4
    assert {c["bytes"] // c["count"] for c in rec["collectives"] if c["op"] == "all_to_all"} == {A2A_BYTES // 2}


# DeepSeek-V2 small, its query one projection (q_lora_rank None: q_proj 64 x 4 x 24 = 6,144) and
# greedy top-2: attention 6,144 + 1,536 + 16 + 1,792 + 3,072 = 12,560, norms 128 a layer; the rest
# as DSV3 above. Projections 2 x 64 x 12,544 = 1,605,632 FLOPs a layer forward.
DSV2 = ("DeepseekV2Config(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, "
        "num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4, n_routed_experts=8, "
        "num_experts_per_tok=2, n_shared_experts=1, topk_method='greedy', q_lora_rank=None, kv_lora_rank=16, "
        "qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, max_position_embeddings=128, "
        "tie_word_embeddings=False)")


def test_deepseek_v2_by_hand(tmp_path):
    if not hasattr(transformers, "DeepseekV2Config"):
        pytest.skip("transformers without DeepSeek-V2")
    p = tmp_path / "dsv2.py"
    p.write_text(textwrap.dedent(SPEC.format(config=DSV2)))
    rec = audit(str(p), "ep=2").record
    dense = DENSE + 3 * (12_688 - LAYER)                                     # 141,552
    assert rec.totals["params"] == dense + EXPERTS // 2
    assert rec.totals["param_bytes"] == (dense // 2 + EXPERTS // 2) * 4
    assert sum(c["count"] for c in _all_to_all(rec)) == 2 * 4
    attn = 2 * 64 * 12_544 + 589_824
    assert rec.totals["flops"]["total"] == 3 * (3 * attn + 3_145_728 + 2 * MOE_FLOPS + HEAD_FLOPS)


@pytest.mark.parametrize("mesh, sq", [("ep=2", 32), ("cp=2", 16)])
def test_latent_attention_runs_the_fused_kernel(dsv3, mesh, sq):
    """q/k head dim 24 and v head dim 12: CPU's SDPA would take its math path (the 2 x 4 x 32 x 32
    scores materialised and priced as memory-bound ops); the plan runs the memory-efficient
    kernel a GPU runs, its signature with both head dims, causal by its flag."""
    rec = audit(dsv3, mesh).record
    rows = [o for o in rec.ops if o["module"] == "model.layers.0.self_attn" and o["kind"] == "attention"]
    assert rows and all("efficient_attention" in o["op"] for o in rows)
    shapes = {(tuple(s["attn"]), s.get("causal")) for o in rows for s in o.get("shapes", ())}
    assert shapes == {((2, 4, sq, 32, 24, 12), True)}
    assert not any("math path" in o["op"] for o in rec.ops)


# DeepSeek-V3 at full width (its config's defaults: d 7,168, 128 heads, q_lora_rank 1,536,
# kv_lora_rank 512, q/k head dim 128 + 64, v 128, dense MLP 18,432, 256 routed experts of 2,048,
# top-8, one shared expert, vocabulary 129,280), 4 layers of which 3 dense, 4,096 tokens.
DSV3_WIDE = ("DeepseekV3Config(num_hidden_layers=4, first_k_dense_replace=3, max_position_embeddings=4096, "
             "tie_word_embeddings=False)")


@pytest.mark.slow
def test_full_width_layers_by_hand(tmp_path):
    p = tmp_path / "dsv3_wide.py"
    p.write_text(textwrap.dedent(SPEC.format(config=DSV3_WIDE).replace("(2, 32)", "(1, 4096)")
                                 .replace("tokens=64, seq_len=32", "tokens=4096, seq_len=4096")))
    out = tmp_path / "out.json"
    result = CliRunner().invoke(cli, ["audit", str(p), "--world-size", "8", "--mesh", "ep=8", "--gpu", "h100",
                                      "--checkpointing", "full", "--precision", "bf16-mixed", "--format", "json",
                                      "--fail-on", "never", "--output", str(out)])
    assert result.exit_code == 0, result.output
    rec = json.loads(out.read_text())
    # a layer's attention: q_a 7,168 x 1,536 = 11,010,048, q_b 1,536 x 128 x 192 = 37,748,736,
    # kv_a 7,168 x 576 = 4,128,768, kv_b 512 x 128 x 256 = 16,777,216, o 128 x 128 x 7,168 =
    # 117,440,512 (187,105,280), its norms 1,536 + 512 + 2 x 7,168: 187,121,664
    attn = 187_105_280
    dense = 4 * (attn + 2_048 + 14_336) + 3 * 3 * 7_168 * 18_432 + 256 * 7_168 + 3 * 7_168 * 2_048 \
        + 2 * 129_280 * 7_168 + 7_168                                          # 3,836,812,288
    routed = 256 * 3 * 7_168 * 2_048                                           # 11,274,289,152
    assert rec["totals"]["params"] == dense + routed // 8                      # 32 experts a rank
    assert rec["totals"]["param_bytes"] == (dense // 8 + routed // 8) * 4
    # forward FLOPs, N = 4,096: projections 2 N x 187,105,280 and scores 2 x 128 x N^2 x (192 + 128)
    # a layer; dense MLPs 2 N x 3 x 7,168 x 18,432; router, shared expert 2 N x (256 + 3 x 2,048) x
    # 7,168; routed 2 x N x 8 x 7,168 x 2,048 x 3; head 2 N x 7,168 x 129,280
    N = 4_096
    fwd = 4 * (2 * N * attn + 2 * 128 * N * N * 320) + 3 * 2 * N * 3 * 7_168 * 18_432 \
        + 2 * N * (256 + 3 * 2_048) * 7_168 + 2 * N * 8 * 7_168 * 2_048 * 3 + 2 * N * 7_168 * 129_280
    assert rec["totals"]["flops"]["total"] == 3 * fwd == 96_668_976_414_720
    # all-to-all: N x 8 rows of 7,168 in bf16 = 469,762,048 B; 6 (full checkpointing)
    a2a = [c for c in rec["collectives"] if c["op"] == "all_to_all"]
    assert {c["bytes"] // c["count"] for c in a2a} == {469_762_048} and sum(c["count"] for c in a2a) == 6
    attn_shapes = {tuple(s["attn"]) for o in rec["ops"] if o["kind"] == "attention" for s in o.get("shapes", ())}
    assert attn_shapes == {(1, 128, 4096, 4096, 192, 128)}
    assert 0 < rec["predictions"]["step_time"]["seconds"] < 1.0               # 0.38 s; the math path 1.50 s


def test_without_a_plan_the_error_names_deepseek(dsv3):
    """transformers' grouped_mm takes only bf16 on fake tensors: the one line says the standard
    plan runs DeepSeek's experts (--precision fp32 applies it)."""
    result = CliRunner().invoke(cli, ["audit", dsv3, "--steps", "1"])
    assert result.exit_code == 2 and "DeepSeek-V2/V3" in result.output, result.output


@pytest.mark.slow
def test_full_deepseek_v3_pipelined_with_expert_parallel(tmp_path):
    """All 61 layers (3 dense), 2,048 ranks as DeepSeek-V3 trained (pp=16, ep=64, dp=2), 120
    micro-batches of 4,096 tokens: each distinct stage traced (about 30 s)."""
    p = tmp_path / "dsv3_full.py"
    p.write_text(textwrap.dedent(SPEC.format(config="DeepseekV3Config(max_position_embeddings=4096, "
                                                    "tie_word_embeddings=False)")
                                 .replace("(2, 32)", "(1, 4096)").replace("tokens=64, seq_len=32",
                                                                          "tokens=4096, seq_len=4096")))
    out = tmp_path / "out.json"
    result = CliRunner().invoke(cli, ["audit", str(p), "--world-size", "2048", "--mesh", "pp=16,dp=2,ep=64",
                                      "--micro-batches", "120", "--gpu", "h100", "--precision", "bf16-mixed",
                                      "--format", "json", "--fail-on", "never", "--output", str(out)])
    assert result.exit_code == 0, result.output
    rec = json.loads(out.read_text())
    stages = rec["totals"]["pipeline"]["per_stage"]
    # 61 blocks over 16 stages, 13 of 4 then 3 of 3; the 4 distinct stages traced: 0 (embedding,
    # the 3 dense layers and one MoE), 1-12 (4 MoE layers), 13-14 (3), 15 (3 and the head)
    assert [s["blocks"] for s in stages] == [4, 4, 3, 3] and rec["totals"]["pipeline"]["ranks_traced"] == 4
    # the bounding stage (1): 4 MoE layers of attention 187,121,664, router 1,835,008, shared
    # expert 44,040,192 and 4 of the 256 routed experts (256 x 44,040,192 / 64 = 176,160,768)
    assert rec["totals"]["params"] == 4 * (187_121_664 + 1_835_008 + 44_040_192 + 176_160_768)
    assert rec["predictions"]["step_time"]["seconds"] > 0
