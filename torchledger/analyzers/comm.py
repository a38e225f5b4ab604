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
``formulas.comm.tp_comm_per_layer``).

Known limitations: records without ``layout`` (older ones, a torch whose FSDP internals moved)
get the ZeRO-3/DDP form over ``world_size`` ranks and no comparison under TP.
"""
from __future__ import annotations

from ..record import Finding
from ..formulas.comm import comm_per_step, fsdp_comm_per_step
from ..formulas.memory import sharded_numel

__all__ = ["sharding", "check_comm", "check_comm_steps", "layout_closed_form"]

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


def layout_closed_form(layout):
    """(CommStep, strategy name, explanation) of the data-parallel collectives of a layout
    (``totals.layout``): FSDP2/HSDP or DDP."""
    s, r = int(layout.get("shard_group", 1)), int(layout.get("replicate_group", 1))
    p_dt = _DTYPE_BYTES.get(layout.get("param_dtype") or "")
    g_dt = _DTYPE_BYTES.get(layout.get("reduce_dtype") or "")
    gather = regather = grads = 0
    for row in layout["params"]:
        shape, tp, tp_dim, s_p, _r, trainable, reshard, nbytes, count = row
        if s > 1 and s_p <= 1:
            continue                        # not FSDP-managed: no FSDP collective moves it
        numel = sharded_numel(shape, tp=tp, tp_dim=tp_dim, shard_group=s_p) * s_p * count
        gather += numel * (p_dt or nbytes)
        regather += numel * (p_dt or nbytes) if reshard else 0
        if trainable:
            grads += numel * (g_dt or p_dt or nbytes)
    if s > 1:
        closed = fsdp_comm_per_step(gather, grads, shard_group=s, replicate_group=r, regather_bytes=regather)
        name = f"HSDP ({r} replicas x {s} shards)" if r > 1 else "FSDP2"
        why = (f"all-gather of the {gather:,} parameter bytes (dim 0 padded to a multiple of {s}"
               + (f", in {layout['param_dtype']}" if layout.get("param_dtype") else "") + ") in forward, "
               + (f"again in backward for the groups that reshard after forward ({regather:,} B; "
                  f"reshard_after_forward=False and FSDP2's root keep theirs), "
                  if regather != gather else "and again in backward, ")
               + f"reduce-scatter of the {grads:,} gradient bytes"
               + (f" in {layout.get('reduce_dtype')}" if layout.get("reduce_dtype") else "")
               + (f", all-reduce of this rank's {-(-grads // s):,} over the {r} replicas" if r > 1 else ""))
        return closed, name, why
    closed = comm_per_step(grads, gpus=r, strategy="ddp")
    return closed, "DDP", (f"one all-reduce of the {grads:,} gradient bytes (bucketed); frozen parameters "
                           f"have no gradient to reduce, buffers broadcast in forward add to it")


def _data_parallel_rows(record, layout) -> tuple:
    """(collectives of the data-parallel groups, the rest: tensor parallelism's)."""
    s, r = int(layout.get("shard_group", 1)), int(layout.get("replicate_group", 1))
    if int(layout.get("tp", 1)) <= 1:
        return list(record.collectives), []
    groups = {(s, layout.get("shard_span")), (r, layout.get("replicate_span"))}
    dp, other = [], []
    for c in record.collectives:
        key = (c.get("group_size"), c.get("group_span"))
        (dp if key in groups or (c.get("group_span") is None and c.get("group_size") in (s, r)
                                 and c.get("group_size") != layout.get("tp")) else other).append(c)
    return dp, other


def _check_layout(record, layout) -> list:
    closed, strategy, why = layout_closed_form(layout)
    dp, tp_rows = _data_parallel_rows(record, layout)
    measured = sum(c["bytes"] for c in dp)
    ratio = measured / closed.total if closed.total else None
    tp_note = ""
    if tp_rows:
        tp_bytes = sum(c["bytes"] for c in tp_rows)
        tp_note = (f"; tensor parallelism's own collectives ({tp_bytes:,} B in "
                   f"{sum(c['count'] for c in tp_rows)} calls over groups of {layout.get('tp')}) are "
                   f"not in this comparison (per layer: formulas.comm.tp_comm_per_layer)")
    text = (f"comm per step {measured:,} bytes sent by this rank vs {closed.total:,} for {strategy}"
            + (f" ({ratio:.3f}x)" if ratio is not None else "")
            + (" (data-parallel collectives only)" if tp_rows else ""))
    return _verdict([Finding("TL-COMM-001", "info", text, measured=measured, expected=closed.total,
                             hint=why + tp_note)], ratio, strategy, measured, closed.total)


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
