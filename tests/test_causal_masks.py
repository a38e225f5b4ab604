"""Issue 29 item 5, attention as it runs: a Hugging Face causal LM traced on fake tensors
builds an explicit 4-D mask (it cannot read the padding mask, nor the position ids it checks
for packed sequences) and calls SDPA with ``attn_mask``; on a GPU with an all-ones padding
mask it calls SDPA with ``is_causal=True``. The record says the call had an explicit mask and
why it was taken for the causal one; the time model prices it causal. Encoders and masks that
are not the causal one stay dense."""
import json

import pytest
import torch
from click.testing import CliRunner

from torchledger.steptime.predict import causal_mask_assumptions, op_seconds
from torchledger.cli import cli
from torchledger.formulas import steptime as st
from torchledger.formulas.hardware import get_gpu
from torchledger.formulas.steptime import DEFAULT_EFFICIENCY
from torchledger.tracer.attn_masks import MaskFacts, causal_lm

LLAMA = '''
import torch, transformers as tf, torchledger

def audit_spec():
    cfg = tf.LlamaConfig(vocab_size=256, hidden_size=512, intermediate_size=1024, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False,
                         attn_implementation="sdpa", use_cache=False)
    model = tf.AutoModelForCausalLM.from_config(cfg)
    ids = torch.randint(0, 256, (1, 2048))
    inputs = {"input_ids": ids, "labels": ids}
    if MASK:
        inputs["attention_mask"] = torch.ones_like(ids)
    return torchledger.AuditSpec(model, inputs)
'''

BERT = '''
import torch, transformers as tf, torchledger

def audit_spec():
    cfg = tf.BertConfig(vocab_size=256, hidden_size=512, intermediate_size=1024, num_hidden_layers=1,
                        num_attention_heads=4, max_position_embeddings=2048, attention_probs_dropout_prob=0.0,
                        attn_implementation="sdpa")
    model = tf.BertForMaskedLM(cfg)
    ids = torch.randint(0, 256, (1, 2048))
    return torchledger.AuditSpec(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                         "labels": ids})
'''

# H100 SXM, fp32 (no autocast): SDPA runs the memory-efficient kernel for fp32 inputs (flash and
# cuDNN take 16-bit only), as 3xTF32 on tensor cores: 494.7 / 3 = 164.9 TF/s, at its fractions
# [0.20 fwd, 0.16 bwd] x 2048 / (2048 + 256) x the sustained fraction s (fitted: read from the
# defaults); b 1, 4 heads, S 2048, d = dv = 128 (head dim 512 / 4), one layer. At s = 0.82:
#   causal forward FLOPs 2 x 1 x 4 x 2048^2 x 256 / 2 = 2^32 = 4,294,967,296 at
#     164.9e12 x 0.20 x 0.88889 x 0.82 x 0.87 (causal kernel) = 20.93 TF/s -> 0.20537 ms
#   causal backward 2.5 x 2^32 at 164.9e12 x 0.16 x 0.88889 x 0.82 x 0.87 = 16.74 TF/s -> 0.64177 ms
#   dense (what the traced step ran): 2 x 2^32 forward at 164.9e12 x 0.20 x 0.88889 x 0.82 =
#     24.04 TF/s -> 0.35734 ms; backward 2.5 x 2^33 at 19.24 TF/s -> 1.11668 ms
SUSTAINED = DEFAULT_EFFICIENCY["sustained_fraction"]
_PEAK = 494.7e12 / 3
_FWD, _BWD = _PEAK * 0.20 * 2048 / 2304 * SUSTAINED, _PEAK * 0.16 * 2048 / 2304 * SUSTAINED
CAUSAL_S = 2 ** 32 / (_FWD * 0.87) + 2.5 * 2 ** 32 / (_BWD * 0.87)      # 0.84713 ms at s = 0.82
DENSE_S = 2 ** 33 / _FWD + 2.5 * 2 ** 33 / _BWD                          # 1.47401 ms at s = 0.82


def _audit(tmp_path, name, source):
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    out = tmp_path / f"{name}.json"
    res = CliRunner().invoke(cli, ["audit", str(path), "--steps", "1", "--gpu", "h100", "--format", "json",
                                   "--output", str(out)])
    assert res.exit_code == 0, res.output
    return json.loads(out.read_text())


