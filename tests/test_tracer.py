"""The tracer against hand-checked numbers, closed forms and PyTorch's own trackers."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import torchledger
from torchledger.models import build_model, example_inputs, get_config
from torchledger.record import StepRecord


def train_step(model, opt, inputs):
    loss = model(**inputs)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def traced_gpt(device: str, name="gpt2-tiny", batch=2, seq=16, **overrides):
    """Trace one AdamW step of a preset on cpu, fake (CPU) or meta tensors."""
    cfg = get_config(name).replace(**overrides) if overrides else get_config(name)
    torch.manual_seed(0)
    fake = FakeTensorMode() if device == "fake" else None
    if fake:
        fake.__enter__()
    try:
        dev = "meta" if device == "meta" else None
        model = build_model(cfg, device=dev)
        opt = torch.optim.AdamW(model.parameters())
        inputs = example_inputs(cfg, batch=batch, seq_len=seq, device=dev)
        with torchledger.trace(model, optimizer=opt, tokens=batch * seq) as t:
            train_step(model, opt, inputs)
    finally:
        if fake:
            fake.__exit__(None, None, None)
    return cfg, t.record


def linear_weights(cfg) -> int:
    """Parameters that take part in matmuls: every Linear weight (the tied LM head included)."""
    d, kv = cfg.d_model, cfg.n_kv_heads * cfg.head_dim
    per_layer = 2 * d * d + 2 * d * kv + (3 if cfg.mlp == "swiglu" else 2) * d * cfg.d_ff
    return cfg.n_layers * per_layer + cfg.vocab_size * d


@pytest.mark.parametrize("device", ["cpu", "fake", "meta"])
@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_step_flops_equal_6nd_plus_attention(device, name):
    B, T = 2, 16
    cfg, rec = traced_gpt(device, name, B, T)
    N, D = linear_weights(cfg), B * T
    attention = 12 * cfg.n_layers * T * cfg.d_model * D       # dense, per ACCOUNTING sec 3
    assert rec.totals["matmul_params"] == N
    assert rec.totals["flops"]["total"] == 6 * N * D + attention
    assert rec.totals["flops"]["forward"] == 2 * N * D + attention // 3
    assert rec.totals["flops"]["backward"] == 2 * rec.totals["flops"]["forward"]
    assert rec.predictions["flops_6nd"] == 6 * N * D
    assert rec.uncounted_ops == []
    assert rec.totals["attention_flops"]["dense"] == attention
    assert rec.totals["attention_flops"]["causal"] == attention // 2
    # fake CPU tensors run the CPU flash kernel; meta runs SDPA's math path (bmm + softmax)
    kernel = "SDPA math path (bmm + softmax)" if device == "meta" else "CPU flash attention"
    assert rec.meta["attention_kernels"] == [kernel]


def test_cruncher_forward_and_backward_by_hand():
    # Course model: x (B, D) -> L x (D, D) -> (D, 1). B=4, D=8, L=3.
    B, D, L = 4, 8, 3
    model = build_model(get_config("cruncher").replace(dim=D, num_layers=L))
    x = torch.randn(B, D)
    with torchledger.trace(model) as t:
        model(x).sum().backward()
    f = t.record.totals["flops"]
    assert f["forward"] == 2 * B * D * D * L + 2 * B * D * 1          # 2*4*8*8*3 + 2*4*8 = 1600
    # backward = 2x forward, less the first layer's input grad (x needs none): 2*B*D*D
    assert f["backward"] == 2 * f["forward"] - 2 * B * D * D          # 3200 - 512 = 2688
    mods = {m["name"]: m for m in t.record.modules}
    assert mods["layers.0"]["flops_forward"] == 2 * B * D * D         # 512
    assert mods["layers.0"]["flops_backward"] == 2 * B * D * D        # weight grad only
    assert mods["layers.1"]["flops_backward"] == 4 * B * D * D
    assert mods["final"]["flops_forward"] == 2 * B * D                # 64
    assert mods[""]["flops_forward"] == f["forward"]


def test_traced_step_is_bitwise_identical_to_untraced():
    def run(traced: bool):
        torch.manual_seed(0)
        model = build_model("llama-tiny")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(2):
            inputs = example_inputs("llama-tiny", batch=2, seq_len=8)
            if traced:
                with torchledger.trace(model, optimizer=opt):
                    train_step(model, opt, inputs)
            else:
                train_step(model, opt, inputs)
        return [p.detach().clone() for p in model.parameters()]
    for a, b in zip(run(False), run(True)):
        assert torch.equal(a, b)


def test_exception_inside_step_leaves_nothing_installed():
    from conftest import hook_state
    before = hook_state()
    model = build_model("gpt2-tiny")
    bad = {"idx": torch.randint(0, 512, (1, 200))}                   # 200 > 128 positions
    with pytest.raises(ValueError, match="exceeds"):
        with torchledger.trace(model) as t:
            model(**bad)
    assert hook_state() == before
    assert t.record is not None and t.record.meta["failed"]
    model(torch.randint(0, 512, (1, 8)))                              # model still works
    assert model_hooks(model) == {}


def model_hooks(model) -> dict:
    """Hooks a tracer could leave on the user's own objects (the leak guard sees global ones)."""
    left = {}
    for name, mod in model.named_modules():
        for kind in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"):
            if getattr(mod, kind, None):
                left[f"{name or '(root)'}.{kind}"] = len(getattr(mod, kind))
    for name, p in model.named_parameters():
        if getattr(p, "_post_accumulate_grad_hooks", None):
            left[f"{name}._post_accumulate_grad_hooks"] = len(p._post_accumulate_grad_hooks)
    return left


