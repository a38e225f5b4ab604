"""The standard plan: what ``torchledger audit`` applies to a model when its AuditSpec has no
``parallelize``, from the layout of ``--mesh`` (:mod:`.layout`), as torchtitan applies it to
Llama, with PyTorch's own FSDP2, tensor parallelism and activation checkpointing.

In torchtitan's order (``parallelize_llama``), per transformer block:

- **TP** (``tp``): q/k/v and the MLP's gate/up projections ``ColwiseParallel``, o and down
  ``RowwiseParallel``; attention heads split over tp. On torchledger's RoPE decoders with
  **sequence parallelism** as torchtitan does (norms ``SequenceParallel``, the block inputs
  all-gathered by ``PrepareModuleInput``, o/down reduce-scattered to ``Shard(1)``, the
  embedding ``RowwiseParallel`` to ``Shard(1)``, the head ``ColwiseParallel`` from it);
  Hugging Face decoders get TP on the blocks without SP (they compute positions from the
  embedded sequence's length, which SP would shard); learned-position models (GPT-2/3) without
  it unless the layout says ``--sequence-parallel on`` (Megatron's GPT runs had it from 2022,
  not before), which splits the position table like the token table; ``--sequence-parallel
  off`` runs RoPE decoders without it.
- **CP** (``cp``): each rank holds T/cp of the sequence (its inputs are narrowed); attention
  all-gathers K and V over the cp group (backward reduce-scatters their gradients), the
  all-gather variant Llama 3 was trained with, and attends its own queries to all keys
  under the causal mask shifted by its offset. Hugging Face decoders: the same as an
  attention function registered in transformers' ``AttentionInterface`` (``torchledger_cp``)
  that the model's config selects.
- **Checkpointing**: ``full`` every block; ``selective-layer`` every second block
  (torchtitan's ``selective_ac_option="2"``); ``selective-op`` every block, saving the
  outputs of matmuls (all but every second one), attention and reduce-scatters and
  recomputing the rest (torchtitan's op policy).
- **Data parallel**: ``dp`` -> ``fully_shard`` per block and the root (over dp x cp
  flattened when cp > 1: CP ranks hold the same weights); ``dp_replicate`` with ``dp`` ->
  HSDP (a 2-D mesh: replicate x shard); ``dp_replicate`` alone -> DDP as torchtitan's
  ``apply_ddp`` (``torch.distributed._composable.replicate``: a ``DistributedDataParallel``
  with ``bucket_cap_mb=100``, its gradients all-reduced a bucket at a time; precision by
  autocast, as torchtitan's ``maybe_enable_amp``); ``dp_replicate`` with tp, cp or pp (which
  torchtitan's DDP refuses) -> FSDP2's ``replicate`` (gradients all-reduced).
  Pipelined: ``reshard_after_forward=False`` (parameters stay gathered across micro-batches).
- **Precision**: ``bf16-mixed``/``fp16-mixed``: FSDP2's ``MixedPrecisionPolicy`` (parameters
  cast for compute, gradients reduced in fp32), or autocast around the forward without
  data parallelism or under DDP; ``bf16``: parameters stored in bf16.

Known limitations: the model is recognised by its structure (torchledger's ``Transformer``;
a Hugging Face ``*ForCausalLM`` with ``model.layers[i].self_attn.{q,k,v,o}_proj`` and
``mlp.{gate,up,down}_proj``: Llama, Mistral, Qwen2; or DeepSeek-V2/V3's multi-head latent
attention, ``self_attn.{q_proj | q_a_proj, q_b_proj}, kv_a_proj_with_mqa, kv_b_proj, o_proj``);
any other model gets data parallelism only (FSDP2 on the root as one unit); ``ep`` applies to
torchledger's MoE decoders (:mod:`torchledger.models.moe`) and to Hugging Face MoE decoders
(Mixtral, Qwen2/3-MoE, GPT-OSS, DeepSeek-V2/V3: :mod:`.hf_moe`, routed experts computed under
balanced routing; shared experts and dense first layers stay dense weights, FSDP over dp x ep),
with cp (each rank's experts sharded over dp x cp) and, on the Hugging Face ones, tp (each tp
rank routes its share of the tokens; the experts data-parallel over tp; latent attention split
by heads as :mod:`.hf_mla` describes).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from .hf_moe import (expert_width, is_sparse_block, n_experts, owns_experts, shard_experts, split_over_tp,
                     top_k, use_balanced_experts)
from .hf_mla import (fused_attention, is_latent_attention, latent_tp_plan, sum_rotary_key_grads,
                     use_fused_latent_attention)
from ..record import OPTIMIZER_SHARDS_ATTR
from .layout import PARAMS_16

__all__ = ["DDP_BUCKET_CAP_MB", "PlanError", "Decoder", "find_decoder", "apply_standard_plan", "cp_inputs",
           "make_optimizer", "default_optimizer"]

#: DDP's ``bucket_cap_mb`` under ``dp_replicate`` alone: torchtitan's ``apply_ddp`` calls
#: ``replicate(model, device_mesh=dp_mesh, bucket_cap_mb=100)`` (torchtitan/models/llama3/infra/
#: parallelize.py). Given a cap, DDP caps its first bucket at it too (the 1 MiB first bucket,
#: ``dist._DEFAULT_FIRST_BUCKET_BYTES``, is for the default cap only: torch 2.13's
#: ``_BucketCapacityConfig.create``); the simulated world cuts the buckets as the installed torch does.
DDP_BUCKET_CAP_MB = 100


class PlanError(ValueError):
    """The standard plan cannot apply this layout to this model: one line for the user."""


@dataclass
class Decoder:
    """Where a decoder's parts are, by ``named_modules()`` name."""

    family: str
    """``torchledger`` (models.Transformer) or ``hf`` (a Hugging Face causal LM)."""
    blocks: object
    """The ModuleList of transformer blocks."""
    prefix: str
    """FQN of the blocks' list: ``blocks`` or ``model.layers``."""
    attn: str
    mlp: str
    norms: tuple
    """The block's two norms (before attention, before the MLP)."""
    swiglu: bool
    embed: str
    norm: str
    head: str
    n_heads: int
    n_kv_heads: int
    d_ff: int
    sequence_parallel: bool
    """TP shards the sequence between blocks too (torchtitan's SP): the plan's choice for the
    model, or the layout's ``--sequence-parallel`` (:func:`find_decoder`)."""
    experts: int = 0
    """E of its mixture-of-experts layers (a Hugging Face sparse block); 0: none."""
    top_k: int = 0
    attention: str = "mha"
    """``mha`` (q/k/v/o projections, grouped or not) or ``mla`` (DeepSeek's multi-head latent
    attention: q_proj or q_a/q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj)."""
    pos_embed: Optional[str] = None
    """FQN of a learned position table added to the token embeddings (GPT-2/3's), or None."""

    def module(self, model, fqn: str):
        return model.get_submodule(fqn) if fqn else model


