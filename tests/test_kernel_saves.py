"""What a fake step keeps for backward is what the GPU's kernels keep (issue 30 item 2).

Fake tensors take CPU's dispatch; where CUDA runs another path that keeps other tensors
(``tracer/gpu_kernels.py``: rms_norm, dropout), the fake step runs the CUDA path. Each case
is a tiny model with the bytes worked by hand from derivatives.yaml; real CPU tensors keep
CPU's path (what that run really keeps).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import torchledger
from torchledger.render.common import run_notes

BF16 = torch.bfloat16
ROWS, D = 8, 64          # 8 rows of 64: a bf16 row is 128 B, an fp32 row 256 B


class Net(nn.Module):
    """``first`` on a (8, 64) input, then a bias-free linear (which keeps its input: the
    first's output, 8 x 64 x 2 = 1,024 B in bf16)."""

    def __init__(self, first: nn.Module, dtype=BF16):
        super().__init__()
        self.first = first
        self.lin = nn.Linear(D, D, bias=False, dtype=dtype)

    def forward(self, x):
        return self.lin(self.first(x)).float().sum()


def _trace(make, fake: bool, dtype=BF16):
    mode = FakeTensorMode() if fake else None
    if mode is not None:
        mode.__enter__()
    try:
        torch.manual_seed(0)
        model = make()
        x = torch.randn(ROWS, D, dtype=dtype, requires_grad=True)
        with torchledger.trace(model) as t:
            model(x).backward()
    finally:
        if mode is not None:
            mode.__exit__(None, None, None)
    rec = t.record
    return rec, {m["name"]: m["activation_bytes"] for m in rec.modules}


def _ops(rec) -> set:
    return {o["op"] for o in rec.ops}


# -- rms_norm ---------------------------------------------------------------------------------
def test_rms_norm_keeps_what_the_fused_kernel_keeps():
    """CUDA's _fused_rms_norm keeps the bf16 input and an fp32 rstd a row:
    8 x 64 x 2 + 8 x 4 = 1,024 + 32 = 1,056 B."""
    rec, act = _trace(lambda: Net(nn.RMSNorm(D, dtype=BF16)), fake=True)
    assert act["first"] == ROWS * D * 2 + ROWS * 4
    assert act["lin"] == ROWS * D * 2
    assert {"aten._fused_rms_norm.default", "aten._fused_rms_norm_backward.default"} <= _ops(rec)
    assert not {"aten.pow.Tensor_Scalar", "aten.rsqrt.default"} & _ops(rec)     # no composite
    assert rec.meta["gpu_kernels"]["rms_norm"]["calls"] == 1
    assert any("rms_norm as CUDA's fused kernel" in line and "x1" in line for line in run_notes(rec))


def test_rms_norm_on_real_cpu_keeps_the_composite():
    """A real CPU step runs CPU's composite, which keeps the fp32 upcast input and the fp32
    normalised product, and rstd: 8 x 64 x 4 x 2 + 8 x 4 = 4,128 B (4x the GPU's bytes)."""
    rec, act = _trace(lambda: Net(nn.RMSNorm(D, dtype=BF16)), fake=False)
    assert act["first"] == ROWS * D * 4 * 2 + ROWS * 4
    assert "gpu_kernels" not in rec.meta
    assert "aten._fused_rms_norm.default" not in _ops(rec)


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
def test_rms_norm_with_fp32_weight_takes_the_composite_on_cuda_too():
    """rms_norm_symint: a weight of another dtype than the input falls back to the composite
    (CUDA as CPU): fp32 upcast and fp32 product kept, 4,128 B."""
    rec, act = _trace(lambda: Net(nn.RMSNorm(D, dtype=torch.float32)), fake=True)
    assert act["first"] == ROWS * D * 4 * 2 + ROWS * 4
    assert "gpu_kernels" not in rec.meta


def test_rms_norm_gradients_have_the_parameters_shapes():
    rec, _ = _trace(lambda: Net(nn.RMSNorm(D, dtype=BF16)), fake=True)
    # weight gradients: 64 (norm) + 64 x 64 (lin), bf16
    assert rec.totals["grad_bytes"] == (D + D * D) * 2


# -- dropout ----------------------------------------------------------------------------------
def test_dropout_keeps_a_one_byte_mask():
    """CUDA's native_dropout keeps a bool mask: 8 x 64 x 1 = 512 B (the linear keeps the
    dropped-out input, 1,024 B)."""
    rec, act = _trace(lambda: Net(nn.Dropout(0.1)), fake=True)
    assert act["first"] == ROWS * D
    assert {"aten.native_dropout.default", "aten.native_dropout_backward.default"} <= _ops(rec)
    assert rec.meta["gpu_kernels"]["dropout"]["calls"] == 1


def test_dropout_on_real_cpu_keeps_its_noise():
    """CPU multiplies by a noise tensor of the input's dtype and keeps it: 8 x 64 x 2 = 1,024 B."""
    _, act = _trace(lambda: Net(nn.Dropout(0.1)), fake=False)
    assert act["first"] == ROWS * D * 2


@pytest.mark.parametrize("inplace, training", [(True, True), (False, False)])
def test_dropout_unchanged_in_place_and_in_eval(inplace, training):
    """In place, CUDA multiplies by the noise as CPU does; in eval, dropout does nothing."""
    class Doubled(nn.Module):          # dropout_ needs a non-leaf: x * 2 keeps nothing sized
        def __init__(self):
            super().__init__()
            self.drop = nn.Dropout(0.1, inplace=inplace)

        def forward(self, x):
            return self.drop(x * 2)

    def make():
        net = Net(Doubled())
        net.first.train(training)
        return net
    rec, act = _trace(make, fake=True)
    assert "gpu_kernels" not in rec.meta
    assert act["first"] == (ROWS * D * 2 if inplace else 0)      # in place: the noise; eval: nothing


# -- the same on both devices -----------------------------------------------------------------
@pytest.mark.parametrize("act_fn", [nn.GELU(), nn.GELU("tanh"), nn.SiLU()], ids=["gelu", "gelu-tanh", "silu"])
@pytest.mark.parametrize("fake", [False, True], ids=["cpu", "fake"])
def test_gelu_and_silu_keep_their_input_on_both(act_fn, fake):
    """derivatives.yaml: gelu and silu keep ``self`` on every device (one kernel each on CPU
    and CUDA): 8 x 64 x 2 = 1,024 B; nothing substituted."""
    rec, act = _trace(lambda: Net(act_fn), fake=fake)
    assert act["first"] == ROWS * D * 2
    assert "gpu_kernels" not in rec.meta


@pytest.mark.parametrize("fake", [False, True], ids=["cpu", "fake"])
def test_layer_norm_keeps_input_mean_and_rstd(fake):
    """native_layer_norm keeps input, mean and rstd on both devices. NB: CUDA's kernel makes mean
    and rstd fp32 (acc type) where CPU's (and the fake kernel) makes them in a 16-bit input's
    dtype when the weights are 16-bit too: 8 x 2 x 4 = 64 B on a GPU, 8 x 2 x 2 = 32 B here,
    4 B a row of each norm, left as CPU has it (gpu_kernels.py)."""
    rec, act = _trace(lambda: Net(nn.LayerNorm(D, dtype=BF16)), fake=fake)
    assert act["first"] == ROWS * D * 2 + ROWS * 2 * 2
    assert "gpu_kernels" not in rec.meta


def test_rms_norm_through_a_whole_model():
    """llama-tiny's five RMSNorms in bf16 on fake tensors, 2 x 16 tokens: each keeps its input
    and rstd, 32 x 64 x 2 + 32 x 4 = 4,224 B (CPU's composite: 16,512)."""
    from torchledger.models import build_model, example_inputs, get_config
    cfg = get_config("llama-tiny")
    with FakeTensorMode():
        torch.manual_seed(0)
        model = build_model(cfg)
        for m in model.modules():
            for name, p in list(m._parameters.items()):
                if p is not None:
                    m._parameters[name] = nn.Parameter(p.detach().to(BF16))
        inputs = example_inputs(cfg, 2, 16)
        with torchledger.trace(model) as t:
            model(**inputs).backward()
    rows = {m["name"]: m["activation_bytes"] for m in t.record.modules}
    for name in ("blocks.0.attn_norm", "blocks.1.mlp_norm", "norm"):
        assert rows[name] == 32 * 64 * 2 + 32 * 4
    assert t.record.meta["gpu_kernels"]["rms_norm"]["calls"] == 2 * cfg.n_layers + 1


def test_functions_restored_after_the_step():
    before = (F.rms_norm, F.dropout)
    _trace(lambda: Net(nn.RMSNorm(D, dtype=BF16)), fake=True)
    assert (F.rms_norm, F.dropout) == before


# -- rms_norm on a DTensor (sequence parallelism) -----------------------------------------------
class _SPNorm(nn.Module):
    """A SequenceParallel RMSNorm over 4 ranks, then a linear on the local shard."""

    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(D, dtype=BF16)
        self.lin = nn.Linear(D, D, bias=False, dtype=BF16)

    def forward(self, x):
        return self.lin(self.norm(x).to_local()).float().sum()


def _trace_sp(fake: bool):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    mode = FakeTensorMode() if fake else None
    try:
        mesh = init_device_mesh("cpu", (4,))
        if mode is not None:
            mode.__enter__()
        torch.manual_seed(0)
        model = _SPNorm()
        parallelize_module(model, mesh, {"norm": SequenceParallel()})
        x = torch.randn(2, 8, D, dtype=BF16, requires_grad=True)     # this rank's 8 of 32 positions
        with torchledger.trace(model) as t:
            model(x).backward()
        grad = model.norm.weight.grad
    finally:
        if mode is not None:
            mode.__exit__(None, None, None)
        dist.destroy_process_group()
    return t.record, {m["name"]: m["activation_bytes"] for m in t.record.modules}, grad


@pytest.mark.filterwarnings("ignore:Full backward hook")
def test_sequence_parallel_rms_norm_keeps_what_the_fused_kernel_keeps():
    """Under sequence parallelism the norm's input is a DTensor (Shard(1)). On CUDA ``rms_norm``
    decomposes above the DTensor into ``_fused_rms_norm``, which DTensor shards by its own
    strategy (torch/distributed/tensor/_ops/_math_ops.py, rms_norm_single_dim_strategy), so
    the GPU keeps the local bf16 input and an fp32 rstd a row: 2 x 8 x 64 x 2 + 16 x 4 =
    2,112 B. CPU's composite (the fake step before) kept 2 x 8 x 64 x 8 + 64 = 8,256 B."""
    rec, act, grad = _trace_sp(fake=True)
    assert act["norm"] == 2 * 8 * D * 2 + 2 * 8 * 4 == 2112
    assert act["lin"] == 2 * 8 * D * 2
    assert {"aten._fused_rms_norm.default", "aten._fused_rms_norm_backward.default"} <= _ops(rec)
    assert rec.meta["gpu_kernels"]["rms_norm"]["calls"] == 1
    # the weight's gradient stays what DTensor's composite gives: the whole (64,) weight
    assert type(grad).__name__ == "DTensor" and tuple(grad.shape) == (D,)


@pytest.mark.filterwarnings("ignore:Full backward hook")
def test_sequence_parallel_rms_norm_on_real_cpu_keeps_the_composite():
    """Real CPU DTensors keep CPU's composite: fp32 upcast and product, 2 x 8 x 64 x 8 + 64 B."""
    rec, act, _ = _trace_sp(fake=False)
    assert act["norm"] == 2 * 8 * D * 8 + 2 * 8 * 4 == 8256
    assert "gpu_kernels" not in rec.meta


# -- the optimizer's implementation ------------------------------------------------------------
OPT_SPEC = """
import torch, torchledger

def audit_spec():
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64, bias=False) for _ in range(4)])
    return torchledger.AuditSpec(model, torch.randn(4, 64), optimizer=OPTIMIZER)
"""


def _optimizer_audit(tmp_path, optimizer: str):
    from torchledger.audit import run_audit
    path = tmp_path / f"opt_{abs(hash(optimizer))}.py"
    path.write_text(OPT_SPEC.replace("OPTIMIZER", optimizer))
    return run_audit(str(path), steps=2).record


def test_adamw_takes_the_gpus_foreach_path_on_fake_tensors(tmp_path):
    """torch.optim's default on CUDA is the foreach path, whose sqrt(v) is one list over every
    parameter at once; CPU's for-loop holds one parameter's sqrt(v) and its quotient by
    sqrt(1 - beta2^t), and the previous parameter's ``denom`` until the name is rebound. Four
    64 x 64 fp32 weights (16,384 B each): the foreach path holds 4 x 16,384 = 65,536 B beside
    weights, gradients and moments, the for-loop 3 x 16,384 = 49,152 B: the peak 16,384 B
    higher (and the gap grows with the parameter count: 24 GiB for Llama-2-7B)."""
    default = _optimizer_audit(tmp_path, "None")
    loop = _optimizer_audit(tmp_path, "lambda p: torch.optim.AdamW(p, foreach=False)")
    ops = {o["op"] for o in default.ops if o["phase"] == "optimizer"}
    assert "aten._foreach_sqrt.default" in ops and "aten.sqrt.default" not in ops
    assert "aten._foreach_sqrt.default" not in {o["op"] for o in loop.ops}
    assert default.totals["peak_phase"] == loop.totals["peak_phase"] == "optimizer"
    assert default.totals["peak_bytes"] - loop.totals["peak_bytes"] == 4 * 16_384 - 3 * 16_384
    assert "optimizer_foreach" in default.meta["gpu_kernels"]


def test_mixed_dtensor_and_plain_parameters_keep_the_for_loop():
    """Tensor parallelism without FSDP leaves norms and embeddings plain beside DTensor
    weights; the foreach ops refuse the mix on a GPU ("got mixed torch.Tensor and DTensor"), so
    the step keeps the for-loop: it runs, and no foreach op is traced."""
    import os
    from torchledger.audit import run_audit
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rec = run_audit(os.path.join(root, "examples", "gpt2_tiny.py"), world_size=2, mesh="tp=2", steps=1).record
    assert not [o for o in rec.ops if o["op"].startswith("aten._foreach_")]
    assert any(o["op"] == "aten.lerp_.Scalar" for o in rec.ops if o["phase"] == "optimizer")
    # and the report says what a GPU run of it would hit
    assert "got mixed torch.Tensor and DTensor" in rec.meta["gpu_kernels"]["optimizer_mixed"]["note"]
    assert "optimizer_foreach" not in rec.meta["gpu_kernels"]


def test_te_steps_without_the_foreach_list():
    """--kernels te: Megatron steps with a fused Adam that keeps no list of intermediates; the
    default optimizer runs the for-loop, the nearest in memory (priced fused by the time model)."""
    from torchledger.parallel.layout import Layout
    from torchledger.parallel.plan import default_optimizer
    params = [torch.nn.Parameter(torch.zeros(4))]
    assert default_optimizer(Layout(kernels="te"))(params).defaults["foreach"] is False
    assert default_optimizer(Layout())(params).defaults["foreach"] is None
    assert default_optimizer(None) is torch.optim.AdamW
