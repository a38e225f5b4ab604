"""Write the synthetic CUDA memory snapshots the tests read, in the allocator's own format.

    python tests/data/snapshots/make.py          # rewrites *.pickle beside this file

Each snapshot is a plain dict shaped like ``torch.cuda.memory._snapshot()`` (see
torchledger/analyzers/snapshot.py), built by hand so every figure can be checked on paper.
Sizes are whole MiB so the arithmetic in the tests stays readable. ``pickle.dumps`` of plain
dicts is deterministic, so running this again reproduces the committed files byte for byte
(a test checks that).

fragmented.pickle: one 20 MiB segment: 2 MiB active, 6 MiB free, 4 MiB active, 8 MiB free
    (largest free 8 MiB of 14 MiB free: fragmentation 1 - 8/14). No history.
history.pickle: a recorded trace of 4 training steps (event indices in brackets):
    [0] cudaMalloc 20 MiB segment S; [1] weights W 4 MiB at S+0
    step 0 [2..14]: activation A 6 MiB at S+4 [2], temporary T 2 MiB at S+10 [3] freed [4,5],
        gradient G 4 MiB at S+10 [6], cudaMalloc 16 MiB segment S2 [7], temporary X 12 MiB
        at S2 [8] (the peak) freed [9,10], cudaFree S2 [11], A freed [12,13], leak L0 1 MiB [14]
    steps 1-3 start at [15], [19], [23]: A allocated and freed again, then a 1 MiB leak.
    A small 2 MiB segment with one 1024-byte block (1000 requested) exists before recording.
legacy.pickle: the old format, a bare list of segments (the fragmented segment).
"""
from __future__ import annotations

import os
import pickle

MiB = 2**20
T0 = 1_700_000_000_000_000          # time_us of event 0; event k happens at T0 + 10 k
S, S2, SS = 0x7F0000000000, 0x7F0040000000, 0x7F0080000000
HERE = os.path.dirname(os.path.abspath(__file__))


def frame(filename, line, name):
    return {"filename": filename, "line": line, "name": name}


TORCH = frame("/usr/lib/python3/site-packages/torch/nn/modules/linear.py", 125, "forward")
WEIGHTS = [frame("/usr/lib/python3/site-packages/torch/nn/modules/module.py", 1300, "to"),
           frame("train.py", 12, "build")]
ACT = [TORCH, frame("model.py", 40, "forward"), frame("train.py", 20, "step")]
TEMP = [frame("model.py", 41, "forward"), frame("train.py", 20, "step")]
GRAD = [frame("/usr/lib/python3/site-packages/torch/autograd/graph.py", 825, "_engine_run_backward"),
        frame("train.py", 21, "step")]
LEAK = [frame("train.py", 30, "step")]


def block(address, size, state, frames=(), requested=None):
    return {"address": address, "size": size, "requested_size": size if requested is None else requested,
            "state": state, "frames": list(frames)}


def segment(address, blocks, device=0, stream=0, kind="large"):
    total = sum(b["size"] for b in blocks)
    act = [b for b in blocks if b["state"] != "inactive"]
    return {"device": device, "address": address, "total_size": total,
            "allocated_size": sum(b["size"] for b in act if b["state"] == "active_allocated"),
            "active_size": sum(b["size"] for b in act),
            "requested_size": sum(b["requested_size"] for b in act),
            "stream": stream, "segment_type": kind, "segment_pool_id": (0, 0),
            "is_expandable": False, "frames": [], "blocks": blocks}


def fragmented() -> dict:
    seg = segment(S, [block(S, 2 * MiB, "active_allocated", ACT),
                      block(S + 2 * MiB, 6 * MiB, "inactive"),
                      block(S + 8 * MiB, 4 * MiB, "active_allocated", TEMP, requested=4 * MiB - 100),
                      block(S + 12 * MiB, 8 * MiB, "inactive")])
    return {"segments": [seg], "device_traces": [[]], "allocator_settings": {"expandable_segments": False}}


def history() -> dict:
    ev = []

    def add(action, addr, size, frames=()):
        ev.append({"action": action, "addr": addr, "size": size, "stream": 0,
                   "time_us": T0 + 10 * len(ev), "frames": list(frames)})

    def free(addr, size, frames=()):
        add("free_requested", addr, size, frames)
        add("free_completed", addr, size, frames)

    add("segment_alloc", S, 20 * MiB)                       # 0
    add("alloc", S, 4 * MiB, WEIGHTS)                        # 1
    add("alloc", S + 4 * MiB, 6 * MiB, ACT)                  # 2  step 0
    add("alloc", S + 10 * MiB, 2 * MiB, TEMP)                # 3
    free(S + 10 * MiB, 2 * MiB, TEMP)                        # 4, 5
    add("alloc", S + 10 * MiB, 4 * MiB, GRAD)                # 6
    add("segment_alloc", S2, 16 * MiB)                       # 7
    add("alloc", S2, 12 * MiB, TEMP)                         # 8  the peak
    free(S2, 12 * MiB, TEMP)                                 # 9, 10
    add("segment_free", S2, 16 * MiB)                        # 11
    free(S + 4 * MiB, 6 * MiB, ACT)                          # 12, 13
    add("alloc", S + 14 * MiB, MiB, LEAK)                    # 14
    for k in range(1, 4):                                    # steps 1-3 at 15, 19, 23
        add("alloc", S + 4 * MiB, 6 * MiB, ACT)
        free(S + 4 * MiB, 6 * MiB, ACT)
        add("alloc", S + (14 + k) * MiB, MiB, LEAK)
    big = segment(S, [block(S, 4 * MiB, "active_allocated", WEIGHTS),
                      block(S + 4 * MiB, 6 * MiB, "inactive"),
                      block(S + 10 * MiB, 4 * MiB, "active_allocated", GRAD)]
                  + [block(S + (14 + k) * MiB, MiB, "active_allocated", LEAK) for k in range(4)]
                  + [block(S + 18 * MiB, 2 * MiB, "inactive")])
    small = segment(SS, [block(SS, 1024, "active_allocated", TEMP, requested=1000),
                         block(SS + 1024, 2 * MiB - 1024, "inactive")], kind="small")
    return {"segments": [big, small], "device_traces": [ev],
            "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "expandable_segments": False}}


def legacy() -> list:
    return fragmented()["segments"]


SNAPSHOTS = {"fragmented.pickle": fragmented, "history.pickle": history, "legacy.pickle": legacy}


def main() -> None:
    for name, make in SNAPSHOTS.items():
        with open(os.path.join(HERE, name), "wb") as f:
            pickle.dump(make(), f, protocol=4)


if __name__ == "__main__":
    main()