def test_a_finished_step_leaves_no_hooks_on_the_model():
    model = build_model("gpt2-tiny")
    opt = torch.optim.AdamW(model.parameters())
    inputs = example_inputs("gpt2-tiny", batch=1, seq_len=8)
    with torchledger.trace(model, optimizer=opt):
        assert model_hooks(model)                                     # installed while tracing
        model(**inputs).backward()
        opt.step()
    assert model_hooks(model) == {}


def test_second_trace_is_a_clear_error():
    model = build_model("cruncher")
    with torchledger.trace(model):
        with pytest.raises(RuntimeError, match="already active"):
            with torchledger.trace(model):
                pass


def test_trace_rejects_bad_arguments():
    with pytest.raises(TypeError, match="nn.Module"):
        torchledger.trace("not a model")
    with pytest.raises(ValueError, match="tokens"):
        torchledger.trace(build_model("cruncher"), tokens=-3)
    with pytest.raises(TypeError, match="optimizer= a torch.optim.Optimizer.*got int"):
        torchledger.trace(build_model("cruncher"), optimizer=5)
    with pytest.raises(TypeError, match="got list"):
        torchledger.Ledger(build_model("cruncher"), optimizer=[])


def test_activation_bytes_are_unique_saved_storages_without_params():
    model = build_model("cruncher")
    x = torch.randn(4, 128)
    seen, params = {}, {p.untyped_storage()._cdata for p in model.parameters()}

    def pack(t):
        s = t.untyped_storage()
        if s._cdata not in params:
            seen[s._cdata] = s.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).sum()
    with torchledger.trace(model) as t:
        model(x).sum().backward()
    assert t.record.totals["activation_bytes"] == sum(seen.values())
    # Cruncher saves each layer's input: x and L outputs of (4, 128) float32 = 5 * 2048 bytes
    assert t.record.totals["activation_bytes"] == 5 * 4 * 128 * 4


@pytest.mark.parametrize("what", ["batch", "layers"])
def test_activation_bytes_grow_linearly(what):
    def act(k):
        kw = {"batch": 2 * k} if what == "batch" else {"batch": 2, "n_layers": 2 * k}
        batch = kw.pop("batch")
        _, rec = traced_gpt("fake", "llama-tiny", batch, 16, **kw)
        return rec.totals["activation_bytes"]
    a1, a2, a3 = act(1), act(2), act(3)
    assert a2 - a1 == a3 - a2 > 0


