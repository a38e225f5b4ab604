"""``torchledger estimate``: the worked examples of ACCOUNTING.md sections 5, 6, 8 and 9
through the CLI (``--json``), the table output, and bad input (one line, exit 2)."""
import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from torchledger.cli import cli
from torchledger.units import GB, GiB

LLAMA2_7B = ["--vocab", "32000", "--hidden", "4096", "--layers", "32", "--heads", "32",
             "--ffn", "11008", "--mlp", "swiglu", "--norm", "rmsnorm", "--no-bias",
             "--no-tie-embeddings"]


def run(*args):
    return CliRunner().invoke(cli, ["estimate", *args])


def js(*args) -> dict:
    r = run(*args, "--json")
    assert r.exit_code == 0, r.output
    assert r.stderr == ""
    return json.loads(r.stdout)                       # one JSON object and nothing else


# ----------------------------------------------------------------------------- section 5


@pytest.mark.parametrize("n, gb", [("1B", 16), ("7B", 112), ("13B", 208), ("30B", 480),
                                   ("70B", 1120)])
def test_memory_16_bytes_per_param(n, gb):
    for precision in ("fp32", "mixed"):
        out = js("memory", "--params", n, "--precision", precision)
        assert out["bytes_per_param"] == 16
        assert out["total_bytes"] == gb * GB


def test_memory_breakdowns():
    fp32 = js("memory", "--params", "7B", "--precision", "fp32")
    assert fp32["breakdown"] == {"params": 28 * GB, "grads": 28 * GB, "master": 0,
                                 "optimizer": 56 * GB}
    mixed = js("memory", "--params", "7e9", "--precision", "mixed")
    assert mixed["bytes_per_param_breakdown"] == {"params": 2, "grads": 2, "master": 4,
                                                  "optimizer": 8}
    assert sum(mixed["breakdown"].values()) == mixed["total_bytes"]
    assert js("memory", "--params", "7B", "--optimizer", "adam8bit")["bytes_per_param"] == 10
    assert js("memory", "--params", "7B", "--optimizer", "sgd",
              "--precision", "fp32")["bytes_per_param"] == 8


def test_memory_largest_model_on_8_h100():
    # 8 x 80 GB = 640 GB / 16 B -> 40B (ZeRO-3, the default); replicated: 80 GB / 16 = 5B.
    out = js("memory", "--params", "7B", "--gpus", "8", "--gpu-memory", "80GB")
    assert out["max_params"] == 40 * 10**9 and out["zero"] == 3 and out["fits"] is True
    assert any("ZeRO-3" in a for a in out["assumptions"])
    # a named H100 gives a process 79.18 GiB = 85,018,877,624 B (the runtime's total, not the
    # datasheet's 80e9): 8 x that / 16 = 42,509,438,812; replicated 85,018,877,624 / 16
    assert js("memory", "--params", "7B", "--gpus", "8", "--gpu", "H100")["max_params"] == 42_509_438_812
    replicated = js("memory", "--params", "7B", "--gpus", "8", "--gpu", "h100", "--zero", "0")
    assert replicated["max_params"] == 5_313_679_851 and replicated["fits"] is False
    assert js("memory", "--params", "50B", "--gpus", "8", "--gpu", "h100")["fits"] is False


def test_memory_zero3_7_5b_over_64():
    out = js("memory", "--params", "7.5B", "--gpus", "64", "--zero", "3")
    assert out["per_gpu_bytes"] == 1.875e9                          # 16 * 7.5e9 / 64
    assert round(out["per_gpu_bytes"] / GB, 1) == 1.9


def test_memory_llama3_8b():
    adamw = js("memory", "--params", "8030261248")
    assert round(adamw["total_bytes"] / GiB) == 120                 # 119.7 GiB
    assert js("memory", "--preset", "llama3-8b")["total_bytes"] == adamw["total_bytes"]
    assert round(js("memory", "--params", "8030261248", "--optimizer",
                    "adam8bit")["total_bytes"] / GiB) == 75          # 74.8 GiB
    weights = {k: round(v / GiB, 1) for k, v in adamw["weights_bytes"].items()}
    assert (weights["fp32"], weights["bf16"], weights["int8"], weights["int4"]) == \
        (29.9, 15.0, 7.5, 3.7)


# ----------------------------------------------------------------------------- section 6


@pytest.mark.parametrize("preset, exact", [("gpt2", 124_439_808), ("llama2-7b", 6_738_415_616),
                                           ("llama3-8b", 8_030_261_248)])
def test_params_presets(preset, exact):
    out = js("params", "--preset", preset)
    assert out["params"] == exact
    assert sum(out["breakdown"].values()) == exact
    assert isinstance(out["params_12ld2"], int)