def find_decoder(model, layout=None) -> Optional[Decoder]:
    """The decoder structure of ``model``, or None when it is not one the plan knows; with a
    layout that says ``sequence_parallel``, with that choice (PlanError where the model cannot
    take it: a Hugging Face decoder computes its positions from the embedded sequence's
    length, which sequence parallelism would cut)."""
    dec = _decoder(model)
    want = getattr(layout, "sequence_parallel", None)
    if dec is None or want is None or want == dec.sequence_parallel:
        return dec
    if want and dec.family == "hf":
        raise PlanError(f"--sequence-parallel on: {type(model).__name__} is a Hugging Face decoder, which "
                        f"computes its positions from the embedded sequence's length (sequence parallelism "
                        f"would cut it); the standard plan runs its tensor parallelism without: drop "
                        f"--sequence-parallel")
    return dataclasses.replace(dec, sequence_parallel=want)


def _decoder(model) -> Optional[Decoder]:
    try:
        from ..models.transformer import Transformer
    except ImportError:                  # pragma: no cover
        Transformer = ()
    if isinstance(model, Transformer):
        cfg = model.config
        return Decoder("torchledger", model.blocks, "blocks", "attn", "mlp", ("attn_norm", "mlp_norm"),
                       cfg.gated, "tok_emb", "norm", "lm_head", cfg.n_heads, cfg.n_kv_heads,
                       cfg.d_ff, sequence_parallel=not cfg.n_positions,
                       pos_embed="pos_emb" if cfg.n_positions else None)
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    head = getattr(model, "lm_head", None)
    if layers is None or head is None or not len(layers):
        return None
    # a pipeline stage's model has Identity in place of the blocks other ranks hold
    first = next((b for b in layers if hasattr(b, "self_attn")), layers[0])
    attn, mlp = getattr(first, "self_attn", None), getattr(first, "mlp", None)
    if attn is None or mlp is None:
        return None
    kind = _attention_kind(attn)
    if kind is None:
        return None
    dense = all(hasattr(mlp, p) for p in ("gate_proj", "up_proj", "down_proj"))
    if not (dense or is_sparse_block(mlp)):
        return None
    if not (hasattr(inner, "embed_tokens") and hasattr(inner, "norm")):
        return None
    cfg = getattr(model, "config", None)
    heads = getattr(cfg, "num_attention_heads", None) or attn.q_proj.out_features // attn.head_dim
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    sparse = [b.mlp for b in layers if is_sparse_block(getattr(b, "mlp", None))]
    return Decoder("hf", layers, "model.layers", "self_attn", "mlp",
                   ("input_layernorm", "post_attention_layernorm"), True, "model.embed_tokens",
                   "model.norm", "lm_head", heads, kv,
                   mlp.gate_proj.out_features if dense else expert_width(mlp), sequence_parallel=False,
                   experts=n_experts(sparse[0]) if sparse else 0, top_k=top_k(sparse[0]) if sparse else 0,
                   attention=kind)


def _attention_kind(attn) -> Optional[str]:
    """``mha`` (q/k/v/o projections), ``mla`` (DeepSeek's latent attention) or None."""
    if all(getattr(attn, p, None) is not None for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
        return "mha"
    return "mla" if is_latent_attention(attn) else None


def _block_fqns(dec: Decoder, keep=None):
    return [(f"{dec.prefix}.{i}", b) for i, b in enumerate(dec.blocks) if keep is None or i in keep]


def _check_divides(layout, dec: Decoder, seq_len: Optional[int]) -> None:
    tp, cp = layout.size("tp"), layout.size("cp")
    where = f"--mesh {layout.text()}"
    for what, n in (("attention heads", dec.n_heads), ("key/value heads", dec.n_kv_heads),
                    ("MLP width (d_ff)", dec.d_ff)):
        if tp > 1 and n % tp:
            raise PlanError(f"{where}: the model's {n} {what} do not divide by tp={tp}; tensor "
                            f"parallelism splits them evenly: choose a tp that divides {n}")
    if seq_len is not None:
        need = cp * (tp if dec.sequence_parallel and tp > 1 else 1)
        if need > 1 and seq_len % need:
            parts = [f"cp={cp}"] * (cp > 1) + [f"tp={tp} (sequence parallel)"] * (need != cp)
            raise PlanError(f"{where}: the sequence length {seq_len} does not divide by "
                            f"{' x '.join(parts)} = {need}; each rank holds an equal part of the "
                            f"sequence: use a length that is a multiple of {need}")


# -- tensor parallelism ------------------------------------------------------------------------
def _apply_tp(model, dec: Decoder, tp_mesh, blocks, notes) -> None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel,
                                                   parallelize_module)
    a, m = dec.attn, dec.mlp
    sp = dec.sequence_parallel
    plan = {**_attention_tp_plan(dec, blocks, sp),
            f"{m}.up_proj": ColwiseParallel(),
            f"{m}.down_proj": RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel()}
    if dec.swiglu:
        plan[f"{m}.gate_proj"] = ColwiseParallel()
    if sp:
        plan.update({dec.norms[0]: SequenceParallel(), dec.norms[1]: SequenceParallel(),
                     a: PrepareModuleInput(input_layouts=(Shard(1), None),
                                           desired_input_layouts=(Replicate(), None)),
                     m: PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))})
    n = tp_mesh.size()
    for _, block in blocks:
        parallelize_module(block, tp_mesh, _block_tp_plan(plan, dec, getattr(block, m, None)))
        attn = getattr(block, a)
        if dec.family == "torchledger":      # its views use the head counts: each rank has its own
            attn.n_heads //= n
            attn.n_kv_heads //= n
        if dec.attention == "mla":
            sum_rotary_key_grads(attn, tp_mesh)
    if sp:
        root = {}
        # a learned position table: its rows split like the token table's, each rank's T/tp
        # positions reduce-scattered (Shard(0) of the (T, d) lookup), added to its T/tp tokens
        table = getattr(model, dec.pos_embed, None) if dec.pos_embed else None
        pos = ((dec.pos_embed, RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0))),) \
            if table is not None and not _is_placeholder(table) else ()
        for fqn, style in ((dec.embed, RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))),
                           *pos,
                           (dec.norm, SequenceParallel()),
                           (dec.head, ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()))):
            if not _is_placeholder(dec.module(model, fqn)):
                root[fqn] = style
        if root:
            parallelize_module(model, tp_mesh, root)
        notes.append(f"tp={n}: q/k/v, gate/up ColwiseParallel, o/down RowwiseParallel per block, "
                     f"sequence parallel (norms SequenceParallel; embedding"
                     + (", learned positions" if pos else "") + ", head sharded)")
    elif dec.attention == "mla":
        notes.append(f"tp={n}: latent attention's q (q_proj or q_b_proj) and kv_b_proj ColwiseParallel, o_proj "
                     f"RowwiseParallel, q_a_proj and kv_a_proj_with_mqa whole on every rank (the rotary "
                     f"key's gradient all-reduced over tp); gate/up ColwiseParallel, down RowwiseParallel "
                     f"(no sequence parallelism: a Hugging Face decoder)")
    else:
        notes.append(f"tp={n}: q/k/v, gate/up ColwiseParallel, o/down RowwiseParallel per block "
                     f"(no sequence parallelism: {_why_no_sp(dec)})")