def test_modules_attribution_and_calls():
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 6, bias=False)

        def forward(self, x):
            return self.lin(self.lin(x)).sum()               # same module called twice; returns loss
    model = Shared()
    x = torch.randn(4, 6)
    with torchledger.trace(model) as t:
        model(x).backward()
    mods = {m["name"]: m for m in t.record.modules}
    assert mods["lin"]["calls"] == 2
    assert mods["lin"]["flops_forward"] == 2 * (2 * 4 * 6 * 6)           # 576
    # backward: second call needs input and weight grads, first only weight grad
    assert mods["lin"]["flops_backward"] == 3 * (2 * 4 * 6 * 6)
    # the root's own backward (the sum) is attributed to the root even though forward returned the loss
    root_bwd = [o for o in t.record.ops if o["module"] == "" and o["phase"] == "backward"]
    assert root_bwd, "root module got no backward ops"


def test_copies_are_found_with_the_users_line():
    class Permuter(nn.Module):
        def forward(self, x):
            y = x.transpose(0, 1).contiguous()              # COPY-LINE
            return (y * 2).sum()
    x = torch.randn(8, 16, requires_grad=True)
    model = Permuter()
    with torchledger.trace(model) as t:
        model(x).backward()
    copies = [c for c in t.record.copies if c["phase"] == "forward"]
    assert len(copies) == 1
    c = copies[0]
    line = next(i for i, s in enumerate(open(__file__).read().splitlines(), 1) if "# COPY-LINE" in s
                and "transpose" in s)
    assert c["location"].endswith(f"test_tracer.py:{line}")
    assert c["bytes"] == 8 * 16 * 4 and c["reason"] == "contiguous of non-contiguous"
    assert c["src_stride"] == [1, 16]


def test_dtype_round_trip_copies():
    class RoundTrip(nn.Module):
        def forward(self, x):
            return x.to(torch.bfloat16).to(torch.float32).sum()
    with torchledger.trace(RoundTrip()) as t:
        RoundTrip()(torch.randn(4, 4))
    reasons = sorted(c["reason"] for c in t.record.copies)
    assert reasons == ["dtype bfloat16->float32", "dtype float32->bfloat16"]


OPTIMIZERS = {
    "SGD": (lambda p: torch.optim.SGD(p, lr=0.1), 0),
    "SGD-momentum": (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), 4),
    "Adam": (lambda p: torch.optim.Adam(p), 8),
    "AdamW": (lambda p: torch.optim.AdamW(p), 8),
    "Adagrad": (lambda p: torch.optim.Adagrad(p), 4),
    "RMSprop": (lambda p: torch.optim.RMSprop(p), 4),
    "Adamax": (lambda p: torch.optim.Adamax(p), 8),
    "NAdam": (lambda p: torch.optim.NAdam(p), 8),
    "RAdam": (lambda p: torch.optim.RAdam(p), 8),
    "Adadelta": (lambda p: torch.optim.Adadelta(p), 8),
    "ASGD": (lambda p: torch.optim.ASGD(p), 4),
    "Rprop": (lambda p: torch.optim.Rprop(p), 8),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_state_per_param(name):
    make, expected = OPTIMIZERS[name]
    model = build_model("cruncher")
    opt = make(model.parameters())
    x = torch.randn(4, 128)
    with torchledger.trace(model, optimizer=opt) as t:
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    o = t.record.optimizer
    n = t.record.totals["params"]
    tensor_state = sum(e["bytes"] for e in o["state"] if e["numel"] > e["tensors"])  # exclude scalars
    assert tensor_state == expected * n
    by_hand = sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
                  if isinstance(v, torch.Tensor))          # every state tensor, scalars included
    assert t.record.totals["optimizer_state_bytes"] == o["state_bytes"] == by_hand
    assert o["names"] == [type(opt).__name__]


