"""``torchledger lint``: each rule on a realistic bad snippet (at the right line), silence on
idiomatic code, suppression comments, and the CLI (formats, exit codes, bad input).

Bad snippets mark every line that must be flagged with ``# expect: RULE``; the test compares
the set of (rule, line) found with the set marked, so extra findings fail too.
"""
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
from click.testing import CliRunner

from torchledger.lint import RULES, LintError, lint_paths, lint_source, python_files
from torchledger.render.sarif import findings_to_sarif
from torchledger.cli import cli
from torchledger.record import Finding

DATA = os.path.join(os.path.dirname(__file__), "data", "lint")
LEAKY = os.path.join(DATA, "leaky_loop.py")
CLEAN = os.path.join(DATA, "clean_loop.py")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def found(source: str) -> set:
    return {(f.rule, int(f.location.rsplit(":", 1)[1])) for f in lint_source(source, "t.py")}


def expected(source: str) -> set:
    return {(m.group(1), i) for i, line in enumerate(source.splitlines(), 1)
            for m in re.finditer(r"expect: (TL-LINT-\d{3})", line)}


BAD = {
    "001-sum-across-steps": """
        total_loss = 0
        for epoch in range(3):
            for x, y in loader:
                optimizer.zero_grad()
                loss = criterion(model(x), y)
                loss.backward()
                optimizer.step()
                total_loss += loss  # expect: TL-LINT-001
        """,
    "001-self-assignment-sum": """
        running = 0.0
        for x, y in train_loader:
            optimizer.zero_grad()
            out = model(x)
            loss = F.cross_entropy(out, y)
            loss.backward()
            optimizer.step()
            running = running + loss  # expect: TL-LINT-001
        """,
    "001-eval-without-no-grad": """
        def evaluate(model, val_loader):
            preds = []
            for x, _ in val_loader:
                preds.append(model(x))  # expect: TL-LINT-001
            return torch.cat(preds)
        """,
    "001-outputs-and-tuples": """
        history, outputs = {}, []
        for step, (x, y) in enumerate(loader):
            optimizer.zero_grad()
            logits = net(x)
            loss = criterion(logits, y)
            loss.backward()
            optimizer.step()
            outputs.append(logits)  # expect: TL-LINT-001
            history[step] = (step, loss)  # expect: TL-LINT-001
        """,
    "001-lightning-style-self-list": """
        class LitModel:
            def training_step(self, batch, batch_idx):
                loss = self.model(batch).loss
                self.step_losses.append(loss)  # expect: TL-LINT-001
                return loss
        """,
    "001-names-and-backward-receivers": """
        kept, hist = [], []
        for batch in loader:
            opt.zero_grad()
            loss = step_fn(batch)          # unknown callee; named like a loss
            out = compute(batch)           # unknown callee; but backward() is called on it
            (loss + out).backward()
            opt.step()
            hist.append(loss)  # expect: TL-LINT-001
            kept.append(out)  # expect: TL-LINT-001
        """,
    "001-reset-only-every-k-steps": """
        running = 0
        for step, batch in enumerate(loader):
            optimizer.zero_grad()
            loss = model(batch)
            loss.backward()
            optimizer.step()
            running += loss  # expect: TL-LINT-001
            if step % 100 == 0:
                print(running / 100)
                running = 0
        """,
    "002-zero-grad-before-loop-only": """
        optimizer.zero_grad()
        for x, y in loader:  # expect: TL-LINT-002
            loss = criterion(model(x), y)
            loss.backward()
            optimizer.step()
        """,
    "002-amp-scaler": """
        for batch in loader:  # expect: TL-LINT-002
            with torch.autocast("cuda"):
                loss = model(batch).loss
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        """,
    "002-zero-grad-per-epoch-only": """
        for epoch in range(10):
            opt.zero_grad()
            for x, y in loader:  # expect: TL-LINT-002
                loss = F.mse_loss(model(x), y)
                loss.backward()
                opt.step()
        """,
    "002-step-in-a-helper": """
        def train_step(model, batch, optimizer):
            loss = model(batch)
            loss.backward()
            optimizer.step()
            return loss.item()

        for batch in loader:  # expect: TL-LINT-002
            train_step(model, batch, optimizer)
        """,
    "002-reported-once-through-helpers": """
        def train_epoch(model, loader, opt):
            for x, y in loader:  # expect: TL-LINT-002
                loss = model(x, y)
                loss.backward()
                opt.step()

        for epoch in range(3):
            train_epoch(model, loader, opt)
        """,
    "003-load": """
        import torch
        import torch as th
        from torch import load
        a = torch.load("ckpt.pt")  # expect: TL-LINT-003
        b = torch.load("ckpt.pt", map_location="cpu")  # expect: TL-LINT-003
        c = th.load("ckpt.pt")  # expect: TL-LINT-003
        d = load("ckpt.pt")  # expect: TL-LINT-003
        e = torch.load("ckpt.pt", weights_only=False)  # expect: TL-LINT-003
        """,
    "004-forward-syncs": """
        import torch
        from torch import nn

        class Router(nn.Module):
            def forward(self, x, lengths):
                scores = self.gate(x)
                top = scores.max().item()  # expect: TL-LINT-004
                if scores.sum() > 0:  # expect: TL-LINT-004
                    x = x * 2
                print(scores)  # expect: TL-LINT-004
                n = int(lengths.max())  # expect: TL-LINT-004
                host = scores.cpu()  # expect: TL-LINT-004
                arr = x.detach().numpy()  # expect: TL-LINT-004
                idx = (scores > 0).nonzero()  # expect: TL-LINT-004
                torch.cuda.synchronize()  # expect: TL-LINT-004
                assert torch.isfinite(x).all()  # expect: TL-LINT-004
                while scores.abs().max() > 1:  # expect: TL-LINT-004
                    scores = scores / 2
                return x, lengths.tolist()  # expect: TL-LINT-004

        class Child(Router):
            def forward(self, x):
                y = x + 1 if x.mean() > 0 else x  # expect: TL-LINT-004
                return y
        """,
    "004-module-spellings": """
        import torch
        from torch.nn import Module

        class A(torch.nn.Module):
            def forward(self, x):
                return x.item()  # expect: TL-LINT-004

        class B(Module):
            def forward(self, x: torch.Tensor, flag: bool = False):
                h = x.relu()
                if h.any():  # expect: TL-LINT-004
                    return h
                return x

        class NotAModule:
            def forward(self, x):
                return x.item()
        """,
    "005-non-blocking-unpinned": """
        loader = DataLoader(dataset, batch_size=32)
        for x, y in loader:
            x = x.to("cuda", non_blocking=True)  # expect: TL-LINT-005
            y = y.cuda(non_blocking=True)  # expect: TL-LINT-005
        """,
    "005-non-blocking-in-a-data-file": """
        from torch.utils.data import DataLoader

        def to_device(batch, device):
            return [t.to(device, non_blocking=True) for t in batch]  # expect: TL-LINT-005

        loader = DataLoader(dataset, batch_size=32)
        """,
    "006-model-moved-in-loop": """
        for x, y in loader:
            model.to(device)  # expect: TL-LINT-006
            model = model.cuda()  # expect: TL-LINT-006
            x = x.to(device)
            optimizer.zero_grad()
            loss = criterion(model(x), y)
            loss.backward()
            optimizer.step()
        """,
    "007-whole-module-save": """
        import torch
        torch.save(model, "model.pt")  # expect: TL-LINT-007
        torch.save(self.model, path)  # expect: TL-LINT-007
        torch.save(model.state_dict(), "weights.pt")
        """,
    "008-retain-graph-in-loop": """
        hidden = None
        for x, y in loader:
            optimizer.zero_grad()
            out, hidden = rnn_model(x, hidden)
            loss = criterion(out, y)
            loss.backward(retain_graph=True)  # expect: TL-LINT-008
            optimizer.step()
        """,
    "009-checkpoint-without-optimizer": """
        import torch
        optimizer = torch.optim.AdamW(model.parameters())
        for epoch in range(3):
            train_one_epoch(model, optimizer)
            state = {"model": model.state_dict(), "epoch": epoch}
            torch.save(dict(state), "e.pt")
            torch.save({"model": model.state_dict(), "epoch": epoch}, p)  # expect: TL-LINT-009
            ckpt = {"state_dict": model.state_dict(), "step": epoch}
            torch.save(ckpt, "last.pt")  # expect: TL-LINT-009
            torch.save(dict(model=model.state_dict()), "d.pt")  # expect: TL-LINT-009
        """,
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_rule_fires_at_the_marked_lines(name):
    source = textwrap.dedent(BAD[name])
    assert expected(source), "snippet has no # expect: marker"
    assert found(source) == expected(source)


def test_accounting_leaky_loop_is_caught_at_its_lines():
    findings = lint_paths([LEAKY])
    assert [(f.rule, f.location) for f in findings] == [
        ("TL-LINT-002", f"{LEAKY}:10"),    # the `for` loop: backward + step, no zero_grad
        ("TL-LINT-001", f"{LEAKY}:15"),    # losses.append(loss)
    ]
    by_rule = {f.rule: f for f in findings}
    assert by_rule["TL-LINT-002"].severity == "error"
    assert "zero_grad" in by_rule["TL-LINT-002"].hint
    assert "loss.item()" in by_rule["TL-LINT-001"].hint


CLEAN_IDIOMS = {
    "grad-accumulation-logging-the-item-over-accum": """
        for x, y in loader:
            total = 0.0
            for _ in range(accum):
                _, loss = model(x, y)
                (loss / accum).backward()
                total += loss.item() / accum
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(total)
        """,
    "grad-accumulation-every-k-steps": """
        for step, (x, y) in enumerate(loader):
            loss = criterion(model(x), y) / accum
            loss.backward()
            if (step + 1) % accum == 0:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        """,
    "zero-grad-at-top-and-item-logging": """
        losses, running = [], 0.0
        for x, y in loader:
            optimizer.zero_grad()
            loss = criterion(model(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            running += loss.item()
            stats = {"loss": float(loss)}
            history.append(loss.cpu().item())
            values.extend(loss.detach().tolist())
        """,
    "detached-accumulator": """
        total = torch.zeros(())
        for x, y in loader:
            optimizer.zero_grad()
            loss = criterion(model(x), y)
            loss.backward()
            optimizer.step()
            total += loss.detach()
            seen = seen + loss.data
        """,
    "outputs-under-no-grad": """
        outs = []
        with torch.no_grad():
            for x in loader:
                outs.append(model(x))

        @torch.no_grad()
        def predict(model, loader):
            return [model(x) for x in loader]

        @torch.inference_mode()
        def predict2(model, loader):
            outs = []
            for x in loader:
                outs.append(model(x))
            return outs

        with torch.set_grad_enabled(False):
            for x in loader:
                outs.append(model(x))
        """,
    "weights-only-load": """
        import torch
        sd = torch.load("ckpt.pt", weights_only=True)
        sd2 = torch.load("ckpt.pt", map_location="cpu", weights_only=True)
        sd3 = torch.load("ckpt.pt", **load_kwargs)
        """,
    "forward-shape-and-flag-branches": """
        import torch.nn as nn

        class Attn(nn.Module):
            def forward(self, x, mask=None, use_cache=False, return_weights: bool = False,
                        past=None, dropout_p: float = 0.0, is_causal=True, kv_len: int = 0):
                B, T, C = x.size()
                if x.shape[0] > 1:
                    x = x.contiguous()
                if self.training and dropout_p > 0:
                    x = x * 1.0
                if mask is not None:
                    x = x.masked_fill(mask, float("-inf"))
                if past is None or past.size(1) == 0:
                    pass
                if x.dim() == 3 and x.ndim == 3 and x.numel() > 0 and x.dtype == torch.float16:
                    pass
                if isinstance(x, tuple) or len(x) == 0 or x.is_cuda or x.requires_grad:
                    pass
                if use_cache or return_weights or is_causal or kv_len:
                    pass
                if all(t.is_contiguous() for t in (x, x)):
                    pass
                assert C % self.n_head == 0, "heads must divide the width"
                print(x.shape, x.dtype, f"{x.shape}")
                h = x
                for block in self.blocks:
                    h = h + self.net(block(h))
                return h
        """,
    "grads-cleared-by-helper-or-by-hand": """
        def reset(opt):
            opt.zero_grad()

        class Trainer:
            def clear(self):
                self.model.zero_grad(set_to_none=True)

            def fit(self, loader):
                for batch in loader:
                    self.clear()
                    self.model(batch).backward()
                    self.optimizer.step()

        for batch in loader:
            reset(optimizer)
            model(batch).backward()
            optimizer.step()

        for batch in loader:
            model(batch).sum().backward()
            optim.step()
            for p in model.parameters():
                p.grad = None
        """,
    "losses-built-then-backward": """
        for x, y in loader:
            optimizer.zero_grad()
            feats = model(x)
            loss = 0
            for head in heads:
                loss = loss + F.cross_entropy(head(feats), y)
            loss = loss + 0.01 * model.aux_loss
            loss += reg_loss(model)
            loss.backward()
            optimizer.step()

        for batch in loader:
            optimizer.zero_grad()
            micro = []
            for mb in batch.chunk(4):
                micro.append(model(mb))
            torch.stack(micro).mean().backward()
            optimizer.step()
            batch["loss"] = micro
        """,
    "epoch-level-metrics": """
        def train_one_epoch(model, loader, opt):
            total = 0.0
            for x, y in loader:
                opt.zero_grad()
                loss = model(x, y)
                loss.backward()
                opt.step()
                total += loss.item()
            return total / len(loader)

        history, epoch_losses, preds = [], [], []
        for epoch in range(10):
            train_loss = train_one_epoch(model, loader, opt)
            val_loss = evaluate(model, val_loader)
            history.append((train_loss, val_loss))
            losses = []
            epoch_losses.append(losses)
            for x, y in val_loader:
                _, predicted = model(x).max(1)
                preds.append(predicted)
                correct += predicted.eq(y).sum()
                preds.append(torch.argmax(model(x), dim=1))
        """,
    "accelerate-gan-and-lightning": """
        for epoch in range(num_epochs):
            for step, batch in enumerate(train_dataloader):
                outputs = model(**batch)
                total_loss += outputs.loss.detach().float()
                accelerator.backward(outputs.loss)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            for step, batch in enumerate(eval_dataloader):
                with torch.no_grad():
                    outputs = model(**batch)
                losses.append(accelerator.gather_for_metrics(outputs.loss.repeat(8)))

        for real, _ in loader:                    # two optimizers, cleared via the nets
            netD.zero_grad()
            errD = criterion(netD(real), ones) + criterion(netD(netG(noise).detach()), zeros)
            errD.backward()
            optD.step()
            netG.zero_grad()
            errG = criterion(netD(netG(noise)), ones)
            errG.backward()
            optG.step()
            G_losses.append(errG.item())

        class Lit:
            def training_step(self, batch, batch_idx):
                loss = F.cross_entropy(self(batch[0]), batch[1])
                self.log("train_loss", loss)
                self.train_outputs.append(loss.detach())
                return loss

            def validation_step(self, batch, batch_idx):
                self.val_outputs.append(self.model(batch))
        """,
    "loss-helper-and-forward-sums": """
        def deep_supervision_loss(outputs, target):
            total = 0
            for out in outputs:
                total = total + criterion(out, target)
            return total
        """,
    "retain-graph-outside-loop": """
        loss.backward(retain_graph=True)
        aux.backward()
        """,
    "pinned-non-blocking": """
        loader = DataLoader(ds, batch_size=64, pin_memory=True, num_workers=4)
        for x, y in loader:
            x = x.to(device, non_blocking=True)

        def get_batch():
            x = torch.randint(10, (4, 8))
            return x.pin_memory().to("cuda", non_blocking=True)
        """,
    "non-blocking-device-to-device-and-to-host": """
        def unscale(grads, found_inf, scale):
            for g in grads:
                g.mul_(scale.to(g.device, non_blocking=True))
            return found_inf.to(device=scale.device, non_blocking=True)

        for x in loader:
            host = x.to(device="cpu", non_blocking=True)
            host2 = x.to("cpu", non_blocking=True)
        """,
    "model-moved-once-and-checkpoints-complete": """
        import torch
        model.to(device)
        optimizer = torch.optim.AdamW(model.parameters())
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            model.train()
            optimizer.zero_grad()
            criterion(model(x), y).backward()
            optimizer.step()
            net = DDP(model.cuda(), device_ids=[0])
        torch.save(model.state_dict(), "weights.pt")
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "step": 10}, "ckpt.pt")
        torch.save({"model": model.state_dict(), "opt": optimizer.state_dict()}, "c2.pt")
        torch.save({"model": model.state_dict(), **extra}, "c3.pt")
        """,
    "export-without-optimizer-in-file": """
        import torch
        torch.save({"model": model.state_dict(), "config": cfg}, "export.pt")
        """,
}


@pytest.mark.parametrize("name", sorted(CLEAN_IDIOMS))
def test_clean_idioms_have_no_findings(name):
    findings = lint_source(textwrap.dedent(CLEAN_IDIOMS[name]), "t.py")
    assert findings == [], [(f.rule, f.location, f.message) for f in findings]


def test_clean_fixture_file():
    assert lint_paths([CLEAN]) == []


# ----------------------------------------------------------------------------- suppressions
SUPPRESSED = """\
import torch
a = torch.load("a.pt")  # torchledger: ignore[TL-LINT-003]
# torchledger: ignore[TL-LINT-003]
b = torch.load("b.pt")
c = torch.load("c.pt")  # torchledger: ignore
d = torch.load("d.pt")  # torchledger: ignore[TL-LINT-001, TL-LINT-003]
e = torch.load("e.pt")  # torchledger: ignore[TL-LINT-001]
f = torch.load("f.pt")  # torchledger: ignore[tl-lint-003]
g = torch.load("g.pt")
h = torch.load("h.pt")  # noqa
"""


def test_suppression_comments():
    # line 7 names another rule; line 9 is below a *code* line with a trailing comment, which
    # does not carry over; line 10 uses another tool's comment.
    assert found(SUPPRESSED) == {("TL-LINT-003", 7), ("TL-LINT-003", 9), ("TL-LINT-003", 10)}


def test_suppression_on_a_loop_line():
    source = textwrap.dedent(BAD["002-zero-grad-before-loop-only"]).replace(
        "# expect: TL-LINT-002", "# torchledger: ignore[TL-LINT-002]")
    assert found(source) == set()


def test_suppression_spans_a_wrapped_call_but_not_a_loop_body():
    source = textwrap.dedent("""\
        import torch
        ckpt = torch.load(
            path, map_location="cpu",
        )  # torchledger: ignore[TL-LINT-003]
        for x, y in loader:
            loss = model(x, y)  # torchledger: ignore[TL-LINT-002]
            loss.backward()
            optimizer.step()
        """)
    assert found(source) == {("TL-LINT-002", 5)}


# ----------------------------------------------------------------------------- API edges
def test_syntax_error_names_file_and_line():
    with pytest.raises(LintError, match=r"^broken\.py:3: not valid Python"):
        lint_source("x = 1\ny = 2\ndef (:\n", "broken.py")


def test_missing_path_raises():
    with pytest.raises(LintError, match="no such file"):
        lint_paths(["does/not/exist.py"])


def test_directories_are_walked_skipping_hidden_and_venvs(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "train.py").write_text("import torch\ntorch.load('x')\n")
    (tmp_path / "pkg" / "notes.txt").write_text("torch.load('x')\n")
    for skipped in (".git", ".venv", "venv", "__pycache__", "site-packages"):
        (tmp_path / skipped).mkdir()
        (tmp_path / skipped / "bad.py").write_text("def (:\n")
    (tmp_path / "top.py").write_text("x = 1\n")
    files = python_files([str(tmp_path), str(tmp_path / "top.py")])
    relative = [os.path.relpath(f, tmp_path) for f in files]
    assert relative == ["top.py", os.path.join("pkg", "train.py")]
    assert [f.rule for f in lint_paths([str(tmp_path)])] == ["TL-LINT-003"]


def test_rules_table_and_docs_agree():
    with open(os.path.join(REPO, "docs", "lint-rules.md")) as f:
        docs = f.read()
    for rule, (severity, title, doc, anchor) in RULES.items():
        assert severity in ("error", "warning", "info") and title and doc
        assert f"## {rule}" in docs, f"{rule} is not documented in docs/lint-rules.md"
        assert f"torchledger: ignore[{rule}]" in docs
    fired = {rule for name in BAD for rule, _ in expected(textwrap.dedent(BAD[name]))}
    assert fired == set(RULES), "every rule has a bad snippet"


def test_whole_repository_lints_without_crashing():
    findings = lint_paths([os.path.join(REPO, "torchledger"), os.path.join(REPO, "tests")])
    assert all(f.rule in RULES and f.location for f in findings)


def test_lint_imports_no_torch():
    code = ("import sys, torchledger.lint, torchledger.cli.lint; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


# ----------------------------------------------------------------------------- SARIF builder
def test_sarif_builder_accepts_audit_findings():
    # one writer for lint and audit: lint's rules listed first, then the rules findings name
    findings = [Finding("TL-COPY-001", "info", "copy", module="layers.0"),
                {"rule": "TL-LINT-003", "severity": "warning", "message": "m",
                 "location": "a b/t.py:2", "hint": "h"}]
    log = findings_to_sarif(findings, rules=list(RULES))
    run = log["runs"][0]
    descriptors = run["tool"]["driver"]["rules"]
    ids = [r["id"] for r in descriptors]
    assert ids[:len(RULES)] == list(RULES) and ids[-1] == "TL-COPY-001"
    lint_003 = descriptors[ids.index("TL-LINT-003")]
    assert lint_003["shortDescription"]["text"] == RULES["TL-LINT-003"].title
    assert lint_003["fullDescription"]["text"] == RULES["TL-LINT-003"].doc
    assert RULES["TL-LINT-003"].anchor in lint_003["help"]["text"]
    (located,) = run["results"]
    assert ids[located["ruleIndex"]] == "TL-LINT-003" and located["level"] == "warning"
    physical = located["locations"][0]["physicalLocation"]
    assert physical == {"artifactLocation": {"uri": "a%20b/t.py"}, "region": {"startLine": 2}}
    assert located["message"]["text"] == "m. Hint: h"          # the one message format
    # a finding naming only a module, with no source file given, is a tool notification
    (note,) = run["invocations"][0]["toolExecutionNotifications"]
    assert note["associatedRule"] == {"id": "TL-COPY-001", "index": ids.index("TL-COPY-001")}
    assert note["level"] == "note" and note["properties"]["module"] == "layers.0"


# ----------------------------------------------------------------------------- CLI
def lint(*args):
    return CliRunner().invoke(cli, ["lint", *args])


def test_cli_table_clean_and_leaky():
    r = lint(CLEAN)
    assert r.exit_code == 0 and r.stdout.strip() == "No findings in 1 file."
    r = lint(LEAKY, CLEAN)
    assert r.exit_code == 1
    lines = r.stdout.strip().splitlines()
    assert lines[0].startswith(f"{LEAKY}:10: error TL-LINT-002 ")
    assert lines[1].startswith(f"{LEAKY}:15: warning TL-LINT-001 ") and lines[1].endswith(")")
    assert lines[-1] == "2 findings (1 error, 1 warning) in 2 files."


@pytest.mark.parametrize("fail_on, code", [("error", 1), ("warning", 1), ("info", 1), ("never", 0)])
def test_cli_fail_on_with_an_error(fail_on, code):
    assert lint(LEAKY, "--fail-on", fail_on).exit_code == code


def test_cli_fail_on_thresholds(tmp_path):
    info_only = tmp_path / "info.py"
    info_only.write_text("for x in loader:\n    x = x.cuda(non_blocking=True)\n")
    assert lint(str(info_only)).exit_code == 0                   # default: warning
    assert lint(str(info_only), "--fail-on", "info").exit_code == 1
    warning_only = tmp_path / "warn.py"
    warning_only.write_text("import torch\ntorch.load('a.pt', weights_only=False)\n")
    assert lint(str(warning_only), "--fail-on", "error").exit_code == 0
    assert lint(str(warning_only)).exit_code == 1


def test_cli_json():
    r = lint(LEAKY, CLEAN, "--format", "json")
    assert r.exit_code == 1
    out = json.loads(r.stdout)                                   # one object, nothing else
    assert out["schema"] == "torchledger.lint/1" and out["files"] == 2
    assert [(f["rule"], f["location"]) for f in out["findings"]] == [
        ("TL-LINT-002", f"{LEAKY}:10"), ("TL-LINT-001", f"{LEAKY}:15")]
    assert set(out["findings"][0]) >= {"rule", "severity", "message", "module", "location", "hint"}
    assert json.loads(lint(CLEAN, "--format", "json").stdout)["findings"] == []


def test_cli_sarif_has_the_required_keys():
    r = lint(LEAKY, "--format", "sarif")
    assert r.exit_code == 1
    log = json.loads(r.stdout)
    assert log["version"] == "2.1.0" and "sarif" in log["$schema"]
    run = log["runs"][0]
    driver = run["tool"]["driver"]
    assert driver["name"] == "torchledger"
    assert {r["id"] for r in driver["rules"]} == set(RULES)
    assert all(r["shortDescription"]["text"] for r in driver["rules"])
    levels = {res["ruleId"]: res["level"] for res in run["results"]}
    assert levels == {"TL-LINT-002": "error", "TL-LINT-001": "warning"}
    for res in run["results"]:
        assert res["message"]["text"]
        loc = res["locations"][0]["physicalLocation"]
        assert not loc["artifactLocation"]["uri"].startswith("/")
        assert loc["artifactLocation"]["uri"].endswith("tests/data/lint/leaky_loop.py")
        assert loc["region"]["startLine"] in (10, 15)


def test_cli_directory(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "b.py").write_text("y = 2\n")
    r = lint(str(tmp_path))
    assert r.exit_code == 0 and r.stdout.strip() == "No findings in 2 files."


@pytest.mark.parametrize("make", ["missing", "syntax"])
def test_cli_bad_input_is_one_line_exit_2(tmp_path, make):
    if make == "missing":
        path, needle = str(tmp_path / "nope.py"), "no such file or directory"
    else:
        path, needle = str(tmp_path / "broken.py"), "broken.py:2: not valid Python"
        (tmp_path / "broken.py").write_text("import torch\nfor x in loader\n    pass\n")
    r = lint(path, "--format", "json")
    assert r.exit_code == 2
    if make == "missing":                       # nothing to lint: nothing on stdout
        assert r.stdout == ""
    else:                                       # the file is skipped; the (empty) result printed
        assert json.loads(r.stdout)["findings"] == [] and len(json.loads(r.stdout)["errors"]) == 1
    assert len(r.stderr.strip().splitlines()) == 1 and needle in r.stderr
    assert "Traceback" not in r.stderr


def test_cli_requires_a_path():
    r = lint()
    assert r.exit_code == 2 and "Traceback" not in r.stderr


def test_step_function_filling_a_module_level_list():
    from torchledger.lint import lint_source
    src = (
        "losses = []\n"
        "def step(model, x, opt):\n"
        "    loss = model(x)\n"
        "    loss.backward()\n"
        "    opt.step()\n"
        "    opt.zero_grad()\n"
        "    losses.append(loss)\n"
        "def log(model, x):\n"
        "    out = model(x)\n"
        "    losses.append(out)\n"          # not a training step: no backward/step here
    )
    found = [f for f in lint_source(src, "t.py") if f.rule == "TL-LINT-001"]
    assert [f.location for f in found] == ["t.py:7"]
    clean = src.replace("losses.append(loss)", "losses.append(loss.item())")
    assert [f for f in lint_source(clean, "t.py") if f.rule == "TL-LINT-001"] == []


# -- found on transformers' source (probe 3): TL-LINT-004 misses and false positives ------------
BAD_REAL = {
    "004-data-dependent-shapes": """
        import sys
        import torch
        from torch import nn
        from typing import Literal

        class Bad(nn.Module):
            def forward(self, x):
                y = x[x > 0]  # expect: TL-LINT-004
                u = torch.unique(x)  # expect: TL-LINT-004
                z = torch.masked_select(x, x > 0)  # expect: TL-LINT-004
                r = torch.repeat_interleave(x.long().flatten())  # expect: TL-LINT-004
                keep = x.abs() > 1
                w = x[keep]  # expect: TL-LINT-004
                v = x.repeat_interleave(x.long())  # expect: TL-LINT-004
                q = x.unique(sorted=True)  # expect: TL-LINT-004
                idx = torch.where(x > 0)  # expect: TL-LINT-004
                d = x.to(device="cpu")  # expect: TL-LINT-004
                x[x > 0] = 0
                a = x.repeat_interleave(2, dim=0)
                b = torch.repeat_interleave(x, 3)
                c = x.repeat_interleave(x.long(), output_size=8)
                e = torch.where(x > 0, x, 0)
                return x
        """,
    "001-still-found-after-the-fixes": """
        class Trainer:
            def training_step(self, batch):
                loss = self.compute_loss(self.model, batch)
                loss.backward()
                self.optimizer.step()
                self.optimizer.zero_grad()
                self.losses.append(loss)  # expect: TL-LINT-001

        hist = {}
        for step, batch in enumerate(train_loader):
            optimizer.zero_grad()
            loss = loss_fn(model(batch), batch)
            loss.backward()
            optimizer.step()
            hist[step] = loss  # expect: TL-LINT-001
        """,
}

CLEAN_REAL = {
    "001-not-a-kept-graph": """
        import torch

        class EvalPrediction:
            def __init__(self, predictions, losses=None):
                self.losses = losses
                self.elements = (predictions,)
                if losses is not None:
                    self.elements += (self.losses,)

        def list_models(self):
            loaded_models = {}
            for name in self.loaded_models:
                owned_by = model_owner(name)
                loaded_models[name] = {"owned_by": owned_by, "id": name}
            return loaded_models

        def batch_decode(self, sequences, batch_size):
            dec_strs = []
            for index in range(batch_size):
                pred = self.decoder(sequences[index])
                pred = pred[: pred.find("[s]")]
                dec_strs.append(pred)
            return dec_strs

        class Trainer:
            def training_step_loop(self, train_dataloader):
                for batch in train_dataloader:
                    tr_loss_step = self.training_step(self.model, batch)
                    if torch.isnan(tr_loss_step):
                        self._tr_loss += self._tr_loss / (1 + self.state.global_step)
                    else:
                        self._tr_loss += tr_loss_step.detach()
                    self.optimizer.step()
                    self.optimizer.zero_grad()

        class Processor:
            def __call__(self, input_ids, scores):
                out = self.model(input_ids, cache=self.context["cache"])
                self.context["cache"] = out.get("cache", None)
                self.kwargs["attention_mask"] = self.kwargs.get("mask", torch.ones(3))
                return out.logits
        """,
    "004-python-values-in-forward": """
        import sys
        from typing import Literal
        from torch import nn

        class Fine(nn.Module):
            def forward(self, outputs, z, hidden_states, cached_frames: int | None = None,
                        mode: Literal["train", "inference"] | None = None, cache: "Cache | None" = None,
                        key_value_states=None, no_recycles=None, input_dimensions: tuple[int, int] = None,
                        patch_height=None):
                if "auxiliary_outputs" in outputs:
                    pass
                if "denoising_meta_values" not in outputs:
                    pass
                assert sys.getrefcount(z[0]) == 2
                seq_length = hidden_states.shape[1] + (cached_frames if cached_frames is not None else 0)
                if seq_length > self.max_position_embeddings:
                    pass
                if no_recycles is None:
                    no_recycles = self.config.max_recycles
                if no_recycles < 0:
                    pass
                mode = mode or self.config.mode
                if "train" in mode:
                    pass
                is_cross_attention = key_value_states is not None
                is_updated = cache.is_updated.get(self.layer_idx) if cache is not None else False
                if is_cross_attention and cache and is_updated:
                    pass
                if cache.get_seq_length() > 0:
                    pass
                height, width = input_dimensions
                pad_right = (self.window_size - width % self.window_size) % self.window_size
                pad_values = (0, 0, 0, pad_right, 0, 0)
                was_padded = pad_values[3] > 0 or pad_values[5] > 0
                if was_padded:
                    pass
                n = int(patch_height * self.patch_size)
                return hidden_states
        """,
}


@pytest.mark.parametrize("name", sorted(BAD_REAL))
def test_real_code_misses_are_found(name):
    source = textwrap.dedent(BAD_REAL[name])
    assert found(source) == expected(source)


@pytest.mark.parametrize("name", sorted(CLEAN_REAL))
def test_real_code_false_positives_stay_quiet(name):
    findings = lint_source(textwrap.dedent(CLEAN_REAL[name]), "t.py")
    assert findings == [], [(f.rule, f.location, f.message) for f in findings]


# -- issue 20 item 6: false findings read by hand on pytorch/examples, Lightning and transformers
# (minimal copies of the code shapes, written here), and the true findings beside them ----------
CLEAN_ISSUE20 = {
    "002-distributed-autograd-context": """
        import torch.distributed.autograd as dist_autograd

        def run_trainer(model, criterion, opt, batches):
            for epoch in range(100):
                for indices, target in batches():
                    with dist_autograd.context() as context_id:
                        loss = criterion(model(indices), target)
                        dist_autograd.backward(context_id, [loss])
                        opt.step(context_id)       # grads live in the context: nothing to clear
        """,
    "009-plain-sgd-has-no-state": """
        import torch

        class Trainer:
            def __init__(self, model, optimizer: torch.optim.Optimizer):
                self.model, self.optimizer = model, optimizer

            def _save_snapshot(self, epoch):
                snapshot = {"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch}
                torch.save(snapshot, "snapshot.pt")

        def main():
            model = Net()
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
            Trainer(model, optimizer)
        """,
    "001-smoothed-value-of-item": """
        class LearningRateFinder:
            def on_train_batch_end(self, trainer, outputs):
                loss_tensor = outputs["loss"]
                current_loss = loss_tensor.item()
                self.avg_loss = self.beta * self.avg_loss + (1 - self.beta) * current_loss
                smoothed_loss = self.avg_loss / (1 - self.beta ** (trainer.global_step + 1))
                if smoothed_loss < self.best_loss:
                    self.best_loss = smoothed_loss
                self.losses.append(smoothed_loss)
        """,
    "004-ints-read-from-sizes": """
        from torch import nn

        class VideoEmbeddings(nn.Module):
            def forward(self, pixel_values):
                embeddings, num_frames, patch_width = self.patch_embeddings(pixel_values)
                if embeddings.size(1) != self.position_embeddings.size(1):
                    embeddings = embeddings[:, :1]
                if num_frames != self.time_embeddings.size(1):
                    embeddings = embeddings * 2
                return embeddings

        class WindowLayer(nn.Module):
            def forward(self, hidden_states, input_dimensions: tuple[int, int]):
                height, width = input_dimensions
                hidden_states, pad_values = self.maybe_pad(hidden_states, height, width)
                was_padded = pad_values[3] > 0 or pad_values[5] > 0
                if was_padded:
                    hidden_states = hidden_states[:, :height, :width, :]
                return hidden_states
        """,
}

BAD_ISSUE20 = {
    "002-a-context-that-is-not-distributed-autograd": """
        import torch

        for x, y in loader:
            with torch.autocast("cuda"):  # the loop below is reported on its `for` line
                loss = criterion(model(x), y)
            loss.backward()
            optimizer.step()
        """,
    "009-sgd-with-momentum-or-a-scheduler": """
        import torch
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        torch.save({"model": model.state_dict()}, "m.pt")  # expect: TL-LINT-009
        """,
    "009-plain-sgd-with-a-scheduler": """
        import torch
        optimizer = torch.optim.SGD(model.parameters(), 0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 30)
        torch.save({"model": model.state_dict()}, "m.pt")  # expect: TL-LINT-009
        """,
    "009-plain-sgd-with-a-warmup-schedule": """
        import torch
        from transformers import get_linear_schedule_with_warmup
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scheduler = get_linear_schedule_with_warmup(optimizer, 10, 100)
        torch.save({"model": model.state_dict()}, "m.pt")  # expect: TL-LINT-009
        """,
    "001-smoothed-value-of-a-loss-tensor": """
        class Smoother:
            def on_train_batch_end(self, batch):
                loss = self.model(batch)
                self.avg_loss = self.beta * self.avg_loss + (1 - self.beta) * loss
                smoothed_loss = self.avg_loss / 2
                self.losses.append(smoothed_loss)  # expect: TL-LINT-001
        """,
    "004-a-tensor-compared-with-a-size": """
        from torch import nn

        class Counts(nn.Module):
            def forward(self, x, mask):
                num_kept = mask.sum()
                if num_kept != x.size(0):  # expect: TL-LINT-004
                    x = x * 2
                return x
        """,
}


@pytest.mark.parametrize("name", sorted(CLEAN_ISSUE20))
def test_issue20_false_findings_stay_quiet(name):
    findings = lint_source(textwrap.dedent(CLEAN_ISSUE20[name]), "t.py")
    assert findings == [], [(f.rule, f.location, f.message) for f in findings]


@pytest.mark.parametrize("name", sorted(BAD_ISSUE20))
def test_issue20_true_findings_are_kept(name):
    source = textwrap.dedent(BAD_ISSUE20[name])
    want = expected(source) or {("TL-LINT-002", 4)}      # the autocast loop: its `for` line
    assert found(source) == want