def _why_no_sp(dec: Decoder) -> str:
    if dec.family == "hf":
        return "a Hugging Face decoder"
    if dec.pos_embed:
        return "learned positions, as Megatron's GPT without --sequence-parallel; --sequence-parallel on splits them"
    return "--sequence-parallel off"


def _attention_tp_plan(dec: Decoder, blocks, sp: bool) -> dict:
    """The attention's entries of the block tp plan: q/k/v ColwiseParallel and o RowwiseParallel
    (to Shard(1) under sequence parallelism), or latent attention's (:mod:`.hf_mla`)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    a = dec.attn
    if dec.attention == "mla":
        return latent_tp_plan(getattr(blocks[0][1], a), a) if blocks else {}
    return {f"{a}.q_proj": ColwiseParallel(), f"{a}.k_proj": ColwiseParallel(),
            f"{a}.v_proj": ColwiseParallel(),
            f"{a}.o_proj": RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel()}


def _block_tp_plan(plan, dec: Decoder, mlp) -> dict:
    """The block's TP plan: a sparse MoE block has no MLP projections to split (its tokens are
    split instead, :func:`_split_experts_over_tp`); its shared expert is split as an MLP."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    if not is_sparse_block(mlp):
        return plan
    m = dec.mlp
    out = {k: v for k, v in plan.items() if not k.startswith(f"{m}.")}
    for name in ("shared_expert", "shared_experts"):
        shared = getattr(mlp, name, None)
        if shared is not None and all(hasattr(shared, p) for p in ("gate_proj", "up_proj", "down_proj")):
            out.update({f"{m}.{name}.gate_proj": ColwiseParallel(), f"{m}.{name}.up_proj": ColwiseParallel(),
                        f"{m}.{name}.down_proj": RowwiseParallel()})
    return out


def _is_placeholder(module) -> bool:
    import torch.nn as nn
    return isinstance(module, nn.Identity)


# -- context parallelism -----------------------------------------------------------------------
def _cp_attention(cp_mesh):
    """SDPA for a rank that holds T/cp of the sequence: K and V all-gathered over the cp group
    (an autograd all-gather: backward reduce-scatters their gradients), the rank's T/cp queries
    against all T keys under the kernel's causal flag, with no mask: a [T/cp, T] one would be
    saved by SDPA in every layer (T^2/cp elements), and PyTorch's context_parallel and ring
    attention build none (the causal structure is the kernel's). The flag on T/cp x T counts
    half the pairs: a rank's work under PyTorch's load-balanced sharding (rank r holds chunks r
    and 2 cp - 1 - r of 2 cp, so every rank meets half of its T/cp x T pairs). Fake tensors hold
    no values: the flag's top-left alignment, not the rank's offset, changes no figure."""
    from torch.distributed._functional_collectives import all_gather_single_autograd

    def sdpa(q, k, v, attn_mask=None, is_causal=False, **kw):
        k = all_gather_single_autograd(k.contiguous(), gather_dim=2, group=cp_mesh)
        v = all_gather_single_autograd(v.contiguous(), gather_dim=2, group=cp_mesh)
        return fused_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kw)
    return sdpa


#: The name the Hugging Face attention function of context parallelism is registered under.
HF_CP_ATTENTION = "torchledger_cp"


