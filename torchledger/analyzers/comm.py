"""Communication measured against its closed form (``formulas.comm``), for distributed records.

``sharding(record)`` reads how the step was parallelised from what the rank holds: a rank
whose parameter bytes are well under the whole model's holds shards (FSDP / ZeRO-3), one
that holds them all replicates them (DDP). ``check_comm(record, options)`` compares the
bytes this rank sent (``totals.comm_bytes``) with DDP's one all-reduce of the gradients or
FSDP's all-gathers and reduce-scatter:

- TL-COMM-001 (info): comm per step against the closed form, with the gap explained
  (padding to the world size, FSDP's root kept gathered from forward to backward, mixed
  precision).
- TL-COMM-002 (warning): the step sent more than 1.5x the closed form: something
  communicates that the strategy does not need (a collective in a loop, an all-reduce of
  every parameter instead of the gradients, an extra gather per micro-batch).

With ``totals.layout`` (what PyTorch's own objects say of the mesh: FSDP2's shard and
replicate groups, mixed precision dtypes, which groups stay gathered after forward, DDP's
group, each parameter's TP split) the reference is exact: FSDP2/HSDP's padded all-gathers in
``param_dtype`` (the backward one only for groups that reshard after forward), reduce-scatter
in ``reduce_dtype``, HSDP's all-reduce over the replicas; DDP's all-reduce of the gradients.
Under tensor parallelism only the data-parallel collectives (those on the FSDP/DDP groups,
told apart from TP's by their group size and span of global ranks) are compared; TP's own
activation collectives are listed beside them (their closed form per layer:
``formulas.comm.tp_comm_per_layer``). The other dims' traffic belongs to the layout too: each
parameter group's FSDP2 collectives run over its own shard group (under ``ep`` the experts'
over dp, the dense weights' over dp x ep); expert parallelism's all-to-alls (dispatch, combine,
their backwards: ``formulas.comm.ep_comm_per_layer``) and context parallelism's K/V
all-gathers and gradient reduce-scatters (``formulas.comm.cp_comm_per_layer``) join the closed
form where the record's config sizes them; the pipeline's sends and receives are listed beside
(``totals.pipeline`` has them per stage).

Known limitations: records without ``layout`` (older ones, a torch whose FSDP internals moved)
get the ZeRO-3/DDP form over ``world_size`` ranks and no comparison under TP.
"""
from __future__ import annotations

from ..record import Finding
from ..formulas.comm import combine_steps, comm_per_step, cp_comm_per_layer, ep_comm_per_layer, fsdp_comm_per_step
from ..formulas.memory import sharded_numel

__all__ = ["sharding", "check_comm", "check_comm_steps", "layout_closed_form", "ep_closed_form",
           "cp_closed_form"]

#: A rank holding less than this share of the whole model's parameter bytes holds shards.
_SHARDED_BELOW = 0.75


def sharding(record) -> tuple:
    """(data-parallel ranks, ZeRO stage) of a record: (1, 0) for a single process, (n, 3)
    when this rank holds parameter shards, (n, 0) when it holds every parameter."""
    t = record.totals
    n = int(t.get("world_size") or 1)
    if n <= 1:
        return 1, 0
    dense = _dense_param_bytes(record)
    if dense and t.get("param_bytes", 0) < _SHARDED_BELOW * dense:
        return n, 3
    return n, 0


def _dense_param_bytes(record) -> int:
    """The whole model's parameter bytes: from the gathered buffers' size when the record has
    them, else params x the bytes of its dtype."""
    t = record.totals
    per = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}.get(record.meta.get("dtype") or "", 0)
    return int(t.get("params", 0)) * per


