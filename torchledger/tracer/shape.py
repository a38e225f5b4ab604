"""Recognise a model's architecture so predictions can be made from the record alone.

Returns a plain dict in ``TransformerConfig`` terms (vocab_size, d_model, n_layers,
n_heads, n_kv_heads, d_ff, mlp, norm, bias, tie_embeddings, n_positions) for torchledger's
reference models, Hugging Face models and nanoGPT-style models (from their ``config``
attribute names), a Cruncher dict for the course model. Encoder-decoder models (T5, BART
and their kin: a module named ``encoder`` and one named ``decoder``, each with a list of
layers) add ``encoder_decoder: True``, ``n_encoder_layers`` and ``n_decoder_layers`` (counted
from those lists), and ``n_layers`` is their sum: the predictions count every layer, and a
decoder layer's cross-attention. A model with no ``config`` that
looks like a transformer (a token embedding and a list of identical blocks) gets a
*partial* dict (``partial: True``): L, d and V from its modules, heads if a block names
them; enough for 12Ld^2 + Vd and the attention term, not for an exact count. Such a model
with an encoder and a decoder stack (``nn.Transformer``) is an encoder-decoder too, even
when it has no embedding (V = 0, d from its attention). None when
nothing is recognised. The predictions built from it say when the model holds parameters
the config does not describe.
"""
from __future__ import annotations

import dataclasses
import re
from ..models.config import CruncherConfig, TransformerConfig

__all__ = ["model_config"]


def model_config(model):
    cfg = getattr(model, "config", None)
    if cfg is None:
        return _from_modules(model)
    if isinstance(cfg, (TransformerConfig, CruncherConfig)):
        d = dataclasses.asdict(cfg)
        d["kind"] = cfg.kind
        d["source"] = "torchledger"
        return d
    if hasattr(cfg, "to_dict") or dataclasses.is_dataclass(cfg) or hasattr(cfg, "__dict__"):
        return _from_attrs(cfg, model)
    return None


def _first(cfg, *names, default=None):
    for n in names:
        v = getattr(cfg, n, None)
        if v is not None:
            return v
    return default


