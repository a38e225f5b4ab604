"""Hugging Face models built from configs (no download): counts against published numbers."""
from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from torchledger.cli import cli

transformers = pytest.importorskip("transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def audit_json(path, *extra):
    r = CliRunner().invoke(cli, ["audit", path, "--steps", "1", "--format", "json", *extra],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_hf_gpt2_small_matches_palm_count():
    d = audit_json(os.path.join(ROOT, "examples", "hf_gpt2.py"))
    t = d["totals"]
    assert t["params"] == 124_439_808
    L, T, dm = 12, 1024, 768
    N = t["matmul_params"]
    assert N == 12 * 12 * 768 ** 2 + 50257 * 768        # every Linear/Conv1D weight + the tied head
    # PaLM: 6N + 12*L*T*d FLOPs per token, N including the tied LM head
    assert t["flops"]["total"] == t["tokens"] * (6 * N + 12 * L * T * dm)
    assert t["attention_flops"]["dense"] == t["tokens"] * 12 * L * T * dm
    assert [f["rule"] for f in d["findings"] if f["severity"] != "info"] == []


def test_hf_llama_small_config(tmp_path):
    path = tmp_path / "llama.py"
    path.write_text(
        "import torch, torchledger\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "def audit_spec():\n"
        "    cfg = LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=352,\n"
        "                      num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,\n"
        "                      tie_word_embeddings=False, attn_implementation='sdpa')\n"
        "    ids = torch.randint(0, 1000, (2, 64))\n"
        "    return torchledger.AuditSpec(LlamaForCausalLM(cfg), {'input_ids': ids, 'labels': ids})\n")
    d = audit_json(str(path))
    t, p = d["totals"], d["predictions"]
    d_kv = 2 * 16
    per_layer = 2 * 128 * 128 + 2 * 128 * d_kv + 3 * 128 * 352
    assert t["params"] == p["params_exact"] == 2 * (per_layer + 2 * 128) + 128 + 2 * 1000 * 128
    assert t["matmul_params"] == 2 * per_layer + 1000 * 128
    assert t["flops"]["total"] == p["flops_6nd_attention"] == 6 * t["matmul_params"] * 128 + 12 * 2 * 64 * 128 * 128


def _llama_file(tmp_path, use_cache):
    # 230,016 parameters: 20 B each at the optimizer step on a GPU (weights, gradients, two
    # moments, the foreach path's sqrt list) = 4.6 MB, of which the 64 KiB cache is 1.4%
    path = tmp_path / f"llama_cache_{use_cache}.py"
    path.write_text(
        "import torch, torchledger\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "def audit_spec():\n"
        "    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=128,\n"
        "                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,\n"
        f"                      tie_word_embeddings=True, attn_implementation='sdpa', use_cache={use_cache})\n"
        "    ids = torch.randint(0, 256, (1, 64))\n"
        "    return torchledger.AuditSpec(LlamaForCausalLM(cfg), {'input_ids': ids, 'labels': ids})\n")
    return str(path)


def test_hf_kv_cache_in_training_is_measured_and_flagged(tmp_path):
    """HF's default use_cache=True returns every layer's K/V from a training forward."""
    d = audit_json(_llama_file(tmp_path, True))
    cache = d["memory"]["output_cache"]
    kv = 2 * 2 * 1 * 2 * 64 * 32 * 4    # layers 2 x (k, v) x batch 1 x kv heads 2 x T 64 x head dim 32 x fp32
    assert cache["bytes"] == kv == 65_536 and cache["tensors"] == 4
    assert cache["bytes_at_optimizer"] == kv
    (f,) = [f for f in d["findings"] if f["rule"] == "TL-MEM-001"]
    assert d["totals"]["peak_phase"] == "optimizer" and f["severity"] == "warning"
    assert f["measured"] == kv
    off = audit_json(_llama_file(tmp_path, False))
    assert "output_cache" not in off["memory"]
    assert not [f for f in off["findings"] if f["rule"] == "TL-MEM-001"]
    assert d["totals"]["peak_bytes"] - off["totals"]["peak_bytes"] == kv   # exactly what it costs