def _hf_cp_attention(model, layers, cp_mesh) -> None:
    """Context parallelism for a Hugging Face decoder: an attention function (registered once in
    transformers' AttentionInterface, with the sdpa mask) that all-gathers K and V over the
    layer's cp group and runs SDPA as :func:`_cp_attention` does (the kernel's causal flag, no
    mask, K/V at their KV heads with ``enable_gqa``; transformers' own sdpa attention would cut
    the keys to the queries' length under the flag); the model's config selects it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attention(module, query, key, value, attention_mask, **kwargs):
        mesh = getattr(module, "_torchledger_cp", None)
        if mesh is None:                      # a layer the plan did not touch
            return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        gqa = {"enable_gqa": True} if query.shape[1] != key.shape[1] else {}
        out = _cp_attention(mesh)(query, key, value, is_causal=True, dropout_p=kwargs.get("dropout", 0.0),
                                  scale=kwargs.get("scaling"), **gqa)
        return out.transpose(1, 2).contiguous(), None

    if HF_CP_ATTENTION not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(HF_CP_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    AttentionInterface.register(HF_CP_ATTENTION, attention)
    for _, layer in layers:
        layer.self_attn._torchledger_cp = cp_mesh
    model.config._attn_implementation = HF_CP_ATTENTION


def cp_inputs(inputs, cp: int, rank: int, seq_len: int):
    """This cp rank's part of the inputs: every tensor whose dim 1 is the sequence, narrowed
    to its ``seq_len / cp`` positions (rank r holds [r T/cp, (r+1) T/cp))."""
    import torch
    part = seq_len // cp

    def cut(x):
        if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[1] == seq_len:
            return x.narrow(1, rank * part, part)
        if isinstance(x, dict):
            return {k: cut(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(cut(v) for v in x)
        return x
    return cut(inputs)


# -- expert parallelism ------------------------------------------------------------------------
def _sparse_blocks(dec, blocks) -> list:
    """(fqn, sparse block) of the Hugging Face mixture-of-experts layers among ``blocks``."""
    if dec is None or dec.family != "hf":
        return []
    return [(f"{fqn}.{dec.mlp}", getattr(b, dec.mlp)) for fqn, b in blocks
            if is_sparse_block(getattr(b, dec.mlp, None))]


def _check_moe(dec, layout, model) -> None:
    """What the plan cannot do with a mixture-of-experts decoder: one line."""
    if dec is not None and dec.family == "torchledger" and layout.size("tp") > 1 and _has_experts(model):
        raise PlanError(f"--mesh {layout.text()}: tp on torchledger's MoE layers is not simulated yet "
                        f"(their experts would need a tp plan); use ep and dp for them, or a Hugging "
                        f"Face MoE decoder, whose tokens tp splits")
    if dec is None or not dec.experts:
        return
    ep = layout.size("ep")
    if ep > 1 and dec.experts % ep:
        raise PlanError(f"--mesh {layout.text()}: the model's {dec.experts} experts do not divide by "
                        f"ep={ep}; choose an ep that divides {dec.experts}")


def _fused_latent_attention(model, notes) -> None:
    if use_fused_latent_attention(model):
        notes.append("latent attention: where q/k and v head dims differ, on fake tensors the memory-efficient "
                     "kernel SDPA runs for them on a GPU, causal by its flag (CPU's SDPA would take its math "
                     "path, scores materialised)")


def _use_balanced(model, dec, blocks, notes) -> None:
    sparse = _sparse_blocks(dec, blocks)
    if not sparse:
        return
    use_balanced_experts(model, sparse)
    notes.append(f"experts: {len(sparse)} mixture-of-experts layers computed by the plan's forward (one "
                 f"batched matmul per projection over the {dec.experts} experts) under balanced routing, "
                 f"assumed: fake tensors cannot know the router's choices, so each expert takes "
                 f"ceil(tokens x {dec.top_k} / {dec.experts}) rows")


def _own_experts(moe) -> bool:
    """The plan shards this MLP's experts apart from the block's dense weights."""
    if moe is None:
        return False
    return getattr(moe, "ep_mesh", None) is not None or (is_sparse_block(moe) and owns_experts(moe))


def _split_experts_over_tp(dec, blocks, mesh, layout, notes) -> bool:
    """Hugging Face MoE layers under tp: each tp rank routes its share of the tokens."""
    sparse = _sparse_blocks(dec, blocks)
    if not sparse:
        return False
    if layout.size("dp_replicate") > 1 and layout.size("dp") == 1:
        raise PlanError(f"--mesh {layout.text()}: tp with dp_replicate alone on mixture-of-experts layers "
                        f"is not simulated yet (the experts' gradients reduce over dp_replicate x tp); "
                        f"add dp or use dp instead of dp_replicate")
    tp = layout.size("tp")
    for _, mlp in sparse:
        split_over_tp(mlp, mesh["tp"])
    notes.append(f"tp={tp} on the MoE layers (expert TP 1, as Megatron): each tp rank routes tokens/{tp} "
                 f"of the block's tokens to the experts, the outputs all-gathered over tp; the experts "
                 f"whole on every tp rank and data-parallel over tp (sharded over dp x cp x tp)")
    return True


def _has_experts(model) -> bool:
    """The model's config says it has experts (its other pipeline stages may hold them)."""
    cfg = getattr(model, "config", None)
    names = ("num_experts", "num_local_experts", "n_experts")
    return any((getattr(cfg, name, None) or 0) > 0 for name in names)


def _apply_ep(model, dec, blocks, mesh, layout, notes, pipelined=False) -> None:
    """Each ep rank keeps E / ep of every MoE layer's experts; tokens reach them by all-to-all."""
    ep = layout.size("ep")
    sparse = _sparse_blocks(dec, blocks)
    moes = [getattr(b, dec.mlp) for _, b in blocks] if dec is not None else []
    moes = [m for m in moes if hasattr(m, "experts") and hasattr(m, "n_experts")]
    if not moes and not sparse and pipelined and _has_experts(model):
        notes.append(f"ep={ep}: this stage holds no mixture-of-experts layers; its weights are "
                     f"data-parallel over ep")
        return
    if not moes and not sparse:
        raise PlanError(f"--mesh {layout.text()}: ep={ep} shards experts, and the model has no "
                        f"mixture-of-experts layers (torchledger.models.moe.MoEConfig, or a Hugging Face "
                        f"sparse MoE block); drop ep")
    ep_mesh = mesh["ep"]
    if sparse:
        for _, mlp in sparse:
            local = shard_experts(mlp, ep_mesh)
            mlp.ep_mesh = ep_mesh
        notes.append(f"ep={ep}: each rank holds {local} of {dec.experts} experts per MoE layer; tokens "
                     f"dispatched and combined by all-to-all over the ep group (balanced: each rank "
                     f"receives tokens x {dec.top_k} / {ep} rows)")
        return
    _shard_moe(moes, ep_mesh, layout)
    notes.append(f"ep={ep}: each rank holds {moes[0].n_experts // ep} of {moes[0].n_experts} experts per "
                 f"MoE layer; tokens dispatched and combined by all-to-all")


