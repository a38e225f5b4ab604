"""Tensor kinds with no single storage (sparse, nested, wrapper subclasses) and optimizer
state held in lists: the tracer records what it can and never raises into the user's step."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import torchledger
from torchledger.tracer.memory import data_tensors, state_tensors, tensor_bytes


def _sparse_run(make_opt, traced: bool):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 3))
    emb = list(model[0].parameters())
    opts = [make_opt(emb), torch.optim.SGD(model[1].parameters(), lr=0.1)]
    x = torch.tensor([[1, 2, 3], [3, 7, 9]])
    for step in range(2):
        if traced and step == 1:
            with torchledger.trace(model, optimizer=opts[0]) as t:
                model(x).square().mean().backward()
                for o in opts:
                    o.step()
                    o.zero_grad()
        else:
            model(x).square().mean().backward()
            for o in opts:
                o.step()
                o.zero_grad()
    return model, (t.record if traced else None)


@pytest.mark.parametrize("make_opt", [lambda p: torch.optim.SGD(p, lr=0.1),
                                      lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                                      lambda p: torch.optim.SparseAdam(p, lr=0.1)],
                         ids=["sgd", "sgd-momentum", "sparse-adam"])
def test_sparse_gradients_step_as_untraced(make_opt):
    """optimizer.step() with sparse gradients raised NotImplementedError under tracing."""
    plain, _ = _sparse_run(make_opt, traced=False)
    traced, rec = _sparse_run(make_opt, traced=True)
    for a, b in zip(plain.parameters(), traced.parameters()):
        assert torch.equal(a, b)
    assert not any("not recorded" in w or "hook" in w for w in rec.warnings), rec.warnings
    # the embedding's sparse gradient: 6 looked-up rows -> indices (1, 6) int64 = 48 B, values
    # (6, 4) fp32 = 96 B; the Linear's dense gradient: (3*4 + 3) fp32 = 60 B
    assert rec.totals["grad_bytes"] == 48 + 96 + 60
    assert rec.memory["grads"]["optimizer_steps"] == 2


def test_lbfgs_history_lists_are_counted():
    """LBFGS keeps old_dirs, old_stps, ro and al in lists: 68 B were counted of everything."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)                                   # 3*2 + 2 = 8 parameters
    opt = torch.optim.LBFGS(model.parameters())
    x = torch.randn(4, 3)

    def closure():
        opt.zero_grad()
        loss = model(x).pow(2).sum()
        loss.backward()
        return loss

    with torchledger.trace(model, optimizer=opt) as t:
        opt.step(closure)
    state = opt.state[next(iter(opt.state))]
    k = len(state["old_dirs"])
    assert k > 1 and len(state["ro"]) == k
    al = [a for a in state["al"] if a is not None]
    # d, prev_flat_grad: 8 fp32 = 32 B each; H_diag: one fp32 = 4 B; per history entry:
    # old_dirs and old_stps 32 B each, ro 4 B; al: one 4 B scalar per filled slot
    expected = 32 + 32 + 4 + k * (32 + 32 + 4) + 4 * len(al)
    assert t.record.optimizer["state_bytes"] == expected
    by_key = {e["key"]: e["bytes"] for e in t.record.optimizer["state"]}
    assert by_key["old_dirs"] == 32 * k and by_key["ro"] == 4 * k


def test_state_walk_nested_and_cyclic():
    opt = torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1)
    a, b = torch.zeros(3), torch.zeros(5, dtype=torch.float64)
    loop: list = [a]
    loop.append(loop)                                          # a list that holds itself
    opt.state["x"] = {"hist": loop, "d": {"inner": (b, a)}, "n": 3}
    found = sorted((k, t.numel()) for k, t in state_tensors(opt))
    assert found == [("d", 5), ("hist", 3)]                   # a once, b once; no endless walk


def test_data_tensors_of_each_kind():
    dense = torch.zeros(3, 4)
    coo = torch.eye(4).to_sparse()                             # 4 nonzeros
    # indices (2, 4) int64 = 64 B; values 4 fp32 = 16 B
    assert tensor_bytes(coo) == 64 + 16
    csr = torch.eye(4).to_sparse_csr()
    # crow (5,) int64 = 40 B, col (4,) int64 = 32 B, values 4 fp32 = 16 B
    assert tensor_bytes(csr) == 40 + 32 + 16
    assert data_tensors(dense) == [dense] and tensor_bytes(dense) == 48
    jagged = torch.nested.nested_tensor([torch.zeros(2, 3), torch.zeros(4, 3)], layout=torch.jagged)
    # values (6, 3) fp32 = 72 B; offsets (3,) int64 = 24 B
    assert tensor_bytes(jagged) == 72 + 24
    from torch.testing._internal.two_tensor import TwoTensor
    two = TwoTensor(torch.zeros(3), torch.zeros(3))            # a wrapper subclass of 2 tensors
    assert tensor_bytes(two) == 12 + 12


def test_dtensor_local_shard_is_its_data():
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    from torch.distributed.tensor import DTensor, Replicate, init_device_mesh
    if dist.is_initialized():
        pytest.skip("a process group already exists")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        local = torch.zeros(5)
        d = DTensor.from_local(local, mesh, [Replicate()])
        assert [t.untyped_storage().data_ptr() for t in data_tensors(d)] == [local.untyped_storage().data_ptr()]
        assert tensor_bytes(d) == 20                           # 5 fp32
    finally:
        dist.destroy_process_group()


def test_unreachable_kind_is_a_warning_not_an_error(monkeypatch):
    """A gradient whose storage cannot be read is noted in record.warnings; the step goes on."""
    import torchledger.tracer.step as step
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    real = step.data_tensors

    def refuse(t):
        if t is model.weight.grad:
            raise NotImplementedError("no storage for this kind")
        return real(t)

    monkeypatch.setattr(step, "data_tensors", refuse)
    with torchledger.trace(model, optimizer=opt) as t:
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
    assert any("gradient of type Tensor" in w and "no storage for this kind" in w
               for w in t.record.warnings), t.record.warnings
