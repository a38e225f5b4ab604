"""Mixture-of-experts layers of Hugging Face decoders (transformers 5.x: Qwen3-MoE, Qwen2-MoE,
Mixtral, GPT-OSS and others whose sparse block holds a top-k router (``gate`` or ``router``) and
``experts`` with fused 3-D weights ``gate_up_proj`` (E, 2 f, d) and ``down_proj`` (E, d, f), or
transposed, with or without biases) under the standard plan.

The plan computes their experts with its own forward, registered in transformers'
``ExpertsInterface`` as ``torchledger_balanced`` and selected by the model's config (as context
parallelism registers its attention): transformers' ``grouped_mm`` checks for bf16 inputs on
fake tensors and its eager loop sizes tensors by the routing, which fake tensors cannot know.

**Balanced routing** (an assumption, said in the plan notes): each of the E experts receives
C = ceil(N k / E) of the N tokens' k choices. The rows sorted by expert are cut into an (E, C, d)
dispatch buffer and every expert computes its C rows with one batched matmul per projection:
2 x N k x d x f x 3 FLOPs forward (gate, up, down), the grouped GEMM's work. It prices the
step; its numerics are exact only when the routing is balanced.

**Expert parallelism** over a group of ``ep`` ranks (as torchtitan does): each rank holds E / ep
experts (the weights cut along the expert dim); the dispatch buffer goes to the experts' ranks by
one ``all_to_all_single`` and the outputs come back by another (their backward: two more), each
N k d elements per rank, recorded through torch.distributed.

**Tensor parallelism** (Megatron's expert TP of 1): the block's tokens are the same on every tp
rank (no sequence parallelism on Hugging Face decoders); each routes its N / tp of them and the
outputs are all-gathered over tp. The experts are whole on every tp rank, data-parallel over it.

Known limitations: routing is balanced by assumption (above); under tp a token count that tp
does not divide is routed whole on every tp rank.
"""
from __future__ import annotations

import functools

__all__ = ["EXPERTS_IMPLEMENTATION", "is_sparse_block", "n_experts", "expert_width", "top_k",
           "split_over_tp", "owns_experts", "use_balanced_experts", "shard_experts"]

#: The name the plan's expert forward is registered under in transformers' ExpertsInterface.
EXPERTS_IMPLEMENTATION = "torchledger_balanced"

_WEIGHTS = ("gate_up_proj", "down_proj", "up_proj", "gate_up_proj_bias", "down_proj_bias", "up_proj_bias")


def router(mlp):
    """The sparse block's top-k router: ``gate`` (Mixtral, Qwen) or ``router`` (GPT-OSS)."""
    gate = getattr(mlp, "gate", None)
    return gate if getattr(gate, "top_k", None) is not None else getattr(mlp, "router", None)


def top_k(mlp) -> int:
    """k: the experts each token is routed to."""
    return int(router(mlp).top_k)


def is_sparse_block(mlp) -> bool:
    """``mlp`` is a transformers sparse MoE block: a top-k router and 3-D expert weights."""
    experts, gate = getattr(mlp, "experts", None), router(mlp)
    up = getattr(experts, "gate_up_proj", None)
    if up is None:
        up = getattr(experts, "up_proj", None)
    down = getattr(experts, "down_proj", None)
    return (getattr(gate, "top_k", None) is not None and getattr(up, "dim", None) is not None
            and up.dim() == 3 and getattr(down, "dim", None) is not None and down.dim() == 3)


def n_experts(mlp) -> int:
    """E: the experts of a sparse block (all ranks together)."""
    return int(getattr(mlp.experts, "_torchledger_experts", None) or mlp.experts.down_proj.shape[0])


def expert_width(mlp) -> int:
    """f: an expert's hidden width."""
    e = mlp.experts
    return int(e.down_proj.shape[1] if getattr(e, "is_transposed", False) else e.down_proj.shape[2])