def test_params_from_flags_match_worked_examples():
    gpt2 = ["--vocab", "50257", "--hidden", "768", "--layers", "12", "--heads", "12",
            "--positions", "1024"]
    assert js("params", *gpt2)["params"] == 124_439_808
    assert js("params", *LLAMA2_7B)["params"] == 6_738_415_616
    llama3 = ["--vocab", "128256", "--hidden", "4096", "--layers", "32", "--heads", "32",
              "--kv-heads", "8", "--ffn", "14336", "--mlp", "swiglu", "--norm", "rmsnorm",
              "--no-bias", "--no-tie-embeddings"]
    assert js("params", *llama3)["params"] == 8_030_261_248


def test_params_llama2_7b_breakdown():
    b = js("params", *LLAMA2_7B)["breakdown"]
    # 32*(67,108,864 + 135,266,304 + 8,192) + 2*131,072,000 + 4,096
    assert b == {"embeddings": 131_072_000, "positions": 0, "attention": 32 * 67_108_864,
                 "mlp": 32 * 135_266_304, "norms": 32 * 8_192, "final_norm": 4_096,
                 "lm_head": 131_072_000}


@pytest.mark.parametrize("d, L, h, billions", [(4096, 32, 32, 6.4), (5120, 40, 40, 12.6),
                                               (8192, 80, 64, 64.4)])
def test_params_12ld2(d, L, h, billions):
    out = js("params", "--vocab", "32000", "--hidden", str(d), "--layers", str(L),
             "--heads", str(h))
    assert round(out["params_12ld2_blocks"] / 1e9, 1) == billions
    assert out["params_12ld2"] == 12 * L * d * d + 32000 * d


def test_params_shares():
    gpt2 = js("params", "--preset", "gpt2")["shares"]
    assert 0.30 < gpt2["embeddings"] + gpt2["positions"] < 0.34     # ~1/3
    assert js("params", "--preset", "llama2-70b")["shares"]["mlp"] > 0.80


def test_params_preset_overridden_by_flags():
    # gpt2 with 1 layer: 124,439,808 - 11 * (2,362,368 + 4,722,432 + 3,072)
    assert js("params", "--preset", "gpt2", "--layers", "1")["params"] == \
        124_439_808 - 11 * (2_362_368 + 4_722_432 + 3_072)


# ----------------------------------------------------------------------------- section 8


def test_kv_cache_llama2_70b():
    flags = ["--layers", "80", "--kv-heads", "8", "--head-dim", "128"]
    out = js("kv-cache", *flags, "--tokens", "32768")
    assert out["bytes_per_token"] == 327_680 == 320 * 1024
    assert out["total_bytes"] == 10 * GiB
    no_gqa = js("kv-cache", "--layers", "80", "--kv-heads", "64", "--head-dim", "128",
                "--tokens", "32768", "--dtype", "bf16")
    assert no_gqa["total_bytes"] == 80 * GiB
    preset = js("kv-cache", "--preset", "llama2-70b", "--tokens", "32768")
    assert preset["total_bytes"] == 10 * GiB and preset["total_bytes_without_gqa"] == 80 * GiB
    assert js("kv-cache", *flags, "--tokens", "2", "--batch", "3")["total_bytes"] == 327_680 * 6


def test_decode_llama3_8b():
    out = js("decode", "--preset", "llama3-8b", "--gpu", "h100")
    assert round(out["weight_bytes"] / GB, 1) == 16.1
    assert round(out["ms_per_step"], 2) == 4.79
    assert round(out["compute_s"] * 1e6, 1) == 15.2
    assert round(out["tokens_per_s"]) == 209
    # "~315" in ACCOUNTING is 4.79 ms / 15.2 us = 315.1; unrounded 316.06.
    assert out["critical_batch"] == pytest.approx(315, rel=0.005)
    same = js("decode", "--params", "8030261248", "--matmul-params", "7504658432",
              "--gpu", "H100-SXM", "--dtype", "bf16", "--batch", "1")
    assert same["ms_per_step"] == pytest.approx(out["ms_per_step"])
    assert same["critical_batch"] == pytest.approx(out["critical_batch"], rel=1e-4)


def test_decode_params_only_and_batches():
    out = js("decode", "--params", "8.03B", "--gpu", "h100")
    assert round(out["ms_per_step"], 2) == 4.79 and round(out["tokens_per_s"]) == 209
    big = js("decode", "--preset", "llama3-8b", "--gpu", "h100", "--batch", "1000")
    assert big["bound"] == "compute" and big["tokens_per_s"] > 209 * 315


# ----------------------------------------------------------------------------- section 9


