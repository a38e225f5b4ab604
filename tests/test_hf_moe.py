"""Hugging Face mixture-of-experts decoders (transformers 5.x Qwen3-MoE, Mixtral) under the
standard plan with expert parallelism (issue 29, item 7), checked by hand on small configs at
``--mesh ep=2`` and ``ep=2,dp=2``, and the published Qwen3-30B-A3B run's command."""
from __future__ import annotations

import json
import textwrap

import click
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
transformers = pytest.importorskip("transformers")
if not dist.is_available():
    pytest.skip("torch built without torch.distributed", allow_module_level=True)
if not hasattr(transformers, "Qwen3MoeConfig"):
    pytest.skip("transformers without Qwen3-MoE", allow_module_level=True)

from click.testing import CliRunner  # noqa: E402

from torchledger.audit.engine import run_audit  # noqa: E402
from torchledger.cli import cli  # noqa: E402
from test_audit_cli import one_line_error  # noqa: E402

SPEC = """
    import torch, torchledger, transformers

    def audit_spec():
        cfg = transformers.{config}
        model = transformers.AutoModelForCausalLM.from_config(cfg)
        ids = torch.randint(0, cfg.vocab_size, ({batch}, {seq}))
        return torchledger.AuditSpec(model, {{"input_ids": ids, "labels": ids}}, tokens={batch} * {seq},
                                     seq_len={seq})
"""

# Qwen3-MoE small: V 512, d 64, L 2, h 4, kv 2, d_h 16, E 8 experts of width f 32, top-2; batch 2 x 32
# = N 64 tokens. Per layer: q, o 2 x 4,096 + k, v 2 x 2,048 = 12,288; q_norm, k_norm 2 x 16; two
# norms 128; router 8 x 64 = 512: dense 12,960. Experts 8 x 3 x 64 x 32 = 49,152 (gate_up (8, 64, 64),
# down (8, 64, 32)). Embedding, head 2 x 32,768, final norm 64.
QWEN3 = ("Qwen3MoeConfig(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, "
         "num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, "
         "num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], "
         "max_position_embeddings=128, tie_word_embeddings=False)")
QWEN3_DENSE = 2 * 12_960 + 2 * 32_768 + 64          # 91,520
QWEN3_EXPERTS = 2 * 49_152                         # 98,304
# Mixtral small: V 512, d 64, L 2, h 4, kv 2 (d_h 16), E 4 experts of width 32, top-2. Per layer:
# attention 12,288, router 4 x 64 = 256, norms 128: dense 12,672; experts 4 x 3 x 64 x 32 = 24,576.
MIXTRAL = ("MixtralConfig(vocab_size=512, hidden_size=64, intermediate_size=32, num_hidden_layers=2, "
           "num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, "
           "max_position_embeddings=128, tie_word_embeddings=False)")
MIXTRAL_DENSE = 2 * 12_672 + 2 * 32_768 + 64       # 90,944
MIXTRAL_EXPERTS = 2 * 24_576                       # 49,152

# Qwen2-MoE small, its first layer dense (mlp_only_layers=[0]): attention 12,288 + q/k/v biases 128,
# norms 128 per layer; layer 0's MLP 3 x 64 x 128 = 24,576; layer 1: router 512, a shared expert of
# width 48 (3 x 64 x 48 = 9,216) and its gate 64, 8 routed experts of width 32 (49,152).
QWEN2 = ("Qwen2MoeConfig(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, "
         "shared_expert_intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, "
         "num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[0], "
         "max_position_embeddings=128, tie_word_embeddings=False)")
QWEN2_DENSE = 2 * (12_416 + 128) + 24_576 + 512 + 9_216 + 64 + 2 * 32_768 + 64     # 125,056
QWEN2_EXPERTS = 49_152