def check_comm(record, options=None) -> list:
    """TL-COMM-001/002: this rank's comm bytes against DDP's or ZeRO-3's closed form (data
    parallelism only: a tensor-parallel step gets no comparison)."""
    t = record.totals
    comm = t.get("comm_bytes")
    if not comm or not getattr(record, "collectives", None):
        return []
    layout = t.get("layout") or {}
    if layout.get("params") and (layout.get("shard_group", 1) > 1 or layout.get("replicate_group", 1) > 1):
        return _check_layout(record, layout)
    n, zero = sharding(record)
    dense = _dense_param_bytes(record)
    if n <= 1 or not dense:
        return []
    if int(t.get("tensor_parallel") or 1) > 1:
        # NB: no closed form here for a 2-D mesh (TP's activation collectives, FSDP over the
        # data-parallel ranks only): saying nothing beats a comparison with the wrong one
        return []
    ops = {c["op"] for c in record.collectives}
    if zero == 3 or ops & {"all_gather", "reduce_scatter"} and "all_reduce" not in ops:
        gathered = sum(c["bytes_received"] for c in record.collectives
                       if c["op"] == "all_gather" and c["phase"] == "forward")
        padded = max(gathered, dense)          # FSDP pads to the world size: what it gathered
        closed, strategy = comm_per_step(padded, gpus=n, strategy="fsdp"), "FSDP/ZeRO-3"
        why = (f"all-gather of the {padded:,} parameter bytes (padded to a multiple of {n} rows) in "
               f"forward and backward, reduce-scatter of the gradients; FSDP keeps the root module's "
               f"parameters gathered from forward to backward and gathers in param_dtype under mixed "
               f"precision, so the measured may sit below")
    else:
        closed, strategy = comm_per_step(dense, gpus=n, strategy="ddp"), "DDP"
        why = (f"one all-reduce of the {dense:,} gradient bytes (bucketed); frozen parameters have "
               f"no gradient to reduce, buffers broadcast in forward add to it")
    measured = int(comm.get("total", 0))
    ratio = measured / closed.total if closed.total else None
    text = (f"comm per step {measured:,} bytes sent by this rank vs {closed.total:,} for {strategy} "
            f"over {n} ranks" + (f" ({ratio:.3f}x)" if ratio is not None else ""))
    return _verdict([Finding("TL-COMM-001", "info", text, measured=measured, expected=closed.total, hint=why)],
                    ratio, strategy, measured, closed.total)


_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1}


def _fsdp_groups(layout, p_dt, g_dt) -> dict:
    """{shard group: [gathered, re-gathered in backward, gradient bytes]} of the parameters
    FSDP2 manages: each group's collectives run over its own ranks (under ``ep`` the experts'
    over the dp ranks, the dense weights over dp x ep)."""
    s = int(layout.get("shard_group", 1))
    groups = {}
    for row in layout["params"]:
        shape, tp, tp_dim, s_p, _r, trainable, reshard, nbytes, count = row
        if s > 1 and s_p <= 1:
            continue                        # not FSDP-managed: no FSDP collective moves it
        numel = sharded_numel(shape, tp=tp, tp_dim=tp_dim, shard_group=s_p) * s_p * count
        g = groups.setdefault(s_p if s > 1 else s, [0, 0, 0])
        g[0] += numel * (p_dt or nbytes)
        g[1] += numel * (p_dt or nbytes) if reshard else 0
        g[2] += numel * (g_dt or p_dt or nbytes) if trainable else 0
    return groups


def layout_closed_form(layout):
    """(CommStep, strategy name, explanation) of the data-parallel collectives of a layout
    (``totals.layout``): FSDP2/HSDP or DDP."""
    s, r = int(layout.get("shard_group", 1)), int(layout.get("replicate_group", 1))
    p_dt = _DTYPE_BYTES.get(layout.get("param_dtype") or "")
    g_dt = _DTYPE_BYTES.get(layout.get("reduce_dtype") or "")
    groups = _fsdp_groups(layout, p_dt, g_dt)
    gather, regather, grads = (sum(g[i] for g in groups.values()) for i in range(3))
    if s > 1:
        closed = combine_steps("hsdp" if r > 1 else "fsdp", s * r, [
            fsdp_comm_per_step(g, gr, shard_group=sp, replicate_group=r, regather_bytes=rg)
            for sp, (g, rg, gr) in sorted(groups.items())])
        name = f"HSDP ({r} replicas x {s} shards)" if r > 1 else "FSDP2"
        why = (f"all-gather of the {gather:,} parameter bytes (dim 0 padded to a multiple of {s}"
               + (f", in {layout['param_dtype']}" if layout.get("param_dtype") else "") + ") in forward, "
               + (f"again in backward for the groups that reshard after forward ({regather:,} B; "
                  f"reshard_after_forward=False and FSDP2's root keep theirs), "
                  if regather != gather else "and again in backward, ")
               + f"reduce-scatter of the {grads:,} gradient bytes"
               + (f" in {layout.get('reduce_dtype')}" if layout.get("reduce_dtype") else "")
               + (f", all-reduce of this rank's {-(-grads // s):,} over the {r} replicas" if r > 1 else "")
               + _groups_text(groups, s))
        return closed, name, why
    closed = comm_per_step(grads, gpus=r, strategy="ddp")
    return closed, "DDP", (f"one all-reduce of the {grads:,} gradient bytes (bucketed); frozen parameters "
                           f"have no gradient to reduce, buffers broadcast in forward add to it")


