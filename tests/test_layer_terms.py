"""A layer's saved tensors by name (``formulas.activations.korthikanti_layer_terms`` and
``llama_block_terms``) against a traced Llama block, term by term: the block the 405B stage
runs (GQA at kv = a/16, SwiGLU at d_ff = 3.25d, RMSNorm, RoPE, flash attention, bf16 under
FSDP2's mixed precision), scaled to d 512, on fake tensors under the standard plan at
tp 4 with sequence parallelism and cp 2, and without either. Issue 30: what separates the
405B activation row (1.073x) from Korthikanti's formula."""
from __future__ import annotations

import textwrap
from fractions import Fraction

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch built without torch.distributed", allow_module_level=True)

from torchledger.analyzers.compare_layout import korthikanti_layer  # noqa: E402
from torchledger.audit.engine import run_audit  # noqa: E402
from torchledger.formulas.activations import (LAYER_TERMS, korthikanti_layer_terms,  # noqa: E402
                                               korthikanti_table2, llama_block_terms,
                                               pytorch_sp_layer_bytes)

# d 512, 32 heads of 16, 8 KV heads (a/16 as 405B's 128/8), d_ff 1,664 = 3.25 x 512; 1 x 128 tokens
SMALL = """
    import torch, torchledger
    from torchledger.models import build_model
    from torchledger.models.config import TransformerConfig

    CFG = TransformerConfig(vocab_size=512, d_model=512, n_layers=2, n_heads=32, n_kv_heads=8, d_ff=1664,
                            mlp="swiglu", norm="rmsnorm", bias=False, tie_embeddings=False, n_positions=0,
                            max_seq_len=128, rope_theta=500000.0, name="405b-shaped")

    def audit_spec():
        idx = torch.randint(0, CFG.vocab_size, (1, 128))
        return torchledger.AuditSpec(build_model(CFG), {"idx": idx, "targets": idx})
"""
D, HEADS, KV, FF, T, HEAD_DIM = 512, 32, 8, 1664, 128, 16


def _audit(tmp_path, mesh):
    path = tmp_path / "model.py"
    path.write_text(textwrap.dedent(SMALL))
    return run_audit(str(path), steps=1, mesh=mesh, plan={"precision": "bf16-mixed"}).record


def _rows(rec) -> dict:
    return {m["name"]: m["activation_bytes"] for m in rec.modules}


def _traced_terms(rows: dict, block: str) -> dict:
    """The block's module rows, grouped as the terms are: a tensor counts once, in the module
    that saved it first (the projections' shared input in q_proj and gate_proj; the kernel's
    output in the attention, before o_proj keeps it again)."""
    a, m = f"{block}.attn", f"{block}.mlp"
    return {"attn_norm": rows[f"{block}.attn_norm"], "attn_input": rows[f"{a}.q_proj"],
            "attention": rows[a] - rows[f"{a}.q_proj"] - rows[f"{a}.k_proj"] - rows[f"{a}.v_proj"] - rows[f"{a}.o_proj"],
            "mlp_norm": rows[f"{block}.mlp_norm"], "mlp_input": rows[f"{m}.gate_proj"],
            "mlp_down_input": rows[f"{m}.down_proj"],
            "mlp_inner": rows[m] - rows[f"{m}.gate_proj"] - rows[f"{m}.up_proj"] - rows[f"{m}.down_proj"]}


def _grouped(terms: dict) -> dict:
    return {"attn_norm": terms["attn_norm_input"] + terms["attn_norm_stats"], "attn_input": terms["attn_input"],
            "attention": terms["q"] + terms["k"] + terms["v"] + terms["attn_lse"] + terms["attn_out"],
            "mlp_norm": terms["mlp_norm_input"] + terms["mlp_norm_stats"], "mlp_input": terms["mlp_input"],
            "mlp_down_input": terms["mlp_down_input"],
            "mlp_inner": terms["mlp_act_input"] + terms["mlp_act_output"] + terms["mlp_up"]}


@pytest.mark.parametrize("mesh, tp, cp, s", [("dp=2,cp=2,tp=4", 4, 2, 64), ("dp=2", 1, 1, 128)],
                         ids=["tp4-sp-cp2", "fsdp-only"])