# GPT-OSS small (router ``router``, experts transposed with biases, its own clamped gate): q, o
# 4,096 + 64 bias each, k, v 2,048 + 32 each: 12,480; sinks 4; norms 128; router 8 x 64 + 8 = 520:
# dense 13,132 a layer. Experts gate_up (8, 64, 64) + bias 8 x 64, down (8, 32, 64) + bias 8 x 64:
# 50,176 a layer.
GPT_OSS = ("GptOssConfig(vocab_size=512, hidden_size=64, intermediate_size=32, num_hidden_layers=2, "
           "num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8, "
           "num_experts_per_tok=2, sliding_window=16, max_position_embeddings=128, tie_word_embeddings=False)")
GPT_OSS_DENSE = 2 * 13_132 + 2 * 32_768 + 64      # 91,864
GPT_OSS_EXPERTS = 2 * 50_176                      # 100,352

# Matmul FLOPs of one step, N = 64 tokens, forward per layer: attention projections 2 x 64 x 12,288
# = 1,572,864; scores and values 2 x (2 x B 2 x h 4 x T 32 x T 32 x d_h 16) = 524,288; router
# 2 x 64 x E d; experts 2 x rows (N x k = 128) x d 64 x f 32 x 3 (gate, up, down) = 1,572,864.
# Head 2 x 64 x 64 x 512 = 4,194,304. Backward twice the forward.
EXPERT_FLOPS = 2 * 128 * 64 * 32 * 3


def _forward_flops(router_params):
    return 2 * (1_572_864 + 524_288 + 2 * 64 * router_params + EXPERT_FLOPS) + 4_194_304


QWEN3_FLOPS = 3 * _forward_flops(512)             # 3 x 11,665,408 = 34,996,224
MIXTRAL_FLOPS = 3 * _forward_flops(256)           # 3 x 11,599,872 = 34,799,616
# All-to-all: every rank sends its N x k = 128 routed rows of d = 64 (balanced routing), 4 B each
# in fp32 = 32,768 B; per MoE layer dispatch and combine in forward, their transposes in backward.
A2A_BYTES = 64 * 2 * 64 * 4


def _spec(tmp_path_factory, name, config, batch=2, seq=32):
    p = tmp_path_factory.mktemp("hf_moe") / f"{name}.py"
    p.write_text(textwrap.dedent(SPEC.format(config=config, batch=batch, seq=seq)))
    return str(p)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return _spec(tmp_path_factory, "qwen3moe", QWEN3)


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return _spec(tmp_path_factory, "mixtral", MIXTRAL)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    if not hasattr(transformers, "GptOssConfig"):
        pytest.skip("transformers without GPT-OSS")
    return _spec(tmp_path_factory, "gpt_oss", GPT_OSS)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return _spec(tmp_path_factory, "qwen2moe", QWEN2)


def audit(path, mesh, **plan):
    run = run_audit(path, steps=1, mesh=mesh, plan=plan)
    assert not dist.is_initialized()
    return run.record


def _all_to_all(rec):
    return [c for c in rec.collectives if c["op"] == "all_to_all"]


@pytest.mark.parametrize("model, dense, experts, flops", [
    ("qwen3", QWEN3_DENSE, QWEN3_EXPERTS, QWEN3_FLOPS),
    ("mixtral", MIXTRAL_DENSE, MIXTRAL_EXPERTS, MIXTRAL_FLOPS),
    ("gpt_oss", GPT_OSS_DENSE, GPT_OSS_EXPERTS, QWEN3_FLOPS)])     # its router: 8 x 64 too
