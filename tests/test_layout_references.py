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
    # the bounding stage is rank 1 (it holds its logits for both micro-batches): blocks 2 and 3
    # (2 x 50,176 matmul params), the final norm and the head (512 x 64 = 32,768); 2
    # micro-batches (pp) of 2 x 64 tokens = 256. 6ND = 6 x 133,120 x 256 = 204,472,320;
    # attention 6 x 2 layers x 128 keys x 128 x 256 tokens = 50,331,648
    assert rec["totals"]["pipeline"]["bounding_rank"] == 1 and rec["totals"]["tokens"] == 256
    assert rec["totals"]["flops"]["total"] == 204_472_320 + 50_331_648
    row = _row(rec, "training FLOPs vs 6ND + 12LTd")
    assert row["predicted"] == 254_803_968 and row["ratio"] == 1.0
    assert "TL-CMP-001" not in _codes(rec)
    # comm: FSDP2 over cp = 2 for the stage's (2 x 50,304 + 64 + 32,768) x 4 = 533,760 B
    # (gathered once, kept: pipelined), 266,880 + reduce-scatter 533,760 = 800,640; K and V
    # per layer and micro-batch: 128 local tokens x 4 KV heads x 16 x 4 B = 32,768 B each
    # all-gathered, 65,536 B each reduce-scattered: 196,608 x 2 layers x 2 micro-batches =
    # 786,432. The p2p (65,536 B) is the stage's, beside
    comm = next(f for f in rec["findings"] if f["rule"] == "TL-COMM-001")
    assert comm["measured"] == comm["expected"] == 800_640 + 786_432
    assert "the pipeline's sends and receives" in comm["hint"] and "65,536 B in 4 calls" in comm["hint"]
    assert "TL-COMM-002" not in _codes(rec)


# MoE-tiny (tests/test_layouts.py's) with a batch of 8 x 64: d 64, 2 layers, 4 SwiGLU experts
# of width 32, top-2, capacity factor 1; dense 99,136 params, each expert 3 x 64 x 32 = 6,144.
MOE_8x64 = """
    import torch, torchledger
    from torchledger.models import build_model
    from torchledger.models.moe import MoEConfig

    def audit_spec():
        cfg = MoEConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4, d_ff=32, mlp="swiglu",
                        norm="rmsnorm", bias=False, tie_embeddings=False, n_experts=4, top_k=2,
                        capacity_factor=1.0, name="moe-tiny")
        idx = torch.randint(0, 512, (8, 64))
        return torchledger.AuditSpec(build_model(cfg), {"idx": idx, "targets": idx})
"""


def test_expert_parallel_all_to_alls_are_in_the_closed_form(tmp_path):
    code, rec = audit_json(tmp_path, MOE_8x64, "--mesh", "dp=2,ep=2")
    # EP: capacity C = ceil(1.0 x 512 tokens x 2 / 4) = 256; the dispatch buffer 4 x 256 x 64
    # fp32 = 262,144 B, all-to-all'd 4 times per layer (dispatch, combine, their backwards):
    # 8 x 262,144 = 2,097,152 B.
    # FSDP2 over dp x ep = 4 for the dense 99,136 params (396,544 B): all-gather 99,136 in
    # forward and again in backward, reduce-scatter 396,544: 594,816. The experts this rank
    # holds (2 of 4 per layer: 24,576 params, 98,304 B) shard over dp = 2: 49,152 + 49,152 +
    # 98,304 = 196,608. In all 2,097,152 + 594,816 + 196,608 = 2,888,576 (3.89x FSDP2's alone)
    a2a = sum(c["bytes"] for c in rec["collectives"] if c["op"] == "all_to_all")
    assert a2a == 8 * 262_144
    comm = next(f for f in rec["findings"] if f["rule"] == "TL-COMM-001")
    assert comm["measured"] == comm["expected"] == 2_888_576
    assert "FSDP2 + EP all-to-alls (1.000x)" in comm["message"]
    assert "TL-COMM-002" not in _codes(rec) and code == 0


def test_context_parallel_k_v_collectives_are_in_the_closed_form(tmp_path):
    body = TINY_128.replace("(2, 128)", "(2, 512)")
    code, rec = audit_json(tmp_path, body, "--mesh", "cp=2")
    # FSDP2 over the 2 cp ranks, 166,208 fp32 params = 664,832 B: all-gather 332,416 in forward
    # and again in backward, reduce-scatter 664,832: 1,329,664. K and V: this rank's 2 x 256
    # tokens x 4 KV heads x 16 x 4 B = 131,072 B each all-gathered per layer (4 x: 524,288),
    # their gradients over all 512 positions, 262,144 B each, reduce-scattered (4 x: 1,048,576).
    # In all 2,902,528 (2.18x FSDP2's alone: TL-COMM-002 before)
    comm = next(f for f in rec["findings"] if f["rule"] == "TL-COMM-001")
    assert comm["measured"] == comm["expected"] == 1_329_664 + 524_288 + 1_048_576
    assert "FSDP2 + CP K/V (1.000x)" in comm["message"]
    assert not _codes(rec) & {"TL-COMM-002", "TL-CMP-001"} and code == 0


HF_LLAMA_GQA = """
    import torch, torchledger
    from transformers import LlamaConfig, LlamaForCausalLM

    def audit_spec():
        cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                          attn_implementation="sdpa")
        idx = torch.randint(0, 512, (2, 512))
        return torchledger.AuditSpec(LlamaForCausalLM(cfg), {"input_ids": idx, "labels": idx})
"""


def _blocks_activation_bytes(rec):
    return sum(r["activation_bytes"] for r in rec.modules
               if r["name"] in ("blocks.0", "blocks.1", "model.layers.0", "model.layers.1"))


@pytest.mark.parametrize("body, kv_heads", [(TINY_128.replace("(2, 128)", "(2, {T})"), 4),
                                            (HF_LLAMA_GQA.replace("(2, 512)", "(2, {T})"), 2)],
                         ids=["llama-tiny", "hf-llama-gqa"])
def test_context_parallel_saves_no_mask(tmp_path, body, kv_heads):
    if "transformers" in body:
        pytest.importorskip("transformers")
    from torchledger.audit.engine import run_audit
    full, part = tmp_path / "full.py", tmp_path / "part.py"
    full.write_text(textwrap.dedent(body.replace("{T}", "512")))
    part.write_text(textwrap.dedent(body.replace("{T}", "128")))
    cp4 = run_audit(str(full), steps=1, mesh="cp=4").record
    plain = run_audit(str(part), steps=1).record          # one rank's 128 positions, no cp
    # a cp rank saves what a plain step at T/cp = 128 saves, except that SDPA keeps the
    # all-gathered K and V (512 positions, not 128): per layer 2 x (2 x kv_heads x 384 x 16 x
    # 4 B). No [128, 512] mask (an fp32 additive one: 262,144 B a layer), no K/V expanded to
    # the 4 query heads (Hugging Face did that whenever a mask was passed)
    gathered = 2 * 2 * (2 * kv_heads * 384 * 16 * 4)
    assert _blocks_activation_bytes(cp4) == _blocks_activation_bytes(plain) + gathered
    # the kernel's causal flag: 128 queries x 512 keys dense, half of them causal
    attn = cp4.totals["attention_flops"]
    assert attn["dense"] == 3 * 2 * (2 * 4 * 128 * 512) * 32 * 2            # fwd + bwd, 2 layers
    assert attn["causal"] == attn["dense"] // 2
