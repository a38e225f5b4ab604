"""Reference models vs the closed-form parameter count: the meta-built model is the oracle."""
import json

import pytest
import torch
from _optional_hypothesis import given, settings, st  # skipped without hypothesis
from click.testing import CliRunner

from torchledger.formulas import count_params
from torchledger.cli import cli
from torchledger.models import PRESETS, build_model, example_inputs
from torchledger.models.config import TransformerConfig


def meta_counts(cfg) -> tuple:
    """(sum of numel, weights of every Linear) of the model built on the meta device.

    parameters() yields a tied weight once, like the analyzer's total; the Linear weights
    (the tied LM head included, and the Cruncher's own ``Linear``) are its matmul N.
    """
    model = build_model(cfg, device="meta")
    total = sum(p.numel() for p in model.parameters())
    matmul = sum(m.weight.numel() for m in model.modules()
                 if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Linear")
    return total, matmul


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_counts_exactly(name):
    cfg = PRESETS[name]
    count = count_params(cfg)
    assert (count.total, count.matmul) == meta_counts(cfg)


def test_components_match_module_groups():
    model = build_model("llama-tiny", device="meta")
    by_name = {}
    for name, p in model.named_parameters():
        key = ("attention" if ".attn." in name else "mlp" if ".mlp." in name
               else "norms" if name.startswith("blocks.") else name.split(".")[0])
        by_name[key] = by_name.get(key, 0) + p.numel()
    b = count_params(PRESETS["llama-tiny"]).breakdown
    assert by_name == {"tok_emb": b["embeddings"], "attention": b["attention"],
                       "mlp": b["mlp"], "norms": b["norms"], "norm": b["final_norm"],
                       "lm_head": b["lm_head"]}


@st.composite
def configs(draw):
    kv = draw(st.integers(1, 3))
    heads = kv * draw(st.integers(1, 3))                 # GQA groups of 1..3
    d = heads * draw(st.integers(1, 6))
    mlp = draw(st.sampled_from(["gelu", "swiglu"]))
    return TransformerConfig(
        vocab_size=draw(st.integers(1, 301)), d_model=d, n_layers=draw(st.integers(1, 3)),
        n_heads=heads, n_kv_heads=kv, d_ff=draw(st.one_of(st.none(), st.integers(1, 40))),
        mlp=mlp, norm=draw(st.sampled_from(["layernorm", "rmsnorm"])),
        bias=draw(st.booleans()), tie_embeddings=draw(st.booleans()),
        n_positions=draw(st.sampled_from([0, 0, 1, 7, 33])))


def cli_flags(cfg: TransformerConfig) -> list:
    flags = ["--vocab", cfg.vocab_size, "--hidden", cfg.d_model, "--layers", cfg.n_layers,
             "--heads", cfg.n_heads, "--kv-heads", cfg.n_kv_heads, "--ffn", cfg.d_ff,
             "--mlp", cfg.mlp, "--norm", cfg.norm, "--positions", cfg.n_positions,
             "--bias" if cfg.bias else "--no-bias",
             "--tie-embeddings" if cfg.tie_embeddings else "--no-tie-embeddings"]
    return [str(f) for f in flags]


@settings(max_examples=80, deadline=None)
@given(cfg=configs())
def test_random_configs_count_exactly(cfg):
    count = count_params(cfg)
    assert (count.total, count.matmul) == meta_counts(cfg)
    assert count.total == sum(count.breakdown.values())


@settings(max_examples=50, deadline=None)
@given(cfg=configs())
def test_cli_counts_random_configs_exactly(cfg):
    r = CliRunner().invoke(cli, ["estimate", "params", *cli_flags(cfg), "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["params"] == meta_counts(cfg)[0]
    assert out["matmul_params"] == count_params(cfg).matmul


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_tiny_transformers_run(name):
    torch.manual_seed(0)
    model = build_model(name)
    inputs = example_inputs(name, batch=2, seq_len=8)
    logits = model(inputs["idx"])
    assert logits.shape == (2, 8, PRESETS[name].vocab_size)
    loss = model(**inputs)
    assert loss.ndim == 0 and torch.isfinite(loss)


def test_cruncher_runs():
    torch.manual_seed(0)
    model = build_model("cruncher")
    out = model(**example_inputs("cruncher", batch=3))
    assert out.shape == (3,)
    assert meta_counts("cruncher")[0] == 128 * 128 * 4 + 128                 # D*D*num_layers + D


@pytest.mark.parametrize("name, published", [
    # the Hugging Face model cards' parameter totals (safetensors metadata)
    ("llama3-405b", 405_853_388_800),
    ("llama3.1-405b", 405_853_388_800),
    ("llama3.1-8b", 8_030_261_248),
    ("llama3.1-70b", 70_553_706_496),
    ("llama3.2-1b", 1_235_814_400),
    ("llama3.2-3b", 3_212_749_824),
])
def test_llama3_presets_match_published_counts(name, published):
    assert count_params(PRESETS[name]).total == published


def test_gpt3_presets_by_hand():
    # GPT-3 125M (Brown et al. Table 2.1: d 768, 12 layers, 12 heads) on Megatron's padded
    # vocabulary: V d + 2048 d + 12 (12 d^2 + 13 d) + 2 d (tied head) =
    # 39,321,600 + 1,572,864 + 85,054,464 + 1,536 = 125,950,464
    assert count_params(PRESETS["gpt3-125m"]).total == 125_950_464
    cfg = PRESETS["gpt3-175b"]
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_positions) == (12288, 96, 96, 2048)