def _groups_text(groups, s) -> str:
    smaller = {sp: g for sp, g in groups.items() if sp != s}
    return "".join(f"; {g[0]:,} of the parameter bytes (experts) shard over groups of {sp}, not {s}: "
                   f"their collectives run there" for sp, g in sorted(smaller.items()))


def _data_parallel_rows(rows, layout) -> tuple:
    """(collectives of the data-parallel groups, the rest: tensor parallelism's)."""
    s, r = int(layout.get("shard_group", 1)), int(layout.get("replicate_group", 1))
    if int(layout.get("tp", 1)) <= 1:
        return list(rows), []
    groups = {(s, layout.get("shard_span")), (r, layout.get("replicate_span"))}
    dp, other = [], []
    for c in rows:
        key = (c.get("group_size"), c.get("group_span"))
        (dp if key in groups or (c.get("group_span") is None and c.get("group_size") in (s, r)
                                 and c.get("group_size") != layout.get("tp")) else other).append(c)
    return dp, other


def _dims(record) -> dict:
    return record.totals.get("parallel_dims") or {}


def _own_rows(record) -> tuple:
    """(expert parallelism's all-to-alls, the pipeline's sends and receives, the rest) of a
    ``--mesh`` record: collectives of the layout that are no data-parallel traffic."""
    ep, pp = int(_dims(record).get("ep") or 1), int(_dims(record).get("pp") or 1)
    a2a, p2p, rest = [], [], []
    for c in record.collectives:
        if ep > 1 and c["op"] == "all_to_all" and c.get("group_size") == ep:
            a2a.append(c)
        elif pp > 1 and c["op"] in ("send", "recv"):
            p2p.append(c)
        else:
            rest.append(c)
    return a2a, p2p, rest


def ep_closed_form(record, layout):
    """(CommStep, explanation) of expert parallelism's all-to-alls in the step (every block of
    torchledger's MoE decoder: dispatch and combine, and their backwards), or None without
    ``ep`` or without the MoE config (``n_experts``, ``top_k``, ``capacity_factor``)."""
    ep, cfg = int(_dims(record).get("ep") or 1), record.meta.get("config") or {}
    act = _activations(record, layout)
    if ep <= 1 or act is None or not all(cfg.get(k) for k in ("n_experts", "top_k", "capacity_factor", "d_model",
                                                               "n_layers")):
        return None
    tokens, micro, dtype, size = act
    layer = ep_comm_per_layer(tokens, int(cfg["d_model"]), n_experts=int(cfg["n_experts"]), top_k=int(cfg["top_k"]),
                              capacity_factor=float(cfg["capacity_factor"]), ep=ep, dtype_bytes=size)
    calls = int(cfg["n_layers"]) * micro
    buf = layer.ops[0][2]
    return combine_steps("ep", ep, [layer] * calls), (
        f"; expert parallel {ep}: per MoE layer and micro-batch the E x C x d dispatch buffer ({buf:,} B in "
        f"{dtype}: {cfg['n_experts']} experts x capacity ceil({cfg['capacity_factor']:g} x {tokens:,} tokens x "
        f"{cfg['top_k']} / {cfg['n_experts']}) x {cfg['d_model']}) all-to-all'd 4 times (dispatch, combine "
        f"and their backwards), {calls} x 4 = {4 * calls} calls")


def _activations(record, layout):
    """(this rank's tokens per micro-batch, micro-batches, an activation's dtype name, its bytes), or
    None."""
    t = record.totals
    micro = int((t.get("pipeline") or {}).get("micro_batches") or 1)   # a composed stage: m calls
    dtype = layout.get("param_dtype") or record.meta.get("dtype") or ""
    tokens = int(t.get("tokens") or 0) // micro
    return (tokens, micro, dtype, _DTYPE_BYTES[dtype]) if tokens and dtype in _DTYPE_BYTES else None


def cp_closed_form(record, layout):
    """(CommStep, explanation) of context parallelism's K/V all-gathers and their gradients'
    reduce-scatters in the step (every attention layer, every micro-batch), or None without the
    standard plan's context parallelism (``totals.context_parallel``) or the config's heads."""
    cp, cfg = int(record.totals.get("context_parallel") or 1), record.meta.get("config") or {}
    act = _activations(record, layout)
    if cp <= 1 or act is None or not all(cfg.get(k) for k in ("n_heads", "d_model", "n_layers")):
        return None
    tokens, micro, dtype, size = act
    head = int(cfg.get("d_attn") or cfg["d_model"]) // int(cfg["n_heads"])
    width = int(cfg.get("n_kv_heads") or cfg["n_heads"]) * head // max(int(layout.get("tp") or 1), 1)
    layer = cp_comm_per_layer(tokens, width, cp=cp, dtype_bytes=size)
    calls = int(cfg["n_layers"]) * micro
    return combine_steps("cp", cp, [layer] * calls), (
        f"; context parallel {cp}: per attention layer and micro-batch K and V all-gathered (this rank's "
        f"{tokens:,} tokens x {width} x {size} B = {layer.ops[0][2]:,} B each) and their gradients "
        f"reduce-scattered ({layer.ops[2][2]:,} B each), {calls} layer-micro-batches")


