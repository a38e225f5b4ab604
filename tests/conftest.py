"""Shared fixtures. The leak guard checks that no torchledger hook, mode or tracer survives
a test (pyinstrument's check_sampler_state)."""
from __future__ import annotations

import os
import signal
import gc

import pytest
import torch
from torch.utils import _python_dispatch


def pytest_addoption(parser):
    parser.addoption("--update-goldens", action="store_true", default=False,
                     help="rewrite tests/golden/* from the current output")


@pytest.fixture
def update_goldens(request):
    return request.config.getoption("--update-goldens")


def hook_state():
    """Everything global a tracer could leave behind."""
    from torch.nn.modules import module as m
    from torch.optim import optimizer as o
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    from torchledger.tracer import active_tracer
    return {
        "dispatch_modes": len(_get_current_dispatch_mode_stack()),
        "fwd_pre": len(m._global_forward_pre_hooks),
        "fwd": len(m._global_forward_hooks),
        "opt_pre": len(o._global_optimizer_pre_hooks),
        "opt_post": len(o._global_optimizer_post_hooks),
        "saved_tensor_hooks": torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
        if hasattr(torch._C._autograd, "_top_saved_tensors_default_hooks") else False,
        "active": active_tracer() is not None,
        "sdpa": torch.nn.functional.scaled_dot_product_attention,
        "rms_norm": torch.nn.functional.rms_norm,          # patched while a fake step is traced
        "dropout": torch.nn.functional.dropout,
        "selective_checkpoint": _selective_checkpoint_dispatch(),
        "storage_resize": torch.UntypedStorage.resize_,      # patched while a distributed step is traced
        "sigint": signal.getsignal(signal.SIGINT),
        "lock": _lifecycle().LOCK.locked(),
        "mode_flag": _python_dispatch._is_in_torch_dispatch_mode,
        "compile_stance": _compile_stance(),
    }


def _selective_checkpoint_dispatch():
    """The selective-checkpoint forward mode's dispatch (patched while a step is traced)."""
    from torch.utils import checkpoint
    mode = getattr(checkpoint, "_CachingTorchDispatchMode", None)
    return getattr(mode, "__torch_dispatch__", None)


def _compile_stance():
    """torch.compile's global stance and dynamo's stance callback (the tracer forces eager
    while it is in: left behind, nothing compiles again in the process)."""
    try:
        from torch._dynamo import eval_frame
    except Exception:  # noqa: BLE001  a torch without dynamo
        return None
    return (getattr(eval_frame, "_stance", None), getattr(eval_frame, "_callback_from_stance", None))


def _lifecycle():
    from torchledger.tracer import lifecycle
    return lifecycle


@pytest.fixture(autouse=True)
def leak_guard():
    before = hook_state()
    yield
    after = hook_state()
    assert after == before, f"torchledger left global state behind: {before} -> {after}"


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """accelerate keeps one ``AcceleratorState`` per process: the first ``Accelerator`` (a
    ``Trainer``'s included) fixes its mixed precision, and a later ``Accelerator(mixed_precision=
    "bf16")`` raises "AcceleratorState has already been initialized". Reset it after every test
    that loaded accelerate (what accelerate's own ``AccelerateTestCase`` does), so no test's
    outcome depends on which ran before it in the process."""
    yield
    import sys
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=True)
        state.GradientState._reset_state()


def pytest_configure(config):
    # Under pytest-xdist (README's command: one worker a core) each worker computes on one
    # thread: two workers of two intra-op threads each would fight over the two cores.
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)


@pytest.fixture
def fake_pg():
    """PyTorch's fake process group of 4 ranks, this process rank 0 (collectives return at once
    and move no data; the tracer sees them as on NCCL/gloo), destroyed after the test."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def run_torchrun(script: str, out, nproc: int = 2, timeout: int = 90) -> None:
    """``script OUT`` under torchrun (``nproc`` CPU ranks on a free port, one thread each),
    failing the test with torchrun's stderr if it fails or outlives ``timeout`` seconds."""
    import socket
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(nproc),
           "--rdzv-backend", "c10d", f"--rdzv-endpoint=localhost:{port}", script, str(out)]
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=root)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"torchrun did not finish in {timeout} s: {(e.stderr or '')[-2000:]}")
    assert proc.returncode == 0, proc.stderr[-4000:]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    """Move what collection imported (torch, transformers, lightning: ~400k objects) out of the
    collector's reach. Every ``gc.collect()`` (a traced step calls one when something was kept
    across steps) then scans only what the tests made, ~0.3 s less CPU each. Objects made
    later, the tests' own included, are collected and found by ``gc.get_objects()`` as before."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True, scope="module")
def _freeze_what_earlier_modules_left():
    """The same at the start of each test file, for what earlier files left alive (caches,
    lazily imported modules): a file's gc.collect() calls then scan that file's objects only."""
    gc.collect()
    gc.freeze()


@pytest.fixture
def restore_registry():
    """The GPU registry (and the hardware file's loaded state) as it was before the test."""
    from torchledger.formulas import hardware
    saved = dict(hardware._REGISTRY)
    yield
    hardware._REGISTRY.clear()
    hardware._REGISTRY.update(saved)
    hardware._ENV_LOADED = None
