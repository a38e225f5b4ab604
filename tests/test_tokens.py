"""Tokens per step (D of 6ND): the audit's default rule, and where D came from
(``totals.tokens_source``) in the record and in every human report."""
from __future__ import annotations

import json
import os
import textwrap

import pytest
import torch
from click.testing import CliRunner

import torchledger
from torchledger.audit.spec import default_tokens, infer_tokens
from torchledger.cli import cli
from torchledger.record import SAMPLES_NOT_TOKENS, StepRecord, counts_samples
from torchledger.render import render

TESTS = os.path.dirname(os.path.abspath(__file__))
HINT = "; pass AuditSpec(tokens=...) to set it"


def ids(*shape):
    return torch.randint(0, 100, shape)


# -- the rule ---------------------------------------------------------------------------------
CASES = [
    # language models: token ids [B, T] -> B*T, seq_len T
    ("lm dict", lambda: {"input_ids": ids(4, 128), "attention_mask": torch.ones(4, 128, dtype=torch.long),
                         "labels": ids(4, 128)},
     512, 128, "numel of inputs['input_ids'] [4, 128]"),
    ("nanoGPT dict", lambda: {"idx": ids(2, 16), "targets": ids(2, 16)},
     32, 16, "numel of inputs['idx'] [2, 16]"),
    ("bare token ids", lambda: ids(3, 7), 21, 7, "numel of inputs [3, 7]"),
    # integer ids beat a float tensor that comes first
    ("ids after embeddings", lambda: (torch.randn(2, 5, 8), ids(3, 7)), 21, 7, "numel of inputs[1] [3, 7]"),
    # float [B, T, d] and [B, d]: rows
    ("float [B,T,d]", lambda: torch.randn(4, 16, 32), 64, None, "rows of inputs [4, 16, 32]"),
    ("float [B,d] and labels [B]", lambda: (torch.randn(8, 32), ids(8)), 8, None, "rows of inputs[0] [8, 32]"),
    ("embeddings and 1-D labels", lambda: {"labels": ids(4), "inputs_embeds": torch.randn(4, 16, 32)},
     64, None, "rows of inputs['inputs_embeds'] [4, 16, 32]"),
    # images and video: the batch, which counts samples
    ("cnn tuple", lambda: (torch.randn(8, 3, 32, 32),), 8, None,
     f"batch of inputs[0] [8, 3, 32, 32]: {SAMPLES_NOT_TOKENS}"),
    ("bare image batch", lambda: torch.randn(8, 3, 32, 32), 8, None,
     f"batch of inputs [8, 3, 32, 32]: {SAMPLES_NOT_TOKENS}"),
    ("vision dict, labels first", lambda: {"labels": ids(2), "pixel_values": torch.randn(2, 3, 224, 224)},
     2, None, f"batch of inputs['pixel_values'] [2, 3, 224, 224]: {SAMPLES_NOT_TOKENS}"),
    ("video", lambda: torch.randn(2, 3, 8, 16, 16), 2, None, f"batch of inputs [2, 3, 8, 16, 16]: {SAMPLES_NOT_TOKENS}"),
    ("uint8 images", lambda: torch.zeros(6, 32, 32, 3, dtype=torch.uint8), 6, None,
     f"batch of inputs [6, 32, 32, 3]: {SAMPLES_NOT_TOKENS}"),
    ("segmentation maps", lambda: {"pixel_values": torch.randn(2, 3, 8, 8), "labels": ids(2, 8, 8)},
     2, None, f"batch of inputs['pixel_values'] [2, 3, 8, 8]: {SAMPLES_NOT_TOKENS}"),
    ("DETR pixel mask", lambda: {"pixel_mask": torch.ones(2, 8, 8, dtype=torch.long),
                                 "pixel_values": torch.randn(2, 3, 8, 8)},
     2, None, f"batch of inputs['pixel_values'] [2, 3, 8, 8]: {SAMPLES_NOT_TOKENS}"),
    # same rank: a key with "ids" first, one with "mask" last, else the order given
    ("integer mask before ids", lambda: {"attention_mask": torch.ones(4, 7, dtype=torch.long),
                                         "input_ids": ids(4, 10)},
     40, 10, "numel of inputs['input_ids'] [4, 10]"),
    ("mask, ids", lambda: {"mask": torch.ones(4, 7, dtype=torch.long), "ids": ids(4, 10)},
     40, 10, "numel of inputs['ids'] [4, 10]"),
    ("labels before decoder ids", lambda: {"labels": ids(2, 5), "decoder_input_ids": ids(2, 6)},
     12, 6, "numel of inputs['decoder_input_ids'] [2, 6]"),
    ("mask before another name", lambda: {"token_mask": torch.ones(3, 4, dtype=torch.long),
                                          "tokens": ids(3, 9)},
     27, 9, "numel of inputs['tokens'] [3, 9]"),
    ("mask alone still counts", lambda: {"attention_mask": torch.ones(4, 7, dtype=torch.long),
                                         "x": torch.randn(4, 16)},
     28, 7, "numel of inputs['attention_mask'] [4, 7]"),
    ("key above a list", lambda: {"attention_mask": [torch.ones(2, 3, dtype=torch.long)],
                                  "input_ids": [ids(2, 5)]},
     10, 5, "numel of inputs['input_ids'][0] [2, 5]"),
    ("ids in a tuple keep the order", lambda: (torch.ones(2, 3, dtype=torch.long), ids(2, 5)),
     6, 3, "numel of inputs[0] [2, 3]"),
    # 1-D integers only when nothing better exists
    ("labels only", lambda: (ids(8),), 8, None, "numel of inputs[0] [8]: 1-D, no 2-D token ids"),
    ("packed token stream", lambda: {"input_ids": ids(300), "cu_seqlens": torch.tensor([0, 100, 300])},
     300, None, "numel of inputs['input_ids'] [300]: 1-D, no 2-D token ids"),
    ("1-D float", lambda: torch.randn(5), 5, None, "numel of inputs [5]: 1-D"),
    # skipped: bool masks, scalars, empty tensors
    ("bool mask skipped", lambda: {"mask": torch.ones(4, 4, dtype=torch.bool), "x": torch.randn(4, 8)},
     4, None, "rows of inputs['x'] [4, 8]"),
    ("nested", lambda: ({"ids": ids(2, 3)}, 5), 6, 3, "numel of inputs[0]['ids'] [2, 3]"),
    ("list", lambda: [torch.randn(2, 3, 4, 4), ids(2, 9)], 18, 9, "numel of inputs[1] [2, 9]"),
    # nothing to count
    ("no tensors", lambda: (3, "text", None), None, None, "no tensor in inputs"),
    ("none", lambda: None, None, None, "no tensor in inputs"),
    ("only uncountable", lambda: (torch.tensor(1.0), torch.ones(3, dtype=torch.bool), torch.zeros(0, 4)),
     None, None, "no countable tensor in inputs (bool, 0-dim and empty tensors are skipped)"),
]