def _beside(rows, what: str) -> str:
    if not rows:
        return ""
    return (f"; {what}, {sum(c['bytes'] for c in rows):,} B in {sum(c['count'] for c in rows)} calls, "
            f"are not in this comparison")


def _cp_rows(tp_rows, record, layout) -> list:
    """Context parallelism's K/V collectives among the rows told apart as tensor parallelism's
    (dp > 1 beside tp): on a cp group, cp ranks tp apart (torchtitan's mesh order: cp just
    outside tp), so spanning (cp - 1) tp + 1 global ranks."""
    cp, tp = int(record.totals.get("context_parallel") or 1), int(layout.get("tp") or 1)
    span = (cp - 1) * tp + 1
    return [c for c in tp_rows if c.get("group_size") == cp
            and (c.get("group_span") == span or (c.get("group_span") is None and cp != tp))]


def _with_own_forms(record, layout, closed, strategy, why, dp, tp_rows, a2a) -> tuple:
    """The data-parallel closed form and rows with expert parallelism's all-to-alls and context
    parallelism's K/V collectives added, where the config sizes them: (closed, strategy, why,
    rows, tensor parallelism's rows, all-to-alls left unsized)."""
    ep = ep_closed_form(record, layout) if a2a else None
    if ep is not None:
        closed = combine_steps(closed.strategy + "+ep", closed.gpus, [closed, ep[0]])
        strategy, why, dp, a2a = strategy + " + EP all-to-alls", why + ep[1], dp + a2a, []
    cp = cp_closed_form(record, layout)
    if cp is not None:
        moved = _cp_rows(tp_rows, record, layout)
        closed = combine_steps(closed.strategy + "+cp", closed.gpus, [closed, cp[0]])
        strategy, why = strategy + " + CP K/V", why + cp[1]
        dp, tp_rows = dp + moved, [c for c in tp_rows if c not in moved]
    return closed, strategy, why, dp, tp_rows, a2a


def _check_layout(record, layout) -> list:
    a2a, p2p, rest = _own_rows(record)
    closed, strategy, why, dp, tp_rows, a2a = _with_own_forms(record, layout, *layout_closed_form(layout),
                                                              *_data_parallel_rows(rest, layout), a2a)
    measured = sum(c["bytes"] for c in dp)
    ratio = measured / closed.total if closed.total else None
    note = (_beside(tp_rows, f"tensor parallelism's own collectives over groups of {layout.get('tp')} "
                             f"(per layer: formulas.comm.tp_comm_per_layer)")
            + _beside(a2a, "expert parallelism's all-to-alls (no MoE config to size them)")
            + _beside(p2p, "the pipeline's sends and receives (totals.pipeline.per_stage p2p_bytes)"))
    text = (f"comm per step {measured:,} bytes sent by this rank vs {closed.total:,} for {strategy}"
            + (f" ({ratio:.3f}x)" if ratio is not None else "")
            + (" (data-parallel collectives only)" if tp_rows else ""))
    return _verdict([Finding("TL-COMM-001", "info", text, measured=measured, expected=closed.total,
                             hint=why + note)], ratio, strategy, measured, closed.total)


def _verdict(out: list, ratio, strategy: str, measured: int, expected: int) -> list:
    """TL-COMM-001 (``out``) and, when the step sent more than 1.5x its closed form, TL-COMM-002."""
    if ratio is not None and ratio > 1.5:
        out.append(Finding("TL-COMM-002", "warning",
                           f"this rank sent {ratio:.2f}x the {strategy} closed form ({measured:,} vs "
                           f"{expected:,} bytes): something communicates that the strategy does not need",
                           measured=measured, expected=expected,
                           hint="look for a collective in a loop, an all-reduce of parameters instead of "
                                "gradients, or gathers repeated per micro-batch in the Collectives table"))
    return out


def check_comm_steps(records, options=None) -> list:
    """``check_comm`` on the last record, in the step checks' signature (``checks.ALL_CHECKS``)."""
    return check_comm(records[-1], options) if records else []
