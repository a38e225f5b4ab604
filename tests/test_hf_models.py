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