def test_optimizer_phase_and_state_category_at_peak():
    _, rec = traced_gpt("cpu", "gpt2-tiny", 2, 16)
    assert rec.meta["phases"] == ["forward", "backward", "optimizer"]
    n = rec.totals["params"]
    # AdamW's first step allocates exp_avg and exp_avg_sq: 8 bytes/param, plus 4 per step scalar
    assert rec.memory["end_breakdown"]["optimizer_state"] == 8 * n + 4 * len(list(
        build_model("gpt2-tiny").parameters()))
    cats = rec.memory["peak_breakdown"]
    # the peak is in AdamW's single-tensor update of the largest tensor, wte (512 x 64 fp32 =
    # 131,072 bytes): exp_avg_sq.sqrt() and its division by the bias correction alive at once
    assert (rec.totals["peak_phase"], rec.totals["peak_module"]) == ("optimizer", "(optimizer)")
    assert cats == {"parameters": 4 * n, "gradients": 4 * n, "buffers": 0,
                    "optimizer_state": 8 * n,                    # exp_avg + exp_avg_sq
                    "activations": 2 * (2 * 16 * 8),             # idx and targets: int64 (2, 16)
                    "temporaries": 2 * 512 * 64 * 4 + 4}         # sqrt, div; the fp32 loss scalar
    assert rec.totals["peak_bytes"] == 16 * n + 512 + 262_144 + 4 == 2_519_556


def test_peak_matches_pytorch_memtracker():
    mem_tracker = pytest.importorskip("torch.distributed._tools.mem_tracker")

    def make():
        torch.manual_seed(0)
        model = build_model("gpt2-tiny")
        return model, torch.optim.AdamW(model.parameters()), example_inputs("gpt2-tiny", 4, 32)
    model, opt, inputs = make()
    mt = mem_tracker.MemTracker()
    mt.track_external(model, opt)
    with mt:
        train_step(model, opt, inputs)
    theirs = mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    model, opt, inputs = make()
    with torchledger.trace(model, optimizer=opt) as t:
        train_step(model, opt, inputs)
    ours = t.record.totals["peak_bytes"]
    assert abs(ours - theirs) / theirs < 0.02, (ours, theirs)


def test_activation_checkpointing_is_recompute():
    from torch.utils.checkpoint import checkpoint

    class Ckpt(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(32, 32)
            self.b = nn.Linear(32, 32)

        def forward(self, x):
            return checkpoint(lambda y: self.b(torch.relu(self.a(y))), x, use_reentrant=False).sum()
    from torch.utils.checkpoint import set_checkpoint_early_stop
    model = Ckpt()
    x = torch.randn(8, 32, requires_grad=True)
    one = 2 * 8 * 32 * 32                                                # one linear: 16384
    for early_stop, recomputed in [(False, 2 * one), (True, one)]:
        # early stop: b's output is not needed by backward, so only a (and relu) rerun
        with set_checkpoint_early_stop(early_stop), torchledger.trace(model) as t:
            model(x).backward()
        tot = t.record.totals
        assert tot["flops"]["forward"] == 2 * one
        assert tot["flops"]["backward"] == 4 * one
        assert tot["hardware_flops"] == tot["flops"]["total"] + recomputed
        assert "recompute" in [o["phase"] for o in t.record.ops]
        # only the checkpoint's input is held through the forward; the region saves nothing
        assert tot["activation_bytes"] == 8 * 32 * 4


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_plain_function_is_recompute(reentrant):
    """Checkpointed code that calls no module (no module hook fires while it reruns) is still
    recomputation, not model backward work, and its nodes belong to the calling module."""
    from torch.utils.checkpoint import checkpoint

    class Fn(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(32, 32) / 6)
            self.head = nn.Linear(32, 10, bias=False)

        def fn(self, x):
            return torch.tanh(x @ self.w)

        def forward(self, x):
            return self.head(checkpoint(self.fn, x, use_reentrant=reentrant)).sum()

    model = Fn()
    with torchledger.trace(model) as t:
        model(torch.randn(8, 32, requires_grad=True)).backward()       # reentrant needs it
    tot = t.record.totals
    mm, head = 2 * 8 * 32 * 32, 2 * 8 * 32 * 10                         # 16384, 5120
    assert tot["flops"]["forward"] == mm + head
    assert tot["flops"]["backward"] == 2 * head + 2 * mm                 # dx + dW each
    assert tot["hardware_flops"] == tot["flops"]["total"] + mm            # fn's mm reran once
    rows = {m["name"]: m for m in t.record.modules}
    assert "(no module)" not in rows and rows[""]["flops_backward"] == tot["flops"]["backward"]


def test_create_graph_backward_is_backward_not_recompute():
    # grad mode is on during a create_graph=True backward, as during recomputation
    w = nn.Linear(4, 4, bias=False)
    with torchledger.trace(w) as t:
        (g,) = torch.autograd.grad(w(torch.randn(2, 4)).pow(2).sum(), w.weight, create_graph=True)
    assert "recompute" not in [o["phase"] for o in t.record.ops]
    assert t.record.totals["hardware_flops"] == t.record.totals["flops"]["total"]


def test_grad_bytes_are_the_most_alive_not_what_zero_grad_left():
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))             # 144 + 68 = 212 params
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with torchledger.trace(model, optimizer=opt) as t:
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    tot = t.record.totals
    assert tot["grad_bytes"] == 212 * 4 and tot["grad_bytes_end"] == 0


