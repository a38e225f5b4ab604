"""The distributed references of :mod:`.compare`: static bytes per rank as the mesh lays the
parameters out (``totals.layout``), and Korthikanti's activation row for the record's tensor
and sequence parallelism.

    static, detail = layout_static(record.totals["layout"], record.optimizer)
    layer = korthikanti_layer(s, b, h, a, tp=4, sp=True, fused=True)   # PyTorch's TP+SP layer
"""
from __future__ import annotations

from ..formulas.activations import korthikanti_layer_bytes, korthikanti_table2, pytorch_sp_layer_bytes
from ..formulas.memory import static_bytes_per_rank

__all__ = ["layout_static", "layout_text", "sequence_parallel", "korthikanti_layer"]


def layout_static(layout: dict, opt: dict) -> tuple:
    """(bytes, detail): each parameter's shard on this rank (TP's split, then FSDP2's padded
    dim 0) x the optimizer x precision bytes per parameter; replicate groups divide nothing."""
    shards = int(opt.get("shards") or 1)
    ref = static_bytes_per_rank(layout["params"], opt["kind"], opt["precision"],
                                tp_rank=int(layout.get("tp_rank") or 0), shard_rank=int(layout.get("shard_rank") or 0),
                                optimizer_shards=shards)
    detail = {k: layout.get(k, 1) for k in ("shard_group", "replicate_group", "tp")}
    if shards > 1:
        detail["optimizer_shards"] = shards
    detail.update(numel=ref["numel"], numel_unpadded=round(ref["numel_unpadded"]))
    return ref["bytes"], detail


def layout_text(lay: dict) -> str:
    """How a mesh divides the static bytes (``layout_static``'s detail), for the explanation."""
    s, r, tp = lay["shard_group"], lay["replicate_group"], lay["tp"]
    parts = []
    if tp > 1:
        parts.append(f"tensor parallel {tp} splits the weights its plan shards (the rest stay whole)")
    if s > 1:
        parts.append(f"FSDP shards over {s} ranks" + (f" and replicates over {r} (HSDP: / {s}, not / {s * r})"
                                                        if r > 1 else ""))
    elif r > 1:
        parts.append(f"replicated on each of {r} ranks (DDP: nothing divided)")
    if lay.get("optimizer_shards", 1) > 1:
        d = lay["optimizer_shards"]
        parts.append(f"the distributed optimizer splits the master weights and optimizer state over {d} "
                     f"replicas (each rank's 1/{d}; weights and gradients whole)")
    pad = lay["numel"] - lay["numel_unpadded"]
    return ("; this rank's shares: " + (", ".join(parts) + ": " if parts else "")
            + f"{lay['numel']:,} params on this rank"
            + (f" ({pad:,} of them padding: FSDP2 pads dim 0 to a multiple of {s}, rank 0 holds "
               f"the ceil)" if pad > 0 and s > 1 else "")
            + (f" (uneven splits: rank 0 holds the ceil, {pad:,} params above an even split)"
               if pad > 0 and s <= 1 else ""))


def sequence_parallel(record) -> bool:
    """Sequence parallelism ran: a reduce-scatter in forward (FSDP's run in backward only), where
    tensor parallelism without it all-reduces the row-parallel outputs."""
    tp = max(int(record.totals.get("tensor_parallel") or 1), 1)
    return tp > 1 and any(c.get("op") == "reduce_scatter" and c.get("phase") == "forward"
                          for c in getattr(record, "collectives", None) or ())


def korthikanti_layer(seq_len: int, batch: int, hidden: int, heads: int, *, tp: int = 1, sp: bool = False,
                      fused: bool = False):
    """One layer's bytes (16-bit): Table 2's no-parallelism row, its TP row at ``tp``, or under
    sequence parallelism what PyTorch saves (``pytorch_sp_layer_bytes``: the gathered block
    inputs too), not Megatron's TP+SP row."""
    if sp and tp > 1:
        return pytorch_sp_layer_bytes(seq_len, batch, hidden, heads, tp=tp, fused_attention=fused)
    if tp > 1:
        return korthikanti_table2(seq_len, batch, hidden, heads, tp=tp, row="tp", fused_attention=fused)
    return korthikanti_layer_bytes(seq_len, batch, hidden, heads, fused_attention=fused)
