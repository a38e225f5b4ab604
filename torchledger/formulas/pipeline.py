"""Pipeline schedules in closed form: how the model is cut into stages, how many micro-batches'
activations a stage holds at its peak, and the bubble.

p pipeline ranks, v virtual stages (model chunks) per rank, m micro-batches per step; rank r
holds chunks r, r + p, ..., r + (v - 1) p of the p x v chunks (PyTorch's and Megatron's
placement: chunk 0 has the embedding, chunk p v - 1 the head).

In-flight activations at a rank's peak, in chunk-micro-batches (one micro-batch's activations
through one chunk), the warm-up forwards before its first backward, plus one:

========================= ============================================ =====================
schedule                  in flight on rank r                          bubble fraction
========================= ============================================ =====================
gpipe                     m v (every forward before any backward)      (p - 1) / m
1f1b (v = 1)              min(p - r, m)                                (p - 1) / m
interleaved (v > 1)       min(2 (p - 1 - r) + (v - 1) p + 1, m v)      (p - 1) / (v m)
zero-bubble (ZB-H1)       as 1f1b / interleaved                        (p - 1) / (3 v m)
========================= ============================================ =====================

The 1F1B figure is Korthikanti et al. 2022, Appendix B (the first stage holds p micro-batches);
the interleaved warm-up is Megatron-LM's (``get_forward_backward_func``: 2 (p - r - 1) +
(v - 1) p warm-up micro-steps). The bubble is the idle time over the ideal time, (p - 1) / m
for 1F1B (Narayanan et al. 2021), divided by v when interleaved; zero-bubble is ZB-H1 (Qi et
al. 2023) with forward, input-backward and weight-backward of equal time: a third of 1F1B's.

    >>> bubble_fraction(4, 1, 8, "1f1b")
    0.375
    >>> in_flight(4, 1, 8, 0, "1f1b"), in_flight(4, 1, 8, 3, "1f1b")
    (4, 1)
"""
from __future__ import annotations

__all__ = ["SCHEDULES", "bubble_fraction", "in_flight", "chunk_sizes", "rank_chunks"]

SCHEDULES = ("1f1b", "interleaved", "gpipe", "zero-bubble")


def _check(p: int, v: int, m: int) -> None:
    for name, x in (("p", p), ("v", v), ("m", m)):
        if isinstance(x, bool) or not isinstance(x, int) or x < 1:
            raise ValueError(f"{name} must be a whole number >= 1, got {x!r}")


def bubble_fraction(p: int, v: int, m: int, schedule: str) -> float:
    """Pipeline bubble over ideal compute time, as in the module table."""
    _check(p, v, m)
    if schedule == "gpipe":
        return (p - 1) / m
    if schedule in ("1f1b", "interleaved"):
        return (p - 1) / (v * m)
    if schedule == "zero-bubble":
        return (p - 1) / (3 * v * m)
    raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")


def in_flight(p: int, v: int, m: int, rank: int, schedule: str) -> int:
    """Chunk-micro-batches of activations rank ``rank`` holds at its peak."""
    _check(p, v, m)
    if not 0 <= rank < p:
        raise ValueError(f"rank must be in [0, {p}), got {rank}")
    if schedule == "gpipe":
        return m * v
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if v == 1:
        return min(p - rank, m)
    return min(2 * (p - 1 - rank) + (v - 1) * p + 1, m * v)


def chunk_sizes(n_blocks: int, chunks: int) -> list:
    """Blocks per chunk, as even as they go (the first chunks take one more)."""
    if chunks < 1 or n_blocks < chunks:
        raise ValueError(f"{n_blocks} blocks cannot fill {chunks} pipeline chunks (one block at least each)")
    q, r = divmod(n_blocks, chunks)
    return [q + (1 if c < r else 0) for c in range(chunks)]


def rank_chunks(p: int, v: int, rank: int) -> list:
    """The chunks rank ``rank`` holds: rank, rank + p, ..., rank + (v - 1) p."""
    return [rank + k * p for k in range(v)]