def test_traced_block_is_the_sum_of_its_terms(tmp_path, mesh, tp, cp, s):
    rec = _audit(tmp_path, mesh)
    terms = llama_block_terms(s, 1, D, HEADS, KV, FF, tp=tp, sp=tp > 1, cp=cp)
    assert all(terms[k] > 0 for k in LAYER_TERMS if k not in ("scores", "attn_dropout_mask", "mlp_dropout_mask"))
    rows = _rows(rec)
    # every group of terms equals its module rows in both blocks: a term changed by one byte fails
    for block in ("blocks.0", "blocks.1"):
        traced = _traced_terms(rows, block)
        rope = 2 * s * HEAD_DIM * 2 if block == "blocks.0" else 0
        traced["attention"] -= rope      # RoPE's cos and sin (s x 16 bf16): one pair for all layers
        assert traced == _grouped(terms)
        assert rows[block] == sum(terms.values()) + rope
    if tp > 1:
        # s 64, b 1, t 4 (sbh/t = 8,192 elements): norms 2 x 8,192 + rstd 16 x 4 = 16,448 each;
        # inputs 2 x 64 x 512 = 65,536 each; q 2 x 64 x 8 x 16 = 16,384, k and v 2 x 128 x 2 x 16
        # = 8,192 each (2 of the 8 KV heads, all 128 positions), lse 8 heads x 64 x 4 = 2,048,
        # out 16,384; the MLP's four 2 x 64 x 416 = 53,248: 428,160
        assert rows["blocks.1"] == 2 * 16_448 + 2 * 65_536 + 16_384 + 2 * 8_192 + 2_048 + 16_384 + 4 * 53_248 == 428_160


def test_ratio_to_korthikanti_is_the_ratio_of_the_term_sums(tmp_path):
    """The record's activation row (Korthikanti's layer, PyTorch's TP+SP row) is the sum of
    korthikanti_layer_terms; the traced block over it is the sum of llama_block_terms over
    that, and the difference is the named terms'."""
    rec = _audit(tmp_path, "dp=2,cp=2,tp=4")
    llama = llama_block_terms(64, 1, D, HEADS, KV, FF, tp=4, sp=True, cp=2)
    gpt = korthikanti_layer_terms(64, 1, D, HEADS, tp=4, sp=True, fused_attention=True)
    row = next(r for r in rec.predictions["comparisons"] if r["quantity"].startswith("activation bytes"))
    assert row["predicted"] == 2 * sum(gpt.values()) == 2 * korthikanti_layer(64, 1, D, HEADS, tp=4, sp=True, fused=True)
    block = _rows(rec)["blocks.1"]
    assert Fraction(block, sum(gpt.values())) == Fraction(sum(llama.values()), sum(gpt.values()))
    # sbh/t = 8,192: GPT 30/t + 4 sbh = 46 x 8,192 = 376,832; this block 428,160 (1.136x):
    # K and V at 8 of 32 heads over cp 2 positions: 2 x (8,192 - 16,384); no dropout masks
    # -2 x 8,192; SwiGLU's four 3.25d tensors for GELU's two 4d ones: 4 x 53,248 - 2 x 65,536;
    # rstd 2 x 64 and lse 2,048
    diff = {k: llama[k] - gpt[k] for k in LAYER_TERMS if llama[k] != gpt[k]}
    assert diff == {"attn_norm_stats": 64, "k": -8_192, "v": -8_192, "attn_lse": 2_048,
                    "attn_dropout_mask": -8_192, "mlp_norm_stats": 64, "mlp_act_input": 53_248 - 65_536,
                    "mlp_act_output": 53_248, "mlp_up": 53_248, "mlp_down_input": 53_248 - 65_536,
                    "mlp_dropout_mask": -8_192}
    assert sum(gpt.values()) + sum(diff.values()) == block == 428_160


@pytest.mark.parametrize("s, b, h, a, t", [(2, 1, 4, 2, 2), (2048, 2, 4096, 32, 8), (4096, 1, 16384, 128, 8)])
def test_korthikanti_terms_sum_to_table2_rows(s, b, h, a, t):
    for fused in (False, True):
        def total(**kw):
            return sum(korthikanti_layer_terms(s, b, h, a, fused_attention=fused, **kw).values())
        assert total() == korthikanti_table2(s, b, h, a, row="none", fused_attention=fused)
        assert total(tp=t) == korthikanti_table2(s, b, h, a, tp=t, row="tp", fused_attention=fused)
        assert total(tp=t, sp=True) == pytorch_sp_layer_bytes(s, b, h, a, tp=t, fused_attention=fused)
    # the paper's MLP, 19sbh (t 1): input 2, GELU's input 8 and output 8, dropout mask 1
    gpt = korthikanti_layer_terms(s, b, h, a)
    sbh = s * b * h
    assert gpt["mlp_input"] + gpt["mlp_act_input"] + gpt["mlp_down_input"] + gpt["mlp_dropout_mask"] == 19 * sbh