def _shard_moe(moes, ep_mesh, layout) -> None:
    """torchledger's MoE layers (:mod:`torchledger.models.moe`): this rank's E / ep experts."""
    import torch
    ep, r = ep_mesh.size(), ep_mesh.get_local_rank()
    for moe in moes:
        if moe.n_experts % ep:
            raise PlanError(f"--mesh {layout.text()}: the model's {moe.n_experts} experts do not divide by "
                            f"ep={ep}; choose an ep that divides {moe.n_experts}")
        local = moe.n_experts // ep
        for name in ("w_gate", "w_up", "w_down"):
            w = getattr(moe.experts, name)
            setattr(moe.experts, name, torch.nn.Parameter(w.detach()[r * local:(r + 1) * local].clone()))
        moe.ep_mesh = ep_mesh


# -- checkpointing -----------------------------------------------------------------------------
def _op_policy():
    """torchtitan's selective op policy: save matmul outputs (all but every second mm),
    attention outputs and reduce-scatters; recompute everything else."""
    import torch
    from torch.utils.checkpoint import CheckpointPolicy
    aten = torch.ops.aten
    save = {aten.mm.default, aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default,
            torch.ops._c10d_functional.reduce_scatter_tensor.default}

    def make():
        count = {"mm": 0}

        def policy(ctx, func, *args, **kwargs):
            if func is aten.mm.default:
                if not ctx.is_recompute:
                    count["mm"] += 1
                return CheckpointPolicy.MUST_SAVE if count["mm"] % 2 == 1 else CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE if func in save else CheckpointPolicy.PREFER_RECOMPUTE
        return policy
    return make


def _sac_contexts(policy) -> tuple:
    """``create_selective_checkpoint_contexts(policy)`` whose two modes let profiler ops
    (``profiler._record_function_enter_new``/``_exit``) through unrecorded.

    NB: FSDP2's pre-forward hook runs before the checkpoint's (it is registered with
    ``prepend=True``), so in forward its mixed-precision input cast and the
    ``record_function`` around it sit outside the checkpointed region, while the recompute
    calls the block with its hooks inside it: the recompute then meets a profiler op the
    forward never stored ("encountered during backward but not found in storage") and every
    ``--checkpointing selective-op --precision bf16-mixed`` step under FSDP2 failed. Profiler
    ops move no data and have no output to save: both modes call them as they come."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts
    contexts = create_selective_checkpoint_contexts(policy)
    for mode in contexts:
        base = type(mode)
        if not hasattr(base, "__torch_dispatch__"):
            continue                     # another torch's contexts: as they are

        class PassProfiler(base):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None, _base=base):
                if getattr(func, "namespace", None) == "profiler":
                    return func(*args, **(kwargs or {}))
                return _base.__torch_dispatch__(self, func, types, args, kwargs)

        mode.__class__ = PassProfiler
    return contexts


def _apply_checkpointing(blocks, mode: str, notes) -> None:
    from torch.distributed._composable import checkpoint
    if mode == "none":
        return
    if mode == "selective-op":
        make = _op_policy()
        for _, block in blocks:
            checkpoint(block, context_fn=lambda m=make: _sac_contexts(m()))
        notes.append("checkpointing selective-op: every block, matmul (all but every second), "
                     "attention and reduce-scatter outputs saved, the rest recomputed")
        return
    every = 2 if mode == "selective-layer" else 1
    done = 0
    for i, (_, block) in enumerate(blocks):
        if i % every == 0:
            checkpoint(block)
            done += 1
    notes.append(f"checkpointing {mode}: {done} of {len(blocks)} blocks recompute their forward in backward")


def _no_cache_in_recompute(model, dec, mode: str, notes) -> None:
    """A Hugging Face decoder whose blocks are checkpointed builds no key/value cache, as
    transformers' own gradient checkpointing sets ``use_cache=False``: a block recomputed in
    backward would append its keys (DeepSeek's latents) to the cache a second time and recompute
    other shapes than it saved."""
    cfg = getattr(model, "config", None)
    if mode == "none" or dec.family != "hf" or not getattr(cfg, "use_cache", False):
        return
    cfg.use_cache = False
    notes.append(f"checkpointing {mode}: use_cache=False (no key/value cache built in the training forward, "
                 f"as transformers' gradient checkpointing sets it)")


def _checkpoint_attention(model, dec, blocks, notes) -> None:
    """Megatron's selective recompute: the attention core of every block (scores, softmax,
    weighted values: the SDPA call) is recomputed in backward; its inputs Q, K, V are saved,
    its output and softmax statistics are not. torchledger's decoders: the attention's
    ``sdpa`` (over context parallelism's, when set); Hugging Face ones: an attention function
    around the one the config selects."""
    import torch
    from torch.utils.checkpoint import checkpoint

    def recomputed(fn):
        def attend(*args, **kwargs):
            return checkpoint(fn, *args, use_reentrant=False, **kwargs)
        return attend

    if dec.family == "hf":
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        inner_name = model.config._attn_implementation or "sdpa"
        inner = ALL_ATTENTION_FUNCTIONS.get(inner_name)
        if inner is None:       # "eager": the model's own attention code, around the sdpa one
            inner_name, inner = "sdpa", ALL_ATTENTION_FUNCTIONS["sdpa"]
        name = f"torchledger_selective_{inner_name}"
        AttentionInterface.register(name, recomputed(inner))
        if name not in ALL_MASK_ATTENTION_FUNCTIONS:
            AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS.get(inner_name)
                                            or ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
        model.config._attn_implementation = name
    else:
        for _, block in blocks:
            attn = getattr(block, dec.attn)
            attn.sdpa = recomputed(attn.sdpa or torch.nn.functional.scaled_dot_product_attention)
    notes.append(f"checkpointing selective-attention: the attention core of {len(blocks)} blocks recomputed "
                 f"in backward (Megatron's selective recompute)")


def default_optimizer(layout):
    """The optimizer a model file without ``AuditSpec(optimizer=)`` trains with: AdamW; under
    ``--kernels te`` without PyTorch's foreach path, whose intermediates are a list the size of
    the parameters (``tracer.gpu_kernels``): Megatron-Core and NeMo step with Transformer
    Engine's (or Apex's) FusedAdam, one multi-tensor kernel that keeps none, which the step-time
    model prices as fused; the for-loop holds one parameter's at a time, the nearest in memory."""
    import functools
    import torch
    if layout is not None and layout.megatron:
        return functools.partial(torch.optim.AdamW, foreach=False)
    return torch.optim.AdamW