def _attention_shapes(d):
    return [s for o in d["ops"] if o["kind"] == "attention" for s in o.get("shapes") or ()]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    pytest.importorskip("transformers")
    tmp = tmp_path_factory.mktemp("causal")
    return {mask: _audit(tmp, f"llama_{mask}", f"MASK = {mask}\n" + LLAMA) for mask in (True, False)}


def test_hf_llama_with_and_without_attention_mask_is_priced_causal(llama):
    for mask, d in llama.items():
        shapes = _attention_shapes(d)
        assert len(shapes) == 2                           # forward and backward of the one layer
        for s in shapes:
            assert s["attn"] == [1, 4, 2048, 2048, 128, 128]
            # run as the GPU runs it: no mask, is_causal (with attention_mask=ones transformers
            # built the boolean mask, which the fake step hands SDPA as is_causal instead)
            assert s["causal"] is True and "mask" not in s and "mask_bytes" not in s
        p = d["predictions"]["step_time"]
        assert p["by_kind"]["attention"] == pytest.approx(CAUSAL_S, rel=1e-4)
        assert not [a for a in p["assumptions"] if "explicit mask of a causal LM" in a]
    # the mask transformers built on fake tensors (with or without attention_mask: it cannot
    # read either): its one call taken as is_causal, and said so
    for d in llama.values():
        kernels = d["meta"]["gpu_kernels"]
        assert kernels["causal_mask"]["calls"] == 1 and "is_causal=True" in kernels["causal_mask"]["note"]
    assert llama[True]["totals"]["activation_bytes"] == llama[False]["totals"]["activation_bytes"]
    seconds = [d["predictions"]["step_time"]["by_kind"]["attention"] for d in llama.values()]
    assert seconds[0] == pytest.approx(seconds[1], rel=1e-12)


def test_an_encoder_with_a_padding_mask_stays_dense(tmp_path):
    pytest.importorskip("transformers")
    d = _audit(tmp_path, "bert", BERT)
    shapes = _attention_shapes(d)
    assert shapes and all(s["mask"] and not s["causal"] and "mask_causal" not in s for s in shapes)
    p = d["predictions"]["step_time"]
    assert p["by_kind"]["attention"] == pytest.approx(DENSE_S, rel=1e-4)
    assert not any("explicit mask of a causal LM" in a for a in p["assumptions"])


class _Masked(torch.nn.Module):
    """Not a language model: attention under an explicit mask of its own."""

    def __init__(self, mask):
        super().__init__()
        self.proj = torch.nn.Linear(128, 128)
        self.mask = mask

    def forward(self, x):
        q = self.proj(x).view(1, 64, 2, 64).transpose(1, 2)
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=self.mask).sum()


@pytest.mark.parametrize("mask", ["tril", "window"])
def test_sdpa_with_a_mask_in_a_model_that_is_not_causal_stays_dense(mask):
    import torchledger
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        m = torch.ones(64, 64, dtype=torch.bool).tril()
        if mask == "window":
            m = m & torch.ones(64, 64, dtype=torch.bool).triu(-8)
        model = _Masked(m)
        with torchledger.trace(model) as t:
            model(torch.randn(1, 64, 128)).backward()
    shapes = [s for o in t.record.ops if o["kind"] == "attention" for s in o.get("shapes") or ()]
    assert len(shapes) == 2 and all(s["mask"] and "mask_causal" not in s for s in shapes)