@pytest.mark.parametrize("need_weights", [True, False])
def test_weights_a_parent_uses_without_calling_their_module(need_weights):
    """nn.MultiheadAttention multiplies by out_proj.weight without calling out_proj: those
    matmuls (forward and backward) are out_proj's, and the totals do not change."""
    class W(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.MultiheadAttention(64, 4, batch_first=True)

        def forward(self, x):
            return self.a(x, x, x, need_weights=need_weights)[0].sum()

    model = W()
    with torchledger.trace(model) as t:
        model(torch.randn(2, 10, 64, requires_grad=True)).backward()
    rows = {m["name"]: m for m in t.record.modules}
    out = 2 * 20 * 64 * 64                                     # 20 rows x 64x64: 163840
    assert (rows["a.out_proj"]["flops_forward"], rows["a.out_proj"]["flops_backward"]) == (out, 2 * out)
    assert rows["a.out_proj"]["calls"] == 0
    # in_proj 2*20*64*192 + out_proj + scores and x V: 2 * (2*2*4*10*10*16)
    fwd = 2 * 20 * 64 * 192 + out + 2 * (2 * 2 * 4 * 10 * 10 * 16)
    assert rows["a"]["flops_forward"] == t.record.totals["flops"]["forward"] == fwd   # 706560


def test_gradient_accumulation_counts_each_micro_batch_once():
    """Micro-batch 2's saved tensors may reuse the addresses micro-batch 1's backward freed:
    they are still new activations (the count was once different run to run)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x, y = torch.randn(64, 128), torch.randint(0, 10, (64,))
    seen = set()
    for _ in range(4):
        xs, ys = [x[:32].clone(), x[32:].clone()], [y[:32].clone(), y[32:].clone()]
        with torchledger.trace(m, optimizer=opt, tokens=64) as t:
            for i in range(2):
                (F.cross_entropy(m(xs[i]), ys[i]) / 2).backward()
            opt.step()
            opt.zero_grad()
        tot = t.record.totals
        seen.add((tot["activation_bytes"], tot["activation_bytes_peak"]))
    # per micro-batch: x 32*128*4 + two ReLU outputs 2*32*256*4 + log_softmax 32*10*4
    # + target 32*8 + total_weight 4 = 16384 + 65536 + 1280 + 256 + 4 = 83460
    # most alive at once: micro-batch 2's 83460 + micro-batch 1's x and y, kept by the lists
    assert seen == {(2 * 83460, 83460 + 16384 + 256)}


def test_batchnorm_running_stats_are_buffers_not_activations():
    bn = nn.BatchNorm1d(8)
    x = torch.randn(4, 8, requires_grad=True)
    with torchledger.trace(bn) as t:
        bn(x).sum().backward()
    # x 4*8*4 = 128 and save_mean + save_invstd 2*8*4 = 64; not running_mean/var (buffers)
    assert t.record.totals["activation_bytes"] == 128 + 64


def test_work_outside_the_model_is_phase_other():
    """Gradient clipping, logging and other no-grad work between backward and the optimizer
    is neither forward nor counted in the model's totals."""
    m = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x, y = torch.randn(4, 64), torch.randint(0, 10, (4,))
    with torchledger.trace(m, optimizer=opt, tokens=4) as t:
        F.cross_entropy(m(x), y).backward()                        # loss outside the model: forward
        gnorm = torch.cat([p.grad.flatten() for p in m.parameters()]).norm()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0, foreach=False)
        opt.step()
        opt.zero_grad()
    tot = t.record.totals
    assert gnorm > 0 and tot["peak_phase"] == "other" and tot["peak_module"] == "(outside the model)"
    ops = {(o["op"], o["phase"]) for o in t.record.ops}
    assert ("aten.nll_loss_forward.default", "forward") in ops
    assert ("aten.linalg_vector_norm.default", "other") in ops
    assert not any(o["phase"] == "forward" and "norm" in o["op"] for o in t.record.ops)
    assert tot["elementwise_flops"]["other"] > 0 and tot["flops"]["other"] == 0
    params = 64 * 64 + 64 + 64 * 10 + 10                           # 4874
    assert tot["flops"]["total"] == 3 * 2 * 4 * (64 * 64 + 64 * 10) - 2 * 4 * 64 * 64
    assert t.record.memory["phase_peaks"]["other"] >= 2 * 4 * params   # params + grads alive