def make_optimizer(factory, model, layout):
    """The step's optimizer: ``factory(model.parameters())``; under a precision with 16-bit
    weights (:data:`~.layout.PARAMS_16`) ``factory`` over fp32 master copies of them, as
    Megatron's mixed precision runs: the step casts each 16-bit gradient to an fp32 one on the
    master (freeing the 16-bit one), updates the masters and copies them back into the
    weights; the copies are the optimizer phase's ops.

    Under Megatron's distributed optimizer (``layout.optimizer_shards`` d > 1: ``--kernels te``
    with ``dp_replicate``) each rank's optimizer holds 1/d of every parameter (its first
    ceil(n/d) elements, the fullest rank's share): fp32 master shards of 16-bit weights, or
    views of fp32 weights (their moments sharded, the weights and gradients whole), Megatron's
    "4 + 16/d" and "8 + 8/d" bytes a parameter. The gradients' reduce-scatter and the weights'
    all-gather carry the bytes of the all-reduce the replicas already run (not traced twice)."""
    import torch
    params = list(model.parameters())
    sixteen = (torch.bfloat16, torch.float16)
    shards = layout.optimizer_shards if layout is not None else 1
    masters16 = (layout is not None and layout.precision in PARAMS_16
                 and any(q.dtype in sixteen for q in params))
    if shards > 1 and any(q.requires_grad for q in params):
        return _sharded_optimizer(factory, params, shards, masters16)
    if not masters16:
        return factory(params)      # (a model file's own plan that kept fp32 weights: no masters)
    masters = [q.detach().float().requires_grad_(q.requires_grad) for q in params]
    opt = factory(masters)
    pairs = list(zip(params, masters))

    def grads_to_masters(optimizer, args, kwargs):
        for q, m in pairs:
            m.grad = None if q.grad is None else q.grad.float()
            q.grad = None

    def masters_to_weights(optimizer, args, kwargs):
        with torch.no_grad():
            for q, m in pairs:
                q.copy_(m)
                m.grad = None

    opt.register_step_pre_hook(grads_to_masters)
    opt.register_step_post_hook(masters_to_weights)
    return opt


