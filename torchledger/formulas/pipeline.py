"""Pipeline schedules in closed form: how the model is cut into stages, how many micro-batches'
activations a stage holds at its peak, and the bubble.

p pipeline ranks, v virtual stages (model chunks) per rank, m micro-batches per step; rank r
holds chunks r, r + p, ..., r + (v - 1) p of the p x v chunks (PyTorch's and Megatron's
placement: chunk 0 has the embedding, chunk p v - 1 the head).

The schedule's figures (chunk-micro-batches in flight at a rank's peak, the bubble) come from
the schedule itself: :mod:`.schedules` builds each rank's action list by the rules of PyTorch's
schedule class (``Schedule1F1B``, ``ScheduleInterleaved1F1B``, ``ScheduleGPipe`` /
``ScheduleLoopedBFS``, ``ScheduleInterleavedZeroBubble``), counts the activations it holds and
times it. On the common case they are the closed forms (Narayanan et al. 2021; Korthikanti et
al. 2022, Appendix B; Qi et al. 2023's ZB-H1):

================================ ========================================= =================
schedule, when                   in flight on rank r                       bubble fraction
================================ ========================================= =================
gpipe (m >= p)                   m v (every forward before any backward)   (p - 1) / (v m)
1f1b, v = 1 (m >= p)             p - r                                     (p - 1) / m
interleaved (p divides m)        2 (p - 1 - r) + (v - 1) p + 1             (p - 1) / (v m)
zero-bubble (p divides m)        forwards minus weight backwards           (p - 1) / (3 v m)
================================ ========================================= =================

Off it (interleaved with m < p or m not a multiple of p, zero-bubble's memory) the simulation
is what PyTorch runs, and what PyTorch refuses (1F1B with m < p, interleaved with m not a
multiple of its rounds) raises ValueError with PyTorch's reason
(:func:`.schedules.schedule_problem`).

    >>> bubble_fraction(4, 1, 8, "1f1b")
    0.375
    >>> in_flight(4, 1, 8, 0, "1f1b"), in_flight(4, 1, 8, 3, "1f1b")
    (4, 1)
"""
from __future__ import annotations

from .schedules import SCHEDULES, held_bytes, rank_actions, schedule_problem, simulate

__all__ = ["SCHEDULES", "bubble_fraction", "in_flight", "in_flight_bytes", "chunk_sizes", "rank_chunks",
           "schedule_problem"]


def bubble_fraction(p: int, v: int, m: int, schedule: str) -> float:
    """Pipeline bubble over ideal compute time, from the schedule's simulated action lists."""
    return simulate(p, v, m, schedule).bubble_fraction


def in_flight(p: int, v: int, m: int, rank: int, schedule: str) -> int:
    """Chunk-micro-batches of activations rank ``rank`` holds at its peak."""
    figures = simulate(p, v, m, schedule)
    if not 0 <= rank < p:
        raise ValueError(f"rank must be in [0, {p}), got {rank}")
    return figures.in_flight[rank]


def in_flight_bytes(p: int, v: int, m: int, rank: int, schedule: str, per_chunk: dict,
                    kept: dict = None, since_backward: bool = True) -> tuple:
    """(bytes, {chunk: micro-batches live}, {chunk: forwards run}) at rank ``rank``'s peak
    when one micro-batch of chunk c holds ``per_chunk[c]`` bytes of activations until its
    backward (the head's chunk its logits' loss too) and ``kept[c]`` until the step ends: the
    schedule's action list replayed with each chunk's own sizes
    (:func:`.schedules.held_bytes`); the peak from the rank's first backward on
    (``since_backward``), or up to and through it (no gradients yet).

        >>> in_flight_bytes(2, 1, 4, 1, "gpipe", {1: 10}, since_backward=False)[:2]   # 4 forwards
        (40, {1: 4})
        >>> in_flight_bytes(2, 1, 4, 1, "gpipe", {1: 10})[:2]    # the second backward: 3 left
        (30, {1: 3})
    """
    return held_bytes(rank_actions(p, v, m, rank, schedule), per_chunk, kept, since_backward)


def chunk_sizes(n_blocks: int, chunks: int) -> list:
    """Blocks per chunk, as even as they go (the first chunks take one more)."""
    if chunks < 1 or n_blocks < chunks:
        raise ValueError(f"{n_blocks} blocks cannot fill {chunks} pipeline chunks (one block at least each)")
    q, r = divmod(n_blocks, chunks)
    return [q + (1 if c < r else 0) for c in range(chunks)]


def rank_chunks(p: int, v: int, rank: int) -> list:
    """The chunks rank ``rank`` holds: rank, rank + p, ..., rank + (v - 1) p."""
    return [rank + k * p for k in range(v)]