def test_record_round_trips_through_json():
    _, rec = traced_gpt("cpu", "llama-tiny", 2, 8)
    text = rec.to_json()
    back = StepRecord.from_json(text)
    assert back.to_dict() == json.loads(text)
    d = json.loads(text)
    assert d["schema"] == "torchledger/1"
    for key in ("params", "tokens", "flops", "activation_bytes", "optimizer_state_bytes", "param_bytes",
                "grad_bytes", "peak_bytes", "step_seconds", "mfu"):
        assert key in d["totals"]
    for key in ("name", "type", "params", "flops_forward", "flops_backward", "activation_bytes",
                "copy_bytes"):
        assert key in d["modules"][0]
    assert set(d["totals"]["flops"]) == {"forward", "backward", "optimizer", "total", "other"}
    assert not rec.ops_df().empty and not rec.modules_df().empty and not rec.memory_df().empty


def test_saved_records_keep_their_findings():
    """A record saved from trace() or a Ledger renders its findings offline (report)."""
    m = nn.Linear(64, 64)
    x = torch.randn(8, 16, 64)
    with torchledger.trace(m, tokens=128) as t:
        m(x.half().float()).pow(2).mean().backward()      # a dtype round trip: TL-COPY-001
    saved = json.loads(t.record.to_json())["findings"]
    assert [f["rule"] for f in saved] == ["TL-COPY-001"] == [f.rule for f in t.findings()]
    ledger = torchledger.Ledger(m)
    for _ in range(2):
        with ledger.step(tokens=128):
            m(x.half().float()).pow(2).mean().backward()
    assert [f["rule"] for f in ledger.records[-1].to_dict()["findings"]] == \
        [f.rule for f in ledger.findings()]
    assert "TL-COPY-001" in [f["rule"] for f in ledger.records[-1].to_dict()["findings"]]


@pytest.mark.parametrize("clear", ["zero_grad", "mul_0", "foreach_mul_0", "none"])
def test_grads_cleared_by_multiplying_by_zero_are_cleared(clear):
    m = nn.Linear(8, 8)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    ledger = torchledger.Ledger(m, optimizer=opt)
    for _ in range(3):
        with ledger.step(tokens=4):
            m(torch.randn(4, 8)).sum().backward()
            opt.step()
            grads = [p.grad for p in m.parameters()]
            if clear == "zero_grad":
                opt.zero_grad(set_to_none=False)
            elif clear == "mul_0":
                for g in grads:
                    g.mul_(0)
            elif clear == "foreach_mul_0":
                torch._foreach_mul_(grads, 0.0)
    rules = [f.rule for f in ledger.findings()]
    assert ("TL-LEAK-003" in rules) == (clear == "none")
    # the analysis ran on every step (the "none" case is the positive twin)
    assert [r.warnings for r in ledger.records] == [[], [], []]
    assert [r.memory["grads"]["optimizer_steps"] for r in ledger.records] == [1, 1, 1]