def test_expert_parallel_by_hand(request, model, dense, experts, flops):
    rec = audit(request.getfixturevalue(model), "ep=2")
    # each rank holds E/2 experts of every layer, whole; the dense weights FSDP-sharded over ep=2
    assert rec.totals["params"] == dense + experts // 2
    assert rec.totals["param_bytes"] == (dense // 2 + experts // 2) * 4
    a2a = _all_to_all(rec)
    assert sum(c["count"] for c in a2a) == 2 * 4                # 2 layers x (2 forward + 2 backward)
    assert {c["bytes"] // c["count"] for c in a2a} == {A2A_BYTES}
    assert {c["group_size"] for c in a2a} == {2}
    assert rec.totals["flops"]["total"] == flops                # balanced: the unsharded step's work
    notes = rec.meta["audit"]["plan"]
    assert any("balanced routing" in n for n in notes)
    assert any(n.startswith("ep=2: each rank holds") for n in notes)


@pytest.mark.parametrize("model, dense, experts", [
    ("qwen3", QWEN3_DENSE, QWEN3_EXPERTS), ("mixtral", MIXTRAL_DENSE, MIXTRAL_EXPERTS)])
def test_expert_parallel_with_fsdp(request, model, dense, experts):
    rec = audit(request.getfixturevalue(model), "ep=2,dp=2", precision="bf16-mixed")
    # E/2 experts per rank sharded over dp=2 (E/4 of them in bytes); dense over dp x ep = 4
    assert rec.totals["param_bytes"] == (dense // 4 + experts // 4) * 4
    a2a = _all_to_all(rec)
    assert {c["bytes"] // c["count"] for c in a2a} == {A2A_BYTES // 2}    # bf16 rows
    assert {c["group_size"] for c in a2a} == {2}
    reduced = [c for c in rec.collectives if c["op"] == "reduce_scatter"
               and (c["module"] or "").endswith("mlp.experts")]
    assert reduced and {c["group_size"] for c in reduced} == {2}          # expert grads over dp


def test_qwen2_moe_shared_expert_and_dense_layer(qwen2):
    rec = audit(qwen2, "ep=2")
    assert rec.totals["params"] == QWEN2_DENSE + QWEN2_EXPERTS // 2           # 149,632
    # the shared expert's gate (1, 64) does not split over 2 ranks: FSDP2 pads its dim 0 and
    # rank 0 keeps all 64 (32 more than half): 128 B
    assert rec.totals["param_bytes"] == (QWEN2_DENSE // 2 + QWEN2_EXPERTS // 2) * 4 + 128
    a2a = _all_to_all(rec)
    assert sum(c["count"] for c in a2a) == 4                    # one MoE layer
    assert {c["bytes"] // c["count"] for c in a2a} == {A2A_BYTES}


@pytest.mark.slow
def test_pipeline_with_expert_parallel(qwen2):
    # the last stage holds layer 1 (the MoE layer): 22,336 dense + head 32,768 + norm 64, and
    # 4 of its 8 experts (24,576); stage 0 holds the dense layer 0 (ep: only data parallel)
    rec = audit(qwen2, "pp=2,ep=2")
    assert rec.totals["params"] == 12_416 + 128 + 512 + 9_216 + 64 + 32_768 + 64 + QWEN2_EXPERTS // 2
    assert {c["bytes"] // c["count"] for c in _all_to_all(rec)} == {A2A_BYTES}


def test_fp32_on_fake_tensors_under_the_plan(qwen3):
    """transformers' grouped_mm takes only bf16 on fake tensors: the plan's expert forward runs
    fp32 (--precision fp32 alone applies the standard plan), at the grouped GEMM's FLOPs."""
    rec = audit(qwen3, None, precision="fp32")
    assert rec.totals["flops"]["total"] == QWEN3_FLOPS
    assert rec.meta["audit"]["plan"][0].startswith("experts: 2 mixture-of-experts layers")


@pytest.mark.parametrize("mesh, expert_ops", [
    # no dp: each rank's 4 experts whole (24,576 params a layer), their fp32 gradients all-reduced
    # over the 2 replicas: 98,304 B a layer
    ("dp_replicate=2,ep=2", {("all_reduce", 2, 98_304)}),
    # HSDP: reduce-scattered over dp=2 (98,304 B in), the half all-reduced over the replicas
    ("dp_replicate=2,dp=2,ep=2", {("reduce_scatter", 2, 98_304), ("all_reduce", 2, 49_152)})])
def test_expert_gradients_reduce_over_replicas(qwen3, mesh, expert_ops):
    rec = audit(qwen3, mesh)
    grads = {(c["op"], c["group_size"], c["bytes"] // c["count"]) for c in rec.collectives
             if (c["module"] or "").endswith("mlp.experts") and c["op"] in ("all_reduce", "reduce_scatter")}
    assert grads == expert_ops


def test_fp32_experts_under_bf16_hold_no_bf16_copy(qwen3):
    """ep alone: each rank's experts stay outside FSDP2 in fp32 and are cast for the matmuls;
    the casts are made again in backward, not saved: the same activations as when FSDP2 manages
    them (ep=2,dp=2), 98,304 B less than keeping each layer's bf16 copy (2 x 24,576 x 2 B)."""
    alone = audit(qwen3, "ep=2", precision="bf16-mixed")
    managed = audit(qwen3, "ep=2,dp=2", precision="bf16-mixed")
    assert alone.totals["activation_bytes"] == managed.totals["activation_bytes"]
    assert alone.totals["flops"]["total"] == QWEN3_FLOPS


def test_expert_parallel_with_context_parallel(qwen3):
    rec = audit(qwen3, "ep=2,cp=2")
    # dense over ep x cp = 4; each rank's 4 experts a layer sharded over cp=2 (cp ranks hold the
    # same experts and route other tokens to them)
    assert rec.totals["param_bytes"] == (QWEN3_DENSE // 4 + QWEN3_EXPERTS // 2 // 2) * 4
    # each rank routes its T/2 = 16 positions x 2 sequences: 32 x 2 x 64 x 4 B
    assert {c["bytes"] // c["count"] for c in _all_to_all(rec)} == {A2A_BYTES // 2}
    grads = {(c["group_size"], c["bytes"] // c["count"]) for c in rec.collectives
             if (c["module"] or "").endswith("mlp.experts") and c["op"] == "reduce_scatter"}
    assert grads == {(2, 98_304)}                              # 24,576 fp32 gradients a layer
    assert rec.totals["flops"]["total"] == QWEN3_FLOPS // 2    # half the queries, half the tokens


def test_full_checkpointing_dispatches_again_in_recompute(qwen3):
    rec = audit(qwen3, "ep=2", checkpointing="full", precision="bf16-mixed")
    # the recomputed forward dispatches and combines again: 6 per layer, bf16 rows (16,384 B)
    a2a = _all_to_all(rec)
    assert sum(c["count"] for c in a2a) == 2 * 6
    assert {c["bytes"] // c["count"] for c in a2a} == {A2A_BYTES // 2}


# Under tp (no sequence parallelism on HF decoders) attention is split by heads; each tp rank
# routes 32 of the 64 tokens to the experts (whole on every tp rank, FSDP-sharded over tp) and the
# outputs are all-gathered: 32 x 64 x 4 B = 8,192 B a layer. Per rank, per layer: attention
# 12,288 / 2 (q_norm, k_norm 32, norms 128, router 512 whole); embedding and head whole (no SP).
QWEN3_TP_DENSE = 2 * (12_288 // 2 + 32 + 128 + 512) + 2 * 32_768 + 64                  # 79,232
# FLOPs: attention projections, scores and experts halved; router and head whole
QWEN3_TP_FLOPS = 3 * (2 * (1_572_864 // 2 + 524_288 // 2 + 65_536 + EXPERT_FLOPS // 2) + 4_194_304)


@pytest.mark.parametrize("mesh, param_bytes, experts_grads", [
    # experts (98,304) sharded over tp=2; their gradients reduce-scattered over tp: 196,608 B a layer
    ("tp=2", (QWEN3_TP_DENSE + QWEN3_EXPERTS // 2) * 4, (2, 196_608)),
    # 4 of 8 experts a rank, sharded over tp=2; the dense weights FSDP over ep=2
    ("ep=2,tp=2", (QWEN3_TP_DENSE // 2 + QWEN3_EXPERTS // 2 // 2) * 4, (2, 98_304))])
def test_tensor_parallel_splits_the_routed_tokens(qwen3, mesh, param_bytes, experts_grads):
    rec = audit(qwen3, mesh)
    assert rec.totals["param_bytes"] == param_bytes
    assert rec.totals["flops"]["total"] == QWEN3_TP_FLOPS == 23_986_176
    experts = [c for c in rec.collectives if (c["module"] or "").endswith("mlp.experts")]
    gathered = {c["bytes"] // c["count"] for c in experts if c["op"] == "all_gather" and c["phase"] == "forward"}
    assert 8_192 in gathered                                   # the outputs of the 32 routed tokens
    assert {(c["group_size"], c["bytes"] // c["count"]) for c in experts
            if c["op"] == "reduce_scatter"} == {experts_grads}
    a2a = _all_to_all(rec)
    assert {c["bytes"] // c["count"] for c in a2a} == ({A2A_BYTES // 2} if "ep" in mesh else set())


def test_tensor_parallel_splits_the_shared_expert(qwen2):
    rec = audit(qwen2, "tp=2")
    # attention 12,416 / 2 a layer, layer 0's MLP 24,576 / 2, the shared expert 9,216 / 2 (column
    # and row parallel), norms 256, router 512 and the shared expert's gate 64 whole, embedding and
    # head 65,600 whole; the 8 routed experts (49,152) sharded over tp=2
    dense = 12_416 + 256 + 24_576 // 2 + 512 + 9_216 // 2 + 64 + 65_600
    assert rec.totals["param_bytes"] == (dense + QWEN2_EXPERTS // 2) * 4


def test_experts_that_do_not_divide_by_ep_is_one_line(mixtral):
    one_line_error(CliRunner().invoke(cli, ["audit", mixtral, "--mesh", "ep=8", "--steps", "1"]),
                   "4 experts", "ep=8")


# The published run (benchmarks/data/calibration-runs.json, am-qwen3-30b-a3b-bf16-h100-8): Qwen3-30B-A3B,
# 8 H100s, ep=8, 16 micro-batches of 4 x 4,096, full checkpointing, bf16-mixed.
QWEN3_30B = ("Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144, "
             "moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, "
             "head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, "
             "mlp_only_layers=[], max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6, "
             "tie_word_embeddings=False)")


@pytest.mark.slow
def test_published_qwen3_30b_a3b_command(tmp_path_factory, tmp_path):
    path = _spec(tmp_path_factory, "qwen3_30b", QWEN3_30B, batch=4, seq=4096)
    out = tmp_path / "out.json"
    args = ["audit", path, "--steps", "1", "--gpu", "h100", "--world-size", "8", "--mesh", "ep=8",
            "--micro-batches", "16", "--checkpointing", "full", "--precision", "bf16-mixed",
            "--format", "json", "--fail-on", "never", "--output", str(out)]
    if any(p.name == "kernels" for p in cli.get_command(click.Context(cli), "audit").params):
        args[-6:-6] = ["--kernels", "te"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code in (0, 1), result.output
    rec = json.loads(out.read_text())
    assert rec["predictions"]["step_time"]["seconds"] > 0
    # per layer: q, o 2 x 2,048 x 4,096, k, v 2 x 2,048 x 512 = 18,874,368; q/k norms 256; norms
    # 4,096; router 128 x 2,048 = 262,144: 19,140,864 x 48; embedding, head 2 x 151,936 x 2,048; norm
    # 2,048: 1,541,093,376 dense; experts per rank 48 layers x 16 of 128 x 3 x 2,048 x 768
    assert rec["totals"]["params"] == 1_541_093_376 + 3_623_878_656
    a2a = [c for c in rec["collectives"] if c["op"] == "all_to_all"]
    # 16,384 tokens x 8 x 2,048 x 2 B = 536,870,912 B each; 6 per layer (full checkpointing)
    assert {c["bytes"] // c["count"] for c in a2a} == {536_870_912}
    assert sum(c["count"] for c in a2a) == 48 * 6