@pytest.mark.parametrize("name, make, tokens, seq, source", CASES, ids=[c[0] for c in CASES])
def test_default_rule(name, make, tokens, seq, source):
    count = infer_tokens(make())
    assert (count.tokens, count.seq_len, count.source) == (tokens, seq, source)
    assert default_tokens(make()) == (tokens, seq)          # the old two-value helper agrees


def test_image_batch_is_not_rows_of_the_image():
    """The bug: (x [8, 3, 32, 32],) gave 8 * 3 * 32 = 768 'tokens' (rows of an image)."""
    assert infer_tokens((torch.randn(8, 3, 32, 32),)).tokens == 8


def test_vision_labels_do_not_win():
    """The bug: {pixel_values, labels [B]} gave B from the labels, the first integer tensor;
    now the pixels decide, and the source says D counts samples."""
    count = infer_tokens({"labels": ids(4), "pixel_values": torch.randn(4, 3, 16, 16)})
    assert count.tokens == 4 and "pixel_values" in count.source and SAMPLES_NOT_TOKENS in count.source


def test_rule_on_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        count = infer_tokens({"input_ids": torch.randint(0, 9, (2, 64)), "pixel_values": torch.randn(2, 3, 8, 8)})
    assert count == (128, 64, "numel of inputs['input_ids'] [2, 64]")