def _from_attrs(cfg, model):
    """Hugging Face configs and nanoGPT-style config dataclasses, by their attribute names."""
    d = _first(cfg, "hidden_size", "n_embd", "d_model", "dim")
    # T5 maps num_hidden_layers to num_layers, BART to encoder_layers: the encoder's count
    L = _first(cfg, "num_hidden_layers", "n_layer", "num_layers", "n_layers")
    h = _first(cfg, "num_attention_heads", "n_head", "num_heads", "n_heads")
    V = _first(cfg, "vocab_size")
    if not all(isinstance(x, int) for x in (d, L, h, V)):
        return None
    act = str(_first(cfg, "hidden_act", "hidden_activation", "activation_function", "dense_act_fn",
                     default="")).lower()
    model_type = str(getattr(cfg, "model_type", ""))
    ff = _first(cfg, "intermediate_size", "n_inner", "d_ff", "encoder_ffn_dim")
    # T5's head_dim is an alias of d_kv (its attribute_map)
    head_dim = _first(cfg, "head_dim", "attention_head_dim", "d_kv")
    # multi-head latent attention (DeepSeek-V2/V3): Q K^T runs at qk_nope + qk_rope per head,
    # x V at v_head_dim; their config's head_dim is the rope part alone
    nope, rope, v_dim = (getattr(cfg, n, None) for n in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    mla = all(isinstance(x, int) and x > 0 for x in (nope, rope, v_dim))
    norm = "rmsnorm" if (hasattr(cfg, "rms_norm_eps") and not hasattr(cfg, "layer_norm_epsilon")) else "layernorm"
    out = {
        "kind": "transformer",
        "source": (f"huggingface:{model_type or type(cfg).__name__}" if hasattr(cfg, "to_dict")
                   else f"config:{type(cfg).__name__}"),
        "vocab_size": V, "d_model": d, "n_layers": L, "n_heads": h,
        "n_kv_heads": _first(cfg, "num_key_value_heads", default=h),
        "d_ff": ff if isinstance(ff, int) else 4 * d,
        "mlp": _mlp_kind(cfg, model, act, model_type), "norm": norm,
        "bias": bool(_first(cfg, "attention_bias", "bias", default=model_type == "gpt2")),
        "tie_embeddings": bool(_first(cfg, "tie_word_embeddings", default=True)),
        "n_positions": _learned_positions(cfg, model, V),
        # attention runs at heads x head_dim, which some models (Gemma) set apart from d
        "d_attn": h * head_dim if isinstance(head_dim, int) and head_dim > 0 else d,
    }
    if mla:
        out.update(d_attn_qk=h * (nope + rope), d_attn_v=h * v_dim, d_attn=h * (nope + rope + v_dim) // 2)
    stacks = _encoder_decoder_layers(model)
    if stacks is not None:
        out.update(encoder_decoder=True, n_encoder_layers=stacks[0], n_decoder_layers=stacks[1],
                   n_layers=stacks[0] + stacks[1])
        out.update(_stack_probes(model))
    out.update(_experts(model, cfg))
    out.update(_mixer(model, cfg))
    return out


#: Children of a gated MLP's module: Llama/Gemma/Qwen's gate_proj, T5 v1.1's wi_0 + wi_1,
#: Phi-3's fused gate_up_proj, torchtitan's w1 + w2 + w3.
_GATES = ({"gate_proj"}, {"wi_0", "wi_1"}, {"gate_up_proj"}, {"w1", "w2", "w3"})


def _gated_structure(model) -> bool:
    """A module of ``model`` holds a gated MLP's projections (:data:`_GATES`, as children or,
    for stacked experts such as Mixtral's, as its own parameters)."""
    if model is None or not hasattr(model, "named_modules"):
        return False
    for _, module in model.named_modules():
        names = {n for n, _ in module.named_children()} | {n for n, _ in module.named_parameters(recurse=False)}
        if any(g <= names for g in _GATES):
            return True
    return False


def _mlp_kind(cfg, model, act: str, model_type: str) -> str:
    """'swiglu', 'geglu' or 'gelu' (two matrices, whatever their activation): gated when the
    model's modules hold a gate (:func:`_gated_structure`: Gemma names GELU and gates), or the
    config says so (T5's ``is_gated_act``) or names SiLU (every such Hugging Face model gates);
    the gate's activation from the config's name (``hidden_act``, Gemma's
    ``hidden_activation``, T5's ``dense_act_fn``): GELU's variants make GeGLU (Gemma, T5
    v1.1), anything else SwiGLU."""
    gated = (_gated_structure(model) or bool(getattr(cfg, "is_gated_act", False))
             or (act in ("silu", "swish") and model_type not in ("gpt2",)))
    if not gated:
        return "gelu"
    return "geglu" if "gelu" in act else "swiglu"


_EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def _experts(model, cfg=None) -> dict:
    """A mixture of experts: ``n_experts`` (E, from the config, else the length of the
    experts' list or the leading dim of their stacked weights), ``expert_params`` (every
    parameter of the topmost modules named ``experts``, counted off the model) and
    ``moe_layers`` (how many such modules). Empty for a dense model."""
    if model is None:
        return {}
    import torch.nn as nn
    found = []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "experts" and not any(name.startswith(f + ".") for f, _ in found):
            found.append((name, module))
    if not found:
        return {}
    E = _first(cfg, *_EXPERT_COUNTS) if cfg is not None else None
    if not isinstance(E, int):
        first = found[0][1]
        stacked = [p.shape[0] for p in first.parameters(recurse=False) if p.dim() == 3]
        E = len(first) if isinstance(first, nn.ModuleList) else stacked[0] if stacked else None
    if not isinstance(E, int) or E < 2:
        return {}
    params = {id(p): p.numel() for _, m in found for p in m.parameters()}
    return {"n_experts": E, "expert_params": sum(params.values()), "moe_layers": len(found)}


def _stack_probes(model) -> dict:
    """For each stack of an encoder-decoder model, the first projection of its first layer
    (a module with a 2-D ``weight``: the self-attention's q or k) and that weight's numel, as
    ``encoder_probe`` / ``decoder_probe``: [name, numel]. Its forward FLOPs are 2 x numel x
    rows, so the record tells each stack's rows (batch x its own sequence length) without
    guessing: Whisper's encoder runs at its audio frames, not at the labels' length."""
    import torch.nn as nn
    out = {}
    for name, module in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        key = f"{last}_probe"
        if last not in ("encoder", "decoder") or key in out:
            continue
        layers = max((c for c in module.children() if isinstance(c, nn.ModuleList)), key=len, default=None)
        if not layers:
            continue
        prefix = f"{name}.{_child_name(module, layers)}.0"
        # nn.MultiheadAttention multiplies its out_proj's weight itself, never calling the
        # module: no FLOPs of its own to read rows off (nn.Transformer's layers: linear1 then)
        inside_mha = {f"{n}.{c}" for n, m in layers[0].named_modules()
                      if isinstance(m, nn.MultiheadAttention) for c, _ in m.named_modules() if c}
        for sub_name, sub in layers[0].named_modules():
            if sub_name in inside_mha:
                continue
            w = getattr(sub, "weight", None)
            if isinstance(w, nn.Parameter) and w.dim() == 2 and not isinstance(sub, nn.Embedding):
                out[key] = [f"{prefix}.{sub_name}", int(w.numel())]
                break
    return out


def _child_name(module, child) -> str:
    return next(n for n, c in module.named_children() if c is child)


def _layer_count(module):
    """Length of the longest ``nn.ModuleList`` among ``module``'s children (its layers), or 0."""
    import torch.nn as nn
    return max((len(c) for c in module.children() if isinstance(c, nn.ModuleList)), default=0)


def _encoder_decoder_layers(model):
    """(encoder layers, decoder layers) when ``model`` holds an encoder stack and a decoder
    stack: the shallowest modules named ``encoder`` and ``decoder`` that each have a list of
    layers (T5Stack.block, BartEncoder.layers). None otherwise: a decoder-only or
    encoder-only model, or BERT, whose ``cls.predictions.decoder`` is a Linear. The config's
    ``is_encoder_decoder`` is not used: constructing T5EncoderModel or BartForCausalLM
    from a config object clears it on that shared object."""
    if model is None:
        return None
    found = {}
    for name, module in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        if last in ("encoder", "decoder") and last not in found:
            n = _layer_count(module)
            if n:
                found[last] = n
    if len(found) == 2:
        return found["encoder"], found["decoder"]
    return None


def _learned_positions(cfg, model, vocab) -> int:
    """Rows of a learned position table: the config's context length, when the model has an
    embedding (other than the tokens') of exactly that many rows."""
    ctx = _first(cfg, "n_positions", "block_size", "max_position_embeddings", "n_ctx")
    if not isinstance(ctx, int) or model is None:
        return 0
    import torch
    for m in model.modules():
        if isinstance(m, torch.nn.Embedding) and m.num_embeddings == ctx and m.num_embeddings != vocab:
            return ctx
    return 0


#: Config attributes of a state-space model's state (Mamba, Mamba-2, Falcon-Mamba; mamba_ssm's
#: ``d_state``) and names of its modules and parameters (``Mamba2Mixer``, ``A_log``).
_SSM_CONFIG = ("state_size", "ssm_state_size", "d_state")
_SSM_NAMES = re.compile(r"mamba|ssm|selective|scan", re.I)
_ATTENTION_NAMES = re.compile(r"attn|attention|mha", re.I)


def _mixer(model, cfg=None) -> dict:
    """``{"mixer": "state-space"}`` when the blocks mix positions with a state-space scan and no
    attention: the config names a state size (``state_size``, ``d_state``), or a module's class
    (``Mamba2Mixer``, ``SSMBlock``) or a parameter (``A_log``) says so, and no module's name or
    class names attention. Empty otherwise (attention, or a hybrid of both: the attention
    predictions then stand). The predictions built on attention (12LTd, 12Ld^2's 4d^2 per
    layer, Korthikanti's activations) do not apply to such a model."""
    if model is None:
        return {}
    import torch.nn as nn
    ssm = cfg is not None and any(isinstance(getattr(cfg, n, None), int) for n in _SSM_CONFIG)
    for name, module in model.named_modules():
        kind = type(module).__name__
        if isinstance(module, nn.MultiheadAttention) or _ATTENTION_NAMES.search(f"{name.rsplit('.', 1)[-1]} {kind}"):
            return {}
        ssm = ssm or bool(_SSM_NAMES.search(kind)) or hasattr(module, "A_log")
    return {"mixer": "state-space"} if ssm else {}


_HEAD_ATTRS = ("n_head", "n_heads", "num_heads", "num_attention_heads", "heads")


def _from_modules(model):
    """L, d, V from the modules: the largest ``nn.Embedding`` (tokens) and the longest
    ``nn.ModuleList`` of blocks of one class with submodules; heads from a block's attribute."""
    import torch.nn as nn
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)
             and len({type(c) for c in m}) == 1 and next(iter(m[0].children()), None) is not None]
    if not lists:
        return None
    blocks = max(lists, key=len)
    if embeddings:
        tokens = max(embeddings, key=lambda m: m.num_embeddings)
        V, d = tokens.num_embeddings, tokens.embedding_dim
    else:
        # an encoder-decoder stack fed vectors (a bare nn.Transformer): no vocabulary, d from
        # its attention
        d = _attention_width(model) if _encoder_decoder_layers(model) is not None else None
        if d is None:
            return None
        V = 0
    heads = None
    for sub in blocks[0].modules():
        for name in _HEAD_ATTRS:
            value = getattr(sub, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                heads = value
                break
        if heads:
            break
    out = {"kind": "transformer", "source": "modules", "partial": True,
           "vocab_size": V, "d_model": d, "n_layers": len(blocks), "n_heads": heads}
    out.update(_mixer(model))
    stacks = _encoder_decoder_layers(model)     # nn.Transformer: encoder.layers, decoder.layers
    if stacks is not None:
        out.update(encoder_decoder=True, n_encoder_layers=stacks[0], n_decoder_layers=stacks[1],
                   n_layers=stacks[0] + stacks[1])
        out.update(_stack_probes(model))
    return out


def _attention_width(model):
    """d of an encoder-decoder stack of attention layers with no embedding (a bare
    ``nn.Transformer``): the ``embed_dim`` of the ``nn.MultiheadAttention`` in the first layer
    of the encoder stack and of the decoder stack (the stacks :func:`_encoder_decoder_layers`
    counts), when both have one and they agree; None otherwise (a U-Net's ``encoder`` and
    ``decoder`` lists of conv blocks are no transformer)."""
    import torch.nn as nn
    widths = {}
    for name, module in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        if last not in ("encoder", "decoder") or last in widths or not _layer_count(module):
            continue
        layers = max((c for c in module.children() if isinstance(c, nn.ModuleList)), key=len)
        widths[last] = next((m.embed_dim for m in layers[0].modules()
                             if isinstance(m, nn.MultiheadAttention)), None)
    values = set(widths.values())
    return values.pop() if len(widths) == 2 and len(values) == 1 and None not in values else None