def use_balanced_experts(model, blocks) -> None:
    """The plan's expert forward (balanced routing) for every sparse block in ``blocks``
    (``(fqn, sparse block)`` pairs), selected by the model's config."""
    from transformers.integrations.moe import ExpertsInterface
    ExpertsInterface.register(EXPERTS_IMPLEMENTATION, balanced_experts_forward)
    for _, mlp in blocks:
        mlp.experts._torchledger_experts = n_experts(mlp)
        config = getattr(mlp.experts, "config", None)
        if config is not None:
            config._experts_implementation = EXPERTS_IMPLEMENTATION
    config = getattr(model, "config", None)
    if config is not None:
        config._experts_implementation = EXPERTS_IMPLEMENTATION


def shard_experts(mlp, ep_mesh) -> int:
    """Keep this ep rank's E / ep experts of a sparse block (its weights cut along the expert
    dim) and dispatch to the others over ``ep_mesh``; returns E / ep."""
    import torch
    experts = mlp.experts
    total, ep = n_experts(mlp), ep_mesh.size()
    local, r = total // ep, ep_mesh.get_local_rank()
    for name in _WEIGHTS:
        w = getattr(experts, name, None)
        if isinstance(w, torch.nn.Parameter) and w.dim() >= 2 and w.shape[0] == total:
            setattr(experts, name, torch.nn.Parameter(w.detach()[r * local:(r + 1) * local].clone(),
                                                      requires_grad=w.requires_grad))
    experts._torchledger_experts = total
    experts._torchledger_ep = ep_mesh
    return local


def split_over_tp(mlp, tp_mesh) -> None:
    """Under tensor parallelism (Megatron's expert TP = 1): each tp rank routes N / tp of the
    block's N (replicated) tokens to its experts and the outputs are all-gathered over tp (in
    backward: each rank's rows of the gradient, and the routed inputs' gradients all-gathered).
    The experts are whole on every tp rank, which see other tokens: data-parallel over tp."""
    mlp.experts._torchledger_tp = tp_mesh


def owns_experts(mlp) -> bool:
    """The plan keeps this block's experts apart from the dense weights (ep or tp split them)."""
    experts = mlp.experts
    return any(getattr(experts, name, None) is not None for name in ("_torchledger_ep", "_torchledger_tp"))


def balanced_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """transformers' experts signature: (N, d) tokens, their (N, k) experts and weights -> (N, d);
    under tp each rank takes its N / tp of them (when tp divides N) and all-gathers the outputs."""
    tp = getattr(self, "_torchledger_tp", None)
    N = hidden_states.shape[0]
    if tp is None or N % tp.size():
        return _balanced(self, hidden_states, top_k_index, top_k_weights)
    scatter, gather = _tp_functions()
    rows = N // tp.size()
    start = tp.get_local_rank() * rows
    out = _balanced(self, scatter.apply(hidden_states, tp, start, rows), top_k_index.narrow(0, start, rows),
                    scatter.apply(top_k_weights, tp, start, rows))
    return gather.apply(out, tp, start, rows)


@functools.lru_cache(maxsize=None)
def _tp_functions():
    """(scatter, gather) over a tp group along dim 0, Megatron's pair: scatter keeps this rank's
    rows and all-gathers the gradient; gather all-gathers the rows and keeps this rank's rows of
    the gradient."""
    import torch
    from torch.distributed import _functional_collectives as funcol

    gather_fn = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor   # torch < 2.11

    def all_gather(x, mesh):
        return funcol.wait_tensor(gather_fn(x.contiguous(), 0, mesh))

    class Scatter(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, mesh, start, rows):
            ctx.mesh = mesh
            return x.narrow(0, start, rows)

        @staticmethod
        def backward(ctx, grad):
            return all_gather(grad, ctx.mesh), None, None, None

    class Gather(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, mesh, start, rows):
            ctx.start, ctx.rows = start, rows
            return all_gather(x, mesh)

        @staticmethod
        def backward(ctx, grad):
            return grad.narrow(0, ctx.start, ctx.rows), None, None, None
    return Scatter, Gather