def test_mask_rules_without_values():
    """MaskFacts.state on meta masks (no values) and a real one."""
    class Attn(torch.nn.Module):
        def __init__(self, is_causal=True, sliding_window=None):
            super().__init__()
            self.is_causal, self.sliding_window = is_causal, sliding_window

    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    q = torch.empty(1, 2, 8, 16, device="meta")
    square = torch.empty(1, 1, 8, 8, dtype=torch.bool, device="meta")

    def state(mask, module, model=None, bool_call=False):
        facts = MaskFacts()
        facts.bool_call = bool_call
        return facts.state(op, (q, q, q), {"attn_mask": mask}, module, model)

    assert state(None, Attn()) is None                                 # no mask
    assert state(square, Attn()) == ("Attn.is_causal", 64)             # HF's decoder attention
    assert state(square, Attn(is_causal=False))[0] is None             # an encoder's
    assert state(square, Attn(sliding_window=4))[0] is None            # a window narrower than S
    assert state(square, Attn(sliding_window=4096)) == ("Attn.is_causal", 64)
    assert state(torch.empty(1, 1, 1, 8, dtype=torch.bool, device="meta"), Attn())[0] is None  # padding only
    additive = torch.empty(1, 1, 8, 8, device="meta")                  # a bias (ALiBi, T5)
    assert state(additive, Attn())[0] is None
    assert state(additive, Attn(), bool_call=True)[0] == "Attn.is_causal"   # SDPA's copy of a bool mask
    assert state(torch.ones(1, 1, 8, 8, dtype=torch.bool).tril(), Attn())[0] is None   # values: read


def test_causal_lm_from_the_model():
    transformers = pytest.importorskip("transformers")
    from torchledger.models import get_config
    from torchledger.models.transformer import Transformer
    assert causal_lm(Transformer(get_config("gpt2-tiny"))) == "torchledger's decoder"
    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                 num_attention_heads=2)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**small))
    assert causal_lm(llama) == "LlamaForCausalLM, a causal LM"
    assert causal_lm(llama.model) is None                               # the bare model says nothing
    cfg = transformers.LlamaConfig(architectures=["LlamaForCausalLM"], **small)
    assert causal_lm(transformers.LlamaModel(cfg)) == "LlamaModel of a LlamaForCausalLM config, a causal LM"
    assert causal_lm(transformers.BertForMaskedLM(transformers.BertConfig(**small))) is None
    assert causal_lm(torch.nn.Linear(2, 2)) is None


def test_op_seconds_prices_a_causal_mask_causal():
    """A shape the tracer marked ``mask_causal`` is priced as the is_causal kernel; one with a
    mask and no such mark stays dense."""
    h100 = get_gpu("h100")
    eff = st.efficiency(h100)
    shape = {"attn": [1, 32, 8192, 8192, 128, 128], "dtype": "bf16", "causal": False, "count": 1, "mask": True}
    row = {"op": "aten._scaled_dot_product_flash_attention_for_cpu.default", "phase": "forward",
           "kind": "attention", "count": 1, "shapes": [shape]}
    dense = st.attention_seconds(1, 32, 8192, 8192, 128, 128, False, False, "bf16", h100, eff=eff)
    causal = st.attention_seconds(1, 32, 8192, 8192, 128, 128, True, False, "bf16", h100, eff=eff)
    assert op_seconds(row, h100, eff)["seconds"] == pytest.approx(dense)
    assert causal_mask_assumptions([row]) == []
    shape.update(mask_causal="LlamaForCausalLM, a causal LM", mask_bytes=2 * 8192 ** 2)
    assert op_seconds(row, h100, eff)["seconds"] == pytest.approx(causal)
    (line,) = causal_mask_assumptions([row])
    assert "LlamaForCausalLM" in line and "134.2 MB" in line        # 2 x 8192^2 B, one call


def test_the_causal_mask_copy_is_not_kept(tmp_path, monkeypatch):
    """Handed SDPA as is_causal, the mask leaves no fp32 copy saved for backward: against the
    same step with the substitution off, the activations are 2048 x 2048 x 4 B lower."""
    pytest.importorskip("transformers")
    import torchledger.tracer.gpu_kernels as gk
    on = _audit(tmp_path, "on", "MASK = True\n" + LLAMA)
    monkeypatch.setattr(gk, "_causal_call", lambda *a, **k: None)
    off = _audit(tmp_path, "off", "MASK = True\n" + LLAMA)
    assert "causal_mask" not in (off["meta"].get("gpu_kernels") or {})
    assert off["totals"]["activation_bytes"] - on["totals"]["activation_bytes"] == 2048 * 2048 * 4
    assert off["totals"]["peak_bytes"] - on["totals"]["peak_bytes"] >= 2048 * 2048 * 4