def _flat_local(t):
    """``t``'s elements on this rank as one flat view (a DTensor's local shard)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.view(-1) if local.is_contiguous() else local.reshape(-1)


def _sharded_optimizer(factory, params, shards: int, masters16: bool):
    """:func:`make_optimizer` under the distributed optimizer: ``factory`` over this rank's
    1/``shards`` of every trainable parameter."""
    import torch
    trained = [q for q in params if q.requires_grad]
    pairs = []
    for q in trained:
        flat = _flat_local(q.detach())
        part = flat[:-(-flat.numel() // shards)]
        if masters16 and q.dtype in (torch.bfloat16, torch.float16):
            pairs.append((q, part.float().requires_grad_(), True))
        else:
            pairs.append((q, part.requires_grad_(), False))      # a view: the weight itself
    opt = factory([m for _, m, _ in pairs])

    def grads_to_shards(optimizer, args, kwargs):
        for q, m, copy in pairs:
            if q.grad is None:
                m.grad = None
                continue
            g = _flat_local(q.grad)[:m.numel()]
            m.grad = g.float() if copy else g
            if copy:
                q.grad = None

    def shards_to_weights(optimizer, args, kwargs):
        with torch.no_grad():
            for q, m, copy in pairs:
                if copy:
                    _flat_local(q.detach())[:m.numel()].copy_(m)
                m.grad = None

    opt.register_step_pre_hook(grads_to_shards)
    opt.register_step_post_hook(shards_to_weights)
    setattr(opt, OPTIMIZER_SHARDS_ATTR, shards)
    return opt


# -- precision ---------------------------------------------------------------------------------
def _to_dtype(model, dtype) -> None:
    """Parameters (and floating buffers) to ``dtype`` in place of ``model.to``, which cannot
    swap fake parameters."""
    import torch
    for m in model.modules():
        for name, p in list(m._parameters.items()):
            if p is not None and p.is_floating_point():
                m._parameters[name] = torch.nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
        for name, b in list(m._buffers.items()):
            if b is not None and b.is_floating_point():
                m._buffers[name] = b.to(dtype)


def _autocast_device(module) -> str:
    """The device type autocast must name for ``module``'s step: ``cuda`` for a model on a CUDA
    device (``--device cuda``; autocast("cpu") would leave its matmuls in fp32), else ``cpu``
    (fake and meta steps run CPU kernels)."""
    for p in module.parameters():
        return "cuda" if p.device.type == "cuda" else "cpu"
    return "cpu"


def _autocast_forward(model, dtype) -> None:
    """Autocast around every call of ``model``, entered by a forward pre-hook and left by a
    forward hook that runs even when forward raises: it belongs to the module's call, not to
    its ``forward`` attribute, so a runner that calls the model with another forward (the
    pipeline stage runner runs one chunk at a time) computes in ``dtype`` too."""
    import torch
    entered = []

    def enter(module, args):
        ctx = torch.autocast(_autocast_device(module), dtype=dtype)
        ctx.__enter__()
        entered.append(ctx)

    def leave(module, args, output):
        if entered:
            entered.pop().__exit__(None, None, None)

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave, always_call=True)


# -- data parallelism --------------------------------------------------------------------------
def _dp_mesh(mesh, layout):
    """(mesh for fully_shard or replicate, kind) of the data-parallel dims, or (None, None)."""
    rep = layout.size("dp_replicate") > 1
    names = mesh.mesh_dim_names or ()
    # ep and cp ranks hold the same dense weights and see other tokens: FSDP shards over them too
    shard_name = _flat(mesh, [n for n in ("dp", "ep", "cp") if n in names and (layout.size(n) > 1)])
    if rep and shard_name:
        import warnings
        with warnings.catch_warnings():     # torch asks to keep the flattened mesh; it is sliced once
            warnings.simplefilter("ignore", UserWarning)
            return mesh["dp_replicate", shard_name], "hsdp"
    if shard_name:
        import warnings
        with warnings.catch_warnings():     # the same: a flattened dim (dp x ep, dp x cp) sliced once
            warnings.simplefilter("ignore", UserWarning)
            return mesh[shard_name], "fsdp"
    if rep:
        # torchtitan's DDP (``apply_ddp``) is for dp_replicate alone (it refuses any other dim
        # with it); with tp, cp or pp the gradients are all-reduced by FSDP2's replicate
        alone = layout.world_size == layout.size("dp_replicate")
        return mesh["dp_replicate"], "ddp" if alone else "replicate"
    return None, None


def _flat(mesh, shard):
    """The name of the mesh dim over ``shard`` (flattened when several), or None."""
    if len(shard) < 2:
        return shard[0] if shard else None
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    name = "_".join(shard)
    if name not in (mesh.mesh_dim_names or ()):
        with unset_fake_temporarily():      # the flattened mesh's rank map is a real tensor
            mesh[tuple(shard)]._flatten(name)
    return name


def _experts_mesh(mesh, layout, tp_split=False):
    """(mesh, replicated) for each rank's own experts: the data-parallel dims but ep (dp and cp:
    cp ranks hold the same experts and route other tokens to them; tp too when its ranks split
    the tokens)."""
    import warnings
    name = _flat(mesh, [n for n in ("dp", "cp") + ("tp",) * tp_split if layout.size(n) > 1])
    rep = layout.size("dp_replicate") > 1
    with warnings.catch_warnings():         # a flattened dim sliced once (see _dp_mesh)
        warnings.simplefilter("ignore", UserWarning)
        if name and rep:
            return mesh["dp_replicate", name], False
        if name:
            return mesh[name], False
    return (mesh["dp_replicate"], True) if rep else (None, False)


def _shard_own_experts(dec, blocks, mesh, layout, kw, tp_split) -> set:
    """FSDP2 for the experts ep or tp split off (before their blocks'); the parameters it leaves
    whole on their rank, for the blocks to ignore.

    Each rank's own experts are sharded over dp (and cp, tp) only, their gradients reduced there
    (HSDP with dp_replicate); with none of them they stay whole on their rank, outside FSDP2,
    their gradients all-reduced over dp_replicate if any."""
    from torch.distributed.fsdp import fully_shard
    if dec is None or not (layout.size("ep") > 1 or tp_split):
        return set()
    experts_mesh, replicated = _experts_mesh(mesh, layout, tp_split)
    local = set()
    for _, block in blocks:
        moe = getattr(block, dec.mlp, None)
        if not _own_experts(moe):
            continue
        if experts_mesh is not None and not replicated:
            fully_shard(moe.experts, **dict(kw, mesh=experts_mesh))
            continue
        local.update(moe.experts.parameters())
        if replicated:
            _replicate_experts(moe.experts, experts_mesh, kw.get("mp_policy"))
    return local


def _replicate_experts(experts, rep_mesh, mp_policy) -> None:
    from torch.distributed._composable.replicate_with_fsdp import replicate
    replicate(experts, mesh=rep_mesh, **({"mp_policy": mp_policy} if mp_policy is not None else {}))


def apply_standard_plan(model, mesh, layout, *, seq_len=None, blocks=None, pipelined=False):
    """Apply the layout's standard plan to ``model`` in place; returns (model, notes).

    ``blocks``: indices of the blocks this rank holds (a pipeline stage), None for all.
    PlanError (one line) when the layout cannot apply to this model. In torchtitan's order:
    precision, TP, CP, EP, checkpointing, data parallelism."""
    import torch
    notes = []
    dec = find_decoder(model, layout)
    _check_plan_applies(model, dec, layout, seq_len)
    mixed = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(layout.precision)
    _apply_precision(model, layout, notes)
    chosen = _block_fqns(dec, blocks) if dec is not None else []
    tp_split = _apply_model_parallel(model, dec, chosen, mesh, layout, notes, pipelined)
    dp_mesh, kind = _dp_mesh(mesh, layout) if mesh is not None else (None, None)
    _apply_data_parallel(model, dec, chosen, mesh, layout, notes, pipelined=pipelined, mixed=mixed,
                         tp_split=tp_split, dp_mesh=dp_mesh, kind=kind)
    if mixed is not None:
        if kind in (None, "ddp"):               # torchtitan's maybe_enable_amp: DDP runs under AMP
            _autocast_forward(model, mixed)
            notes.append(f"precision {layout.precision}: autocast around the forward (fp32 parameters)")
        else:
            notes.append(f"precision {layout.precision}: MixedPrecisionPolicy(param_dtype="
                         f"{str(mixed).replace('torch.', '')}, reduce_dtype=float32)")
    return model, notes


def _check_plan_applies(model, dec, layout, seq_len) -> None:
    """PlanError when the layout needs a decoder the standard plan does not recognise, or does
    not divide this one."""
    if dec is None:
        needs = [n for n in ("tp", "cp", "pp", "ep") if layout.size(n) > 1]
        if needs or layout.checkpointing != "none":
            what = ", ".join(f"{n}={layout.size(n)}" for n in needs) or f"--checkpointing {layout.checkpointing}"
            raise PlanError(f"--mesh {layout.text()}: the standard plan applies {what} to decoders it "
                            f"recognises (torchledger's models, Hugging Face Llama/Mistral/Qwen2 and "
                            f"Mixtral/Qwen2-MoE/Qwen3-MoE/GPT-OSS/DeepSeek-V2/V3), not {type(model).__name__}; add "
                            f"AuditSpec(parallelize=fn), fn(model, mesh) applying your own plan and "
                            f"returning the model")
    else:
        _check_moe(dec, layout, model)
        _check_divides(layout, dec, seq_len)


def _apply_precision(model, layout, notes: list) -> None:
    """``bf16`` and Megatron-style 16-bit weights: the parameters cast in place (mixed
    precision is applied with data parallelism or autocast, later)."""
    import torch
    if layout.precision == "bf16":
        _to_dtype(model, torch.bfloat16)
        notes.append("precision bf16: parameters, gradients and optimizer state in bf16")
    elif layout.precision in PARAMS_16:
        _to_dtype(model, getattr(torch, PARAMS_16[layout.precision]))
        notes.append(f"precision {layout.precision}: {PARAMS_16[layout.precision]} weights and gradients, fp32 "
                     f"master weights and optimizer state (Megatron's mixed precision)"
                     + ("; the blocks' GEMMs priced in fp8 (Transformer Engine), traced in bf16"
                        if layout.precision == "fp8" else ""))
    d = layout.optimizer_shards
    if d > 1:
        notes.append(f"distributed optimizer (Megatron's, --kernels te): the master weights and optimizer state "
                     f"split over the {d} dp_replicate ranks, each updating its 1/{d} of every parameter")


def _apply_model_parallel(model, dec, chosen, mesh, layout, notes: list, pipelined: bool):
    """TP, CP, EP and checkpointing on the ``chosen`` blocks; returns whether the experts were
    split over tp (data parallelism then shards them differently)."""
    tp, cp = layout.size("tp"), layout.size("cp")
    if dec is not None and tp > 1:
        _apply_tp(model, dec, mesh["tp"], chosen, notes)
    tp_split = tp > 1 and _split_experts_over_tp(dec, chosen, mesh, layout, notes)
    if dec is not None and cp > 1:
        if dec.family == "hf":
            _hf_cp_attention(model, chosen, mesh["cp"])
        else:
            sdpa = _cp_attention(mesh["cp"])
            for _, block in chosen:
                getattr(block, dec.attn).sdpa = sdpa
        notes.append(f"cp={cp}: each rank holds T/{cp} of the sequence; attention all-gathers K and V "
                     f"over the cp group (reduce-scatters their gradients in backward)")
    _use_balanced(model, dec, chosen, notes)
    if dec is not None and dec.attention == "mla" and cp == 1:
        _fused_latent_attention(model, notes)
    if layout.size("ep") > 1:
        _apply_ep(model, dec, chosen, mesh, layout, notes, pipelined)
    if dec is not None and layout.checkpointing == "selective-attention":
        _checkpoint_attention(model, dec, chosen, notes)
    elif dec is not None:
        _no_cache_in_recompute(model, dec, layout.checkpointing, notes)
        _apply_checkpointing(chosen, layout.checkpointing, notes)
    return tp_split


def _apply_data_parallel(model, dec, chosen, mesh, layout, notes: list, *, pipelined, mixed, tp_split,
                         dp_mesh, kind) -> None:
    """FSDP2 or HSDP per block and the root, DDP as FSDP2's ``replicate``, or (tp alone) the
    experts split over tp sharded; ``kind`` and ``dp_mesh`` from :func:`_dp_mesh`."""
    import torch
    if kind in ("fsdp", "hsdp"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        kw = {"mesh": dp_mesh, "reshard_after_forward": not pipelined}
        if mixed is not None:
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=mixed, reduce_dtype=torch.float32)
        local_experts = _shard_own_experts(dec, chosen, mesh, layout, kw, tp_split)
        ignored = {"ignored_params": local_experts} if local_experts else {}
        for _, block in chosen:
            fully_shard(block, **kw, **ignored)
        fully_shard(model, **kw, **ignored)
        n = dp_mesh.size()
        notes.append(f"{'HSDP' if kind == 'hsdp' else 'FSDP2'} over {n} ranks "
                     f"({' x '.join(map(str, dp_mesh.shape))}): fully_shard per block and the root"
                     + ("" if dec is not None else " (the model is not a known decoder: the root is one unit)")
                     + ("; reshard_after_forward=False (pipelined)" if pipelined else ""))
    elif tp_split and kind is None:                 # tp alone: the experts sharded over tp
        from torch.distributed.fsdp import fully_shard
        for _, mlp in _sparse_blocks(dec, chosen):
            fully_shard(mlp.experts, mesh=_experts_mesh(mesh, layout, True)[0])
    elif kind == "ddp":                             # torchtitan's apply_ddp
        from torch.distributed._composable.replicate import replicate
        replicate(model, device_mesh=dp_mesh, bucket_cap_mb=DDP_BUCKET_CAP_MB)
        # DDP is built now, not in the first forward: its construction broadcasts rank 0's
        # parameters once a run (setup, as a DistributedDataParallel made in parallelize), not a step
        replicate.state(model).lazy_init()
        notes.append(f"DDP over {dp_mesh.size()} ranks (DistributedDataParallel, bucket_cap_mb="
                     f"{DDP_BUCKET_CAP_MB:g} as torchtitan: gradients all-reduced in buckets of up to "
                     f"{DDP_BUCKET_CAP_MB:g} MiB)")
    elif kind == "replicate":
        from torch.distributed._composable.replicate_with_fsdp import replicate
        kw = {"mesh": dp_mesh}
        if mixed is not None:
            from torch.distributed.fsdp import MixedPrecisionPolicy
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=mixed, reduce_dtype=torch.float32)
        replicate(model, **kw)
        notes.append(f"DDP over {dp_mesh.size()} ranks (FSDP2's replicate: gradients all-reduced)")