def _balanced(self, hidden_states, top_k_index, top_k_weights):
    """Rows sorted by expert fill an (E, C, d) buffer, C = ceil(N k / E): balanced routing."""
    import torch.nn.functional as F
    N, d = hidden_states.shape
    k = top_k_index.shape[-1]
    E = int(getattr(self, "_torchledger_experts", None) or self.down_proj.shape[0])
    rows = N * k
    C = -(-rows // E)
    order = top_k_index.reshape(-1).argsort()
    token = order // k
    x = hidden_states[token]
    if E * C > rows:                                  # padded to E x C rows
        x = F.pad(x, (0, 0, 0, E * C - rows))
    y = _dispatched(self, x.view(E, C, d)).reshape(E * C, d)
    y = y if E * C == rows else y[:rows]
    y = y * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(y.dtype)
    return hidden_states.new_zeros(N, d, dtype=y.dtype).index_add(0, token, y).to(hidden_states.dtype)


def _dispatched(self, buf):
    """The experts on the (E, C, d) buffer; under ep, chunk j of the experts goes to rank j by
    all-to-all (dispatch), this rank's E / ep experts compute what every rank sent, and the
    outputs go back by another all-to-all (combine)."""
    mesh = getattr(self, "_torchledger_ep", None)
    if mesh is None:
        return _compute(self, buf)
    from torch.distributed._functional_collectives import all_to_all_single_autograd
    E, C, d = buf.shape
    ep = mesh.size()
    local = E // ep
    got = all_to_all_single_autograd(buf.contiguous(), None, None, mesh)          # (ep E_l, C, d)
    h = got.view(ep, local, C, d).transpose(0, 1).reshape(local, ep * C, d)
    h = _compute(self, h)
    back = h.view(local, ep, C, d).transpose(0, 1).reshape(E, C, d)
    return all_to_all_single_autograd(back.contiguous(), None, None, mesh)         # combine


def _compute(self, x):
    """(E_l, M, d) rows of each local expert -> (E_l, M, d): one bmm per projection."""
    gated = getattr(self, "has_gate", True)
    h = _bmm(x, _weight(self, "gate_up_proj" if gated else "up_proj"))
    h = _bias(self, h, "gate_up_proj_bias" if gated else "up_proj_bias")
    h = _gate(self, h) if gated else self.act_fn(h)
    y = _bias(self, _bmm(h, _weight(self, "down_proj")), "down_proj_bias")
    if getattr(self, "has_post_expert_norm", False):
        y = self.post_expert_norm(y)
    return y


def _weight(self, name):
    """(E_l, in, out) for bmm: transformers stores (E, out, in) unless ``is_transposed``."""
    w = getattr(self, name)
    return w if getattr(self, "is_transposed", False) else w.transpose(1, 2)


def _bmm(x, w):
    """x @ w in x's dtype. Weights an FSDP2 mixed-precision policy does not manage (each ep rank's
    own experts without dp) stay fp32 under 16-bit activations: cast for the matmul, the cast
    made again in backward rather than saved (as FSDP2 frees its 16-bit parameters after
    forward and gathers them again), so no layer holds a 16-bit copy of its experts."""
    import torch
    if w.dtype == x.dtype or not torch.is_grad_enabled():
        return torch.bmm(x, w.to(x.dtype))
    return _cast_bmm().apply(x, w)


@functools.lru_cache(maxsize=None)
def _cast_bmm():
    """The autograd function, made on first use (this module imports without torch)."""
    import torch

    class CastBmm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return torch.bmm(x, w.to(x.dtype))

        @staticmethod
        def backward(ctx, grad):
            x, w = ctx.saved_tensors
            wc = w.to(x.dtype)
            return torch.bmm(grad, wc.transpose(1, 2)), torch.bmm(x.transpose(1, 2), grad).to(w.dtype)
    return CastBmm


def _gate(self, h):
    """act(gate) x up of the fused projection: the class's own ``_apply_gate`` where it has one."""
    if hasattr(self, "_apply_gate"):
        return self._apply_gate(h)
    gate, up = h.chunk(2, dim=-1)
    return self.act_fn(gate) * up


def _bias(self, h, name):
    b = getattr(self, name, None) if getattr(self, "has_bias", False) else None
    return h if b is None else h + b.to(h.dtype).unsqueeze(1)