# -- the audit: record and reports -----------------------------------------------------------
CNN = """
    import torch, torchledger
    from torch import nn

    def audit_spec():
        model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(),
                              nn.Linear(4 * 8 * 8, 10))
        return torchledger.AuditSpec(model, (torch.randn(8, 3, 8, 8),){extra})
"""
LM = """
    import torch, torchledger
    from torchledger.models import build_model

    def audit_spec():
        idx = torch.randint(0, 512, (2, 16))
        return torchledger.AuditSpec(build_model("gpt2-tiny"), {"idx": idx, "targets": idx})
"""
NO_TENSOR = """
    import torch, torchledger
    from torch import nn

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, n):
            return self.lin(torch.ones(n, 4)).sum()

    def audit_spec():
        return torchledger.AuditSpec(M(), (3,))
"""


def audit(tmp_path, body, *args, name="model.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    r = CliRunner().invoke(cli, ["audit", str(path), "--steps", "1", *args], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return r.stdout


def test_audit_cnn_counts_samples(tmp_path):
    source = f"batch of inputs[0] [8, 3, 8, 8]: {SAMPLES_NOT_TOKENS}"
    t = json.loads(audit(tmp_path, CNN.format(extra=""), "--format", "json"))["totals"]
    assert t["tokens"] == 8 and t["tokens_source"] == source
    table = audit(tmp_path, CNN.format(extra=""))
    assert f"tokens: 8 ({source}{HINT}); FLOPs/sample " in table
    assert "D = 8 counts samples, not tokens: 6ND is no reference" in table   # so is the FLOPs row
    assert "6ND (N =" not in table and "6ND =" not in table
    md = audit(tmp_path, CNN.format(extra=""), "--format", "markdown")
    assert f"| tokens per step | 8 ({source}{HINT}) |" in md.replace("\\_", "_")
    assert "| FLOPs per sample |" in md
    html = audit(tmp_path, CNN.format(extra=""), "--format", "html")
    assert f"8 ({source}{HINT})" in html


def test_audit_lm_counts_token_ids(tmp_path):
    t = json.loads(audit(tmp_path, LM, "--format", "json"))["totals"]
    assert t["tokens"] == 32 and t["tokens_source"] == "numel of inputs['idx'] [2, 16]"
    table = audit(tmp_path, LM)
    assert f"tokens: 32 (numel of inputs['idx'] [2, 16]{HINT}); FLOPs/token " in table
    assert "D = 32 tokens" in table


MASK_FIRST = """
    import torch, torchledger
    from torch import nn

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(50, 8)
            self.head = nn.Linear(8, 50)

        def forward(self, attention_mask, input_ids):
            return self.head(self.emb(input_ids)).float().mean()

    def audit_spec():
        return torchledger.AuditSpec(M(), dict(attention_mask=torch.ones(4, 7, dtype=torch.long),
                                               input_ids=torch.randint(0, 50, (4, 10))))
"""


def test_audit_integer_mask_listed_first_does_not_set_d(tmp_path):
    """The bug: dict(attention_mask=int[4, 7], input_ids=int[4, 10]) gave D = 28 (the mask)."""
    totals = json.loads(audit(tmp_path, MASK_FIRST, "--format", "json"))["totals"]
    assert totals["tokens"] == 40
    assert totals["tokens_source"] == "numel of inputs['input_ids'] [4, 10]"


def test_audit_spec_tokens_wins(tmp_path):
    body = CNN.format(extra=", tokens=512")
    t = json.loads(audit(tmp_path, body, "--format", "json"))["totals"]
    assert t["tokens"] == 512 and t["tokens_source"] == "AuditSpec(tokens=...)"
    table = audit(tmp_path, body)
    assert "tokens: 512 (AuditSpec(tokens=...)); FLOPs/token " in table     # no hint: it was set


def test_audit_without_tensors_says_so(tmp_path):
    t = json.loads(audit(tmp_path, NO_TENSOR, "--format", "json"))["totals"]
    assert t["tokens"] == 0 and t["tokens_source"] == "no tensor in inputs"
    assert f"tokens: none (no tensor in inputs{HINT}); no FLOPs/token or 6ND" in audit(tmp_path, NO_TENSOR)
    md = audit(tmp_path, NO_TENSOR, "--format", "markdown")
    assert f"| tokens per step | none (no tensor in inputs{HINT}) |" in md


def test_saved_record_keeps_the_source(tmp_path):
    out = tmp_path / "a.json"
    audit(tmp_path, CNN.format(extra=""), "--format", "json", "--output", str(out))
    r = CliRunner().invoke(cli, ["report", str(out)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert f"tokens: 8 (batch of inputs[0] [8, 3, 8, 8]: {SAMPLES_NOT_TOKENS}{HINT})" in r.stdout


# -- the Python API ---------------------------------------------------------------------------
def _step(model, opt, x):
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()


def test_trace_tokens_given():
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with torchledger.trace(model, optimizer=opt, tokens=4) as t:
        _step(model, opt, torch.randn(4, 8))
    assert t.record.totals["tokens_source"] == "given"
    assert json.loads(t.record.to_json())["totals"]["tokens_source"] == "given"
    assert "tokens: 4 (given); FLOPs/token " in t.report()


def test_trace_without_tokens_has_no_source():
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with torchledger.trace(model, optimizer=opt) as t:
        _step(model, opt, torch.randn(4, 8))
    assert t.record.totals["tokens"] == 0 and t.record.totals["tokens_source"] is None
    assert "tokens:" not in t.report()


def test_ledger_step_source():
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ledger = torchledger.Ledger(model, optimizer=opt)
    with ledger.step(tokens=4):
        _step(model, opt, torch.randn(4, 8))
    with ledger.step(tokens=4, tokens_source=f"batch of images: {SAMPLES_NOT_TOKENS}"):
        _step(model, opt, torch.randn(4, 8))
    assert [r.totals["tokens_source"] for r in ledger.records] == [
        "given", f"batch of images: {SAMPLES_NOT_TOKENS}"]
    assert counts_samples(ledger.records[1].totals) and not counts_samples(ledger.records[0].totals)
    with pytest.raises(ValueError, match="tokens_source"):
        torchledger.trace(model, tokens=4, tokens_source=4)


# -- records saved before the field existed --------------------------------------------------
def _old_record() -> dict:
    with open(os.path.join(TESTS, "data", "gpt2-tiny", "record.json"), encoding="utf-8") as fh:
        d = json.load(fh)
    d["totals"].pop("tokens_source", None)
    return d


@pytest.mark.parametrize("fmt", ["table", "markdown", "html", "json", "csv", "sarif"])
def test_old_record_without_source_renders(fmt):
    rec = StepRecord.from_dict(_old_record())
    assert "tokens_source" not in rec.totals
    text = render(rec, None, fmt)
    assert "AuditSpec(tokens" not in text and "(given)" not in text
    if fmt == "table":
        assert "tokens: 32; FLOPs/token " in text
    if fmt == "markdown":
        assert "| tokens per step | 32 |" in text


def test_old_record_through_report_cli(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps(_old_record()))
    r = CliRunner().invoke(cli, ["report", str(path)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "tokens: 32; FLOPs/token " in r.stdout


@pytest.mark.parametrize("wrong", [3, [1], {"a": 1}])
def test_source_of_the_wrong_type_is_one_clear_error(wrong):
    d = _old_record()
    d["totals"]["tokens_source"] = wrong
    with pytest.raises(ValueError, match="totals.tokens_source: expected a string"):
        StepRecord.from_dict(d)