def test_train_70b_15t():
    base = ["--params", "70B", "--tokens", "15T", "--gpus", "1024"]
    out = js("train", *base, "--gpu", "h100", "--mfu", "0.5")
    assert out["flops"] == 63 * 10**23                               # 6.3e24, an exact int
    assert round(out["days"]) in (143, 144)                          # 143.9
    assert round(js("train", *base, "--peak-flops", "1e15", "--mfu", "0.5")["days"]) == 142
    # "~204" at MFU 0.35: 203.4 days with a 1e15 peak, 205.6 with 989.5 TF.
    assert abs(js("train", *base, "--peak-flops", "1e15", "--mfu", "0.35")["days"] - 204) < 1
    assert js("train", *base, "--mfu", "0.35")["days"] == pytest.approx(204, rel=0.01)


def test_train_gpt3():
    out = js("train", "--params", "175B", "--tokens", "300B", "--gpu", "h100", "--mfu", "0.4")
    assert out["flops"] == 315 * 10**21                              # 3.15e23
    assert round(out["gpu_hours"], -4) == 2.2e5                       # 221,072
    assert out["cost"] is None


def test_train_cost_is_a_parameter():
    out = js("train", "--params", "175B", "--tokens", "300B", "--mfu", "0.4", "--price", "2.5")
    assert out["cost"] == pytest.approx(out["gpu_hours"] * 2.5)


def test_train_preset_attention_terms():
    # gpt2: matmul N 123,532,032; attention 12*L*T*d = 12*12*1024*768 per token, causal half.
    out = js("train", "--preset", "gpt2", "--tokens", "1000")
    assert out["params"] == 123_532_032 and out["flops"] == 6 * 123_532_032 * 1000
    assert out["flops_attention"] == 12 * 12 * 1024 * 768 * 1000
    assert out["flops_attention_causal"] * 2 == out["flops_attention"]
    assert js("train", "--preset", "gpt2", "--tokens", "1000", "--seq-len", "512")[
        "flops_attention"] == 12 * 12 * 512 * 768 * 1000


def _types(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_types(v, f"{prefix}{k}."))
        elif v is not None:
            out[prefix + k] = type(v).__name__
    return out


@pytest.mark.parametrize("command, args", [
    ("train", ["--params", "7.5", "--tokens", "1e9"]), ("train", ["--params", "7B", "--tokens", "1.5"]),
    ("train", ["--preset", "gpt2", "--tokens", "1000.5"]), ("memory", ["--params", "7.5"]),
    ("decode", ["--params", "7B", "--gpu", "h100", "--matmul-params", "3.5"]),
])
def test_fractional_counts_are_refused(command, args):
    """Parameters and tokens are whole counts: ``--params 7.5`` is a missing suffix, not 7.5
    parameters (it would give an int params key beside flops computed from 7.5)."""
    r = run(command, *args, "--json")
    assert r.exit_code == 2 and r.stdout == ""
    (line,) = r.stderr.strip().splitlines()
    assert "whole number" in line and "did you mean" in line


@pytest.mark.parametrize("command, args", [
    ("train", ["--params", "7.5B", "--tokens", "1.5T"]), ("memory", ["--params", "7.5B", "--gpu", "h100"]),
    ("decode", ["--params", "7.5B", "--gpu", "h100", "--matmul-params", "3.5B"]),
])
def test_count_keys_are_ints(command, args):
    out = js(command, *args)
    for key in ("flops", "flops_6nd", "params", "tokens", "n_params", "matmul_params", "max_params"):
        if key in out:
            assert type(out[key]) is int, (key, out[key])
    if command == "train":
        assert out["flops"] == 6 * 7_500_000_000 * 1_500_000_000_000


# ----------------------------------------------------------------------------- tables


@pytest.mark.parametrize("args", [
    ["params", "--preset", "gpt2"], ["params", "--preset", "cruncher"],
    ["train", "--params", "7B", "--tokens", "1T", "--price", "2"],
    ["train", "--preset", "llama3-8b", "--tokens", "1T"],
    ["memory", "--params", "7B", "--gpus", "8", "--gpu", "h100"],
    ["kv-cache", "--preset", "llama3-8b"], ["decode", "--params", "7B", "--gpu", "a100"],
])
def test_tables_for_people(args):
    r = run(*args)
    assert r.exit_code == 0, r.output
    assert "formula" in r.stdout and "Assumptions:" in r.stdout
    assert "FLOP = 2 x multiply-add" in r.stdout and "GiB = 2^30" in r.stdout
    assert not r.stdout.lstrip().startswith("{")