def test_from_json_rejects_other_files():
    with pytest.raises(ValueError, match="schema"):
        StepRecord.from_dict({"schema": "other/1"})


def test_ledger_samples_one_step_in_k():
    model = build_model("cruncher")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ledger = torchledger.Ledger(model, optimizer=opt, sample_every=3)
    for _ in range(7):
        with ledger.step(tokens=4):
            model(torch.randn(4, 128)).sum().backward()
            opt.step()
            opt.zero_grad()
    assert ledger.steps == 7
    assert [r.meta["step_index"] for r in ledger.records] == [0, 3, 6]
    assert "module" in ledger.report()


def test_report_renders_and_mentions_kernel():
    _, rec = traced_gpt("cpu", "gpt2-tiny", 2, 16)
    from torchledger.render.table import render_table
    text = render_table(rec)
    assert "CPU flash attention" in text and "blocks.0" in text
    assert render_table(StepRecord()).startswith("Empty record")


def test_mfu_uses_given_peak():
    model = build_model("cruncher")
    ticks = iter([0.0, 0.5])
    with torchledger.trace(model, peak_flops=1e6, clock=lambda: next(ticks)) as t:
        model(torch.randn(4, 128)).sum().backward()
    tot = t.record.totals
    assert tot["step_seconds"] == 0.5
    assert tot["mfu"] == pytest.approx(tot["flops"]["total"] / 0.5 / 1e6, rel=1e-12)


@pytest.mark.parametrize("device", ["cpu", "fake"])
def test_autocast_weight_casts_still_count_as_matmul_params(device):
    fake = FakeTensorMode() if device == "fake" else None
    if fake:
        fake.__enter__()
    try:
        model = build_model("gpt2-tiny")
        inputs = example_inputs("gpt2-tiny", batch=2, seq_len=16)
        with torch.autocast("cpu", dtype=torch.bfloat16), torchledger.trace(model, tokens=32) as t:
            model(**inputs).backward()
    finally:
        if fake:
            fake.__exit__(None, None, None)
    cfg = get_config("gpt2-tiny")
    N = linear_weights(cfg)
    assert t.record.totals["matmul_params"] == N
    assert t.record.totals["flops"]["total"] == 6 * N * 32 + 12 * cfg.n_layers * 16 * cfg.d_model * 32
    casts = [c for c in t.record.copies if c["reason"] == "dtype float32->bfloat16"]
    assert casts, "autocast's weight casts are copies"


def test_views_are_counted_and_confirmed_by_storage():
    model = build_model("cruncher")
    with torchledger.trace(model) as t:
        model(torch.randn(4, 128)).sum().backward()
    views = t.record.totals["view_ops"]
    assert views["forward"] >= 1            # squeeze(-1) of the output is a view, not a copy
    assert t.record.copies == []


def test_bytes_and_peak_by_hand():
    class MM(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(5, 6))

        def forward(self, x):
            return torch.mm(x, self.w)
    model, x = MM(), torch.randn(4, 5)
    with torchledger.trace(model) as t:
        model(x)
    tot, mem = t.record.totals, t.record.memory
    assert tot["flops"]["forward"] == 240                          # 4*6*2*5
    assert tot["bytes_read"] == 4 * 5 * 4 + 5 * 6 * 4              # x 80 + w 120 = 200
    assert tot["bytes_written"] == 4 * 6 * 4                       # y 96
    assert tot["activation_bytes"] == 80                           # mm saves x for w's grad
    # live at the mm: w 120 (parameters) + x 80 (saved: activations) + y 96 (temporaries)
    assert tot["peak_bytes"] == 296
    assert mem["peak_breakdown"] == {"parameters": 120, "buffers": 0, "gradients": 0,
                                     "optimizer_state": 0, "activations": 80, "temporaries": 96}
