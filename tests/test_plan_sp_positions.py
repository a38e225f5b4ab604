"""``--sequence-parallel on|off``: whether the standard plan's tensor parallelism also splits the
sequence between the blocks. Learned-position decoders (GPT-2/3) run without it unless asked
(Megatron's GPT ran without it before 2022, with it in Korthikanti et al.), and then split the
position table like the token table; a real two-rank run computes the loss and the gradients the
whole model does; RoPE decoders run with it unless told off; Hugging Face decoders cannot."""
from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from conftest import run_torchrun

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
GPT2_TINY = os.path.join(ROOT, "examples", "gpt2_tiny.py")


@pytest.mark.slow
def test_tp_sp_with_learned_positions_matches_the_whole_model(tmp_path):
    run_torchrun(os.path.join(HERE, "_tp_sp_positions.py"), tmp_path, timeout=120)
    with open(tmp_path / "result.json") as f:
        r = json.load(f)
    whole, parallel = r["loss"]
    assert parallel == pytest.approx(whole, rel=1e-5)
    for name, err in r["grad_err"].items():
        assert err < 1e-5, (name, err)
    assert any("sequence parallel" in n and "learned positions" in n for n in r["notes"])


def _audit(path, sp, mesh="tp=2"):
    from torchledger.audit import run_audit
    return run_audit(path, world_size=2, mesh=mesh, steps=1, plan={"sequence_parallel": sp}).record


def _forward_collectives(rec) -> set:
    return {c["op"] for c in rec.collectives if c.get("phase") == "forward"}


def test_learned_positions_split_the_sequence_only_when_asked():
    """gpt2-tiny (learned positions) at tp=2 on the fake world: by default no sequence
    parallelism (all-reduces in forward, the note says why); --sequence-parallel on: the blocks
    see T/2 positions, reduce-scatters and all-gathers in forward, and the step holds less."""
    from torchledger.analyzers.compare_layout import sequence_parallel
    plain, split = _audit(GPT2_TINY, None), _audit(GPT2_TINY, True)
    assert not sequence_parallel(plain) and sequence_parallel(split)
    assert "all_reduce" in _forward_collectives(plain)
    assert {"reduce_scatter", "all_gather"} <= _forward_collectives(split)
    assert any("learned positions, as Megatron's GPT without --sequence-parallel" in n
               for n in plain.meta["audit"]["plan"])
    assert any("embedding, learned positions, head sharded" in n for n in split.meta["audit"]["plan"])
    # the norms' inputs and the residual stream are held at T/2 positions: less saved
    assert split.totals["activation_bytes"] < plain.totals["activation_bytes"]
    assert _audit(GPT2_TINY, False).totals["peak_bytes"] == plain.totals["peak_bytes"]   # off = default here


def test_rope_decoder_without_sequence_parallelism_when_told_off(tmp_path):
    from torchledger.analyzers.compare_layout import sequence_parallel
    path = tmp_path / "rope.py"
    path.write_text(
        "import torch\n"
        "from torchledger import AuditSpec\n"
        "from torchledger.models.config import TransformerConfig\n"
        "from torchledger.models.transformer import Transformer\n"
        "def audit_spec():\n"
        "    cfg = TransformerConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=16)\n"
        "    idx = torch.randint(0, 64, (2, 16))\n"
        "    return AuditSpec(model=Transformer(cfg), inputs=(idx, idx))\n")
    on, off = _audit(str(path), None), _audit(str(path), False)
    assert sequence_parallel(on) and not sequence_parallel(off)
    assert any("no sequence parallelism: --sequence-parallel off" in n for n in off.meta["audit"]["plan"])


def test_hugging_face_decoder_refuses_sequence_parallel_on(tmp_path):
    """One line, exit 2: a Hugging Face decoder computes its positions from the embedded length."""
    from torchledger.cli import cli
    path = tmp_path / "hf.py"
    path.write_text(
        "import torch\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "from torchledger import AuditSpec\n"
        "def audit_spec():\n"
        "    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,\n"
        "                      num_attention_heads=4, num_key_value_heads=2)\n"
        "    idx = torch.randint(0, 64, (1, 8))\n"
        "    return AuditSpec(model=LlamaForCausalLM(cfg), inputs=dict(input_ids=idx, labels=idx))\n")
    r = CliRunner().invoke(cli, ["audit", str(path), "--world-size", "2", "--mesh", "tp=2",
                                  "--sequence-parallel", "on"])
    assert r.exit_code == 2, r.output
    line = r.output.strip().splitlines()[-1]
    assert "--sequence-parallel on: LlamaForCausalLM is a Hugging Face decoder" in line
    assert "drop --sequence-parallel" in line and "Traceback" not in r.output


def test_layout_checks_the_option():
    from torchledger.parallel.layout import Layout, WorldError
    assert Layout(sequence_parallel=True).sequence_parallel is True
    with pytest.raises(WorldError, match="--sequence-parallel: expected on or off"):
        Layout(sequence_parallel=1)


def test_plan_candidates_carry_the_choice_into_their_audit_args():
    """Every candidate of a search asked --sequence-parallel on says so in its audit_args (the
    audit that reproduces it), and the model's facts are read under it: T must divide by tp."""
    from torchledger.plan.evaluate import audit_args, probe
    from torchledger.plan.space import enumerate_space
    facts = probe(GPT2_TINY, sequence_parallel=True)
    assert facts.sequence_parallel and not probe(GPT2_TINY).sequence_parallel
    space = enumerate_space(facts, 2, 2, ("dp", "tp"), ("none",), ("1f1b",), "fp32", "eager",
                            sequence_parallel=True)
    assert space.candidates and all(c.sequence_parallel for c in space.candidates)
    args = audit_args(space.candidates[0], 2)
    assert args[args.index("--sequence-parallel") + 1] == "on"
    plain = enumerate_space(probe(GPT2_TINY), 2, 2, ("dp", "tp"), ("none",), ("1f1b",), "fp32", "eager")
    assert "--sequence-parallel" not in audit_args(plain.candidates[0], 2)