def test_table_shows_numbers():
    out = run("params", "--preset", "gpt2").stdout
    assert "124,439,808" in out and "12*L*d^2 + V*d" in out
    assert "4.79 ms" in run("decode", "--preset", "llama3-8b", "--gpu", "h100").stdout
    assert "320.0 KiB" in run("kv-cache", "--preset", "llama2-70b").stdout


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("args, expected", [
    (["params", "--preset", "gpt5"], "known presets: gpt2"),
    (["params", "--vocab", "100", "--hidden", "100", "--layers", "2", "--heads", "3"],
     "--hidden (100) must be divisible by --heads (3)"),
    (["params", "--vocab", "100", "--hidden", "96", "--layers", "2", "--heads", "6",
      "--kv-heads", "4"], "--heads (6) must be divisible by --kv-heads (4)"),
    (["params", "--vocab", "100", "--hidden", "0", "--layers", "2", "--heads", "2"],
     "expected a number > 0"),
    (["params", "--vocab", "-5", "--hidden", "8", "--layers", "2", "--heads", "2"],
     "expected a number > 0"),
    (["params", "--vocab", "lots", "--hidden", "8", "--layers", "2", "--heads", "2"],
     "expected a number such as 7e9"),
    (["params", "--vocab", "10.5", "--hidden", "8", "--layers", "2", "--heads", "2"],
     "whole number"),
    (["params", "--hidden", "8"], "missing: --vocab, --layers, --heads"),
    (["params", "--preset", "cruncher", "--hidden", "8"], "not a Transformer"),
    (["params", "--preset", "gpt2", "--mlp", "relu"], "'relu' is not one of"),
    (["train", "--params", "7B"], "--tokens"),
    (["train", "--tokens", "1T"], "--params"),
    (["train", "--params", "0", "--tokens", "1T"], "expected a number > 0"),
    (["train", "--params", "7B", "--tokens", "1T", "--gpu", "x200"], "known GPUs: V100 SXM"),
    (["train", "--params", "7B", "--tokens", "1T", "--gpu", "v100"], "no bf16 peak"),
    (["train", "--params", "7B", "--tokens", "1T", "--mfu", "2"], "<= 1"),
    (["train", "--params", "7B", "--tokens", "1T", "--seq-len", "8"], "--seq-len needs"),
    (["memory", "--params", "7B", "--optimizer", "lion"], "'adamw'"),
    (["memory", "--params", "7B", "--precision", "fp64"], "'mixed'"),
    (["memory", "--params", "7B", "--zero", "4"], "'3'"),
    (["memory", "--params", "7B", "--gpu", "h100", "--gpu-memory", "80GB"], "not both"),
    (["memory", "--params", "7B", "--gpu-memory", "80 parsecs"], "such as 80GB"),
    (["train", "--params", "1e400", "--tokens", "1T"], "expected a finite number, got '1e400'"),
    (["memory", "--params", "7B", "--gpu-memory", "1e999GB"], "expected a finite size, got"),
    (["kv-cache", "--layers", "80", "--kv-heads", "8"], "--head-dim, --tokens"),
    (["kv-cache", "--preset", "cruncher"], "not a Transformer"),
    (["decode", "--params", "7B"], "--gpu"),
    (["decode", "--params", "7B", "--gpu", "tpu"], "known GPUs"),
    (["decode", "--params", "7B", "--gpu", "a100", "--dtype", "fp8"], "no fp8 peak"),
])
def test_bad_input_is_one_line_exit_2(args, expected):
    r = run(*args)
    assert r.exit_code == 2, r.output
    assert r.stdout == ""
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("torchledger: error: ")
    assert expected in r.stderr
    assert "Traceback" not in r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)


# ----------------------------------------------------------------------------- processes


def _run_python(code: str):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env)


def test_python_m_torchledger():
    r = subprocess.run([sys.executable, "-m", "torchledger", "estimate", "params", "--preset",
                        "gpt2", "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["params"] == 124_439_808


def test_estimate_does_not_import_torch():
    code = """
import sys
import torchledger.formulas
from torchledger.cli import cli
runs = [["params", "--preset", "llama3-8b"], ["train", "--params", "7B", "--tokens", "1T"],
        ["memory", "--params", "7B", "--gpu", "h100"], ["kv-cache", "--preset", "gpt2"],
        ["decode", "--params", "7B", "--gpu", "h100"]]
for args in runs:
    for extra in ([], ["--json"]):
        assert cli.main(["estimate", *args, *extra], standalone_mode=False) == 0
print("TORCH_LOADED" if "torch" in sys.modules else "TORCH_FREE", file=sys.stderr)
"""
    r = _run_python(code)
    assert r.returncode == 0, r.stderr
    assert "TORCH_FREE" in r.stderr