def test_405b_stage_layer_by_terms():
    """Llama-3.1-405B's layer on a rank of TP 8 x CP 2 (4,096 of 8,192 tokens, bf16):
    sbh/t = 4,096 x 16,384 / 8 = 8,388,608. Korthikanti (PyTorch's TP+SP, fused) 62 x 8,388,608
    = 520,093,696; this block 558,108,672, 1.0731x: SwiGLU's four 2 x 4,096 x 6,656 =
    54,525,952 for GELU's two 8 x 8,388,608 = 67,108,864 (+83,886,080); K and V at 8 of 128
    heads over 2 x 4,096 positions, 2,097,152 each for 16,777,216 (-29,360,128); no dropout
    masks (-16,777,216); rstd 2 x 2,048 and lse 4 x 4,096 x 16 = 262,144 (+266,240)."""
    llama = llama_block_terms(4096, 1, 16384, 128, 8, 53248, tp=8, sp=True, cp=2)
    gpt = korthikanti_layer_terms(4096, 1, 16384, 128, tp=8, sp=True, fused_attention=True)
    assert sum(gpt.values()) == 62 * 8_388_608 == 520_093_696
    assert sum(llama.values()) == 558_108_672
    mlp = ("mlp_act_input", "mlp_act_output", "mlp_up", "mlp_down_input")
    assert sum(llama[k] - gpt[k] for k in mlp) == 4 * 54_525_952 - 2 * 67_108_864 == 83_886_080
    assert llama["k"] + llama["v"] - gpt["k"] - gpt["v"] == 2 * (2_097_152 - 16_777_216)
    assert -(gpt["attn_dropout_mask"] + gpt["mlp_dropout_mask"]) == -16_777_216
    assert llama["attn_norm_stats"] + llama["mlp_norm_stats"] + llama["attn_lse"] == 266_240
    assert round(sum(llama.values()) / sum(gpt.values()), 4) == 1.0731


def test_bad_splits_are_one_line():
    with pytest.raises(ValueError, match="kv_heads must be a whole number >= 1 that 8 divides, got 4"):
        llama_block_terms(64, 1, 512, 32, 4, 1664, tp=8)
    with pytest.raises(ValueError, match="heads must be a whole number >= 1 that 3 divides"):
        korthikanti_layer_terms(64, 1, 512, 32, tp=3)


@pytest.mark.slow
def test_pipeline_stage_row_is_layers_in_flight_times_the_block(tmp_path):
    """The 405B stage's row in miniature: 8 such blocks over pp 2 x 2 virtual stages (chunks of
    2), 4 micro-batches, tp 4 + sp, cp 2. Rank 0 keeps chunk-micro-batches by its schedule
    (live_at_peak); each is 2 blocks (llama_block_terms) and RoPE's cos and sin for that chunk's
    forward (64 x 16 x 2 B each: 4,096), chunk 0's also the embedding's saved indices. The
    row's layers are the chunk-micro-batches x 2, so the activation bytes over Korthikanti's
    are the block's terms over Korthikanti's, but for the tables and the embedding."""
    path = tmp_path / "model.py"
    path.write_text(textwrap.dedent(SMALL).replace("n_layers=2", "n_layers=8"))
    rec = run_audit(str(path), steps=1, mesh="dp=2,cp=2,tp=4,pp=2",
                    plan={"precision": "bf16-mixed", "virtual_stages": 2, "micro_batches": 4}).record
    stage = next(s for s in rec.totals["pipeline"]["per_stage"] if s["rank"] == 0)
    block = sum(llama_block_terms(64, 1, D, HEADS, KV, FF, tp=4, sp=True, cp=2).values())
    rope, emb = 2 * 64 * HEAD_DIM * 2, _rows(rec)["tok_emb"]
    assert stage["chunk_micro_batch_bytes"] == {"0": 2 * block + rope + emb, "2": 2 * block + rope}
    live = stage["live_at_peak"]
    layers = 2 * sum(live.values())
    assert rec.meta["config"]["stage_layers_in_flight"] == layers
    assert rec.totals["activation_bytes"] == layers * block + sum(live.values()) * rope + live["0"] * emb
    row = next(r for r in rec.predictions["comparisons"] if r["quantity"].startswith("activation bytes"))
    assert row["predicted"] == layers * korthikanti_layer(64, 1, D, HEADS, tp=4, sp=True, fused=True)
