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

Known limitations: the closed form knows data parallelism only (tensor-parallel collectives
of activations have no closed form here); a rank of a multi-dimensional mesh is compared
with its data-parallel group of ``world_size`` ranks.
"""
from __future__ import annotations

from ..record import Finding
from ..formulas.comm import comm_per_step

__all__ = ["sharding", "check_comm", "check_comm_steps"]

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
    out = [Finding("TL-COMM-001", "info", text, measured=measured, expected=closed.total, hint=why)]
    if ratio is not None and ratio > 1.5:
        out.append(Finding("TL-COMM-002", "warning",
                           f"this rank sent {ratio:.2f}x the {strategy} closed form ({measured:,} vs "
                           f"{closed.total:,} bytes): something communicates that the strategy does not need",
                           measured=measured, expected=closed.total,
                           hint="look for a collective in a loop, an all-reduce of parameters instead of "
                                "gradients, or gathers repeated per micro-batch in the Collectives table"))
    return out


def check_comm_steps(records, options=None) -> list:
    """``check_comm`` on the last record, in the step checks' signature (``checks.ALL_CHECKS``)."""
    return check_comm(records[-1], options) if records else []
