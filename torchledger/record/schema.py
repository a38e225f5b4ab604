"""Validation of saved records: once, at load, before anything renders or compares them.

A record read back from a file is user input. :func:`parse_record` turns its text into plain
data in bounded work (nesting checked before ``json`` recurses; ``NaN``/``Infinity``, numbers
past int64 or float range, and lone surrogates refused) and :func:`check_record` holds it to
the shape ``StepRecord.to_dict()`` writes: the fields the renderers and the baseline gate read
have their types and ranges; fields that older records lack are simply absent (readers use
``.get(key, default)``); keys this version does not know are kept, bounded like the rest.
Every refusal is one :class:`RecordError` line naming the field, what was expected and what
arrived:

    totals.flops.total: expected a whole number from 0 to 2**63-1, got -5

Known limitations: fields only the analyzers read (``memory.retained``, ``optimizer.state``)
are bounded but not typed field by field; ``report`` runs no analyzer.
"""
from __future__ import annotations

from .jsonio import (MAX_DEPTH, MAX_INT, MAX_STRING, RecordError, arrived, check_values, fail,
                          parse_record, refuse)

__all__ = ["RecordError", "parse_record", "check_record", "MAX_DEPTH", "MAX_STRING", "MAX_INT",
           "MAX_MODULE_DEPTH"]

#: Module depth: named_modules() recurses, so deeper trees cannot be traced.
MAX_MODULE_DEPTH = 1000


# -- the shape of a record ------------------------------------------------------------------
class _Spec:
    describe = "a value"

    def ok(self, value) -> bool:
        return True

    def check(self, value, path: tuple) -> None:
        if not self.ok(value):
            fail(path, self.describe, value)


class _Count(_Spec):
    def __init__(self, lo: int = 0, hi: int = MAX_INT):
        self.lo, self.hi = lo, hi
        top = "2**63-1" if hi == MAX_INT else f"{hi:,}"
        self.describe = f"a whole number from {lo} to {top}"

    def ok(self, v):
        return isinstance(v, int) and not isinstance(v, bool) and self.lo <= v <= self.hi


class _Real(_Spec):
    def __init__(self, lo=None):
        self.lo = lo
        self.describe = "a number" if lo is None else f"a number >= {lo}"

    def ok(self, v):
        return (isinstance(v, (int, float)) and not isinstance(v, bool)
                and (self.lo is None or v >= self.lo))


class _Str(_Spec):
    def __init__(self, choices=None):
        self.choices = choices
        self.describe = f"one of {', '.join(choices)}" if choices else "a string"

    def ok(self, v):
        return isinstance(v, str) and (self.choices is None or v in self.choices)


class _Bool(_Spec):
    describe = "true or false"

    def ok(self, v):
        return isinstance(v, bool)


class _Null(_Spec):
    def __init__(self, inner: _Spec):
        self.inner = inner
        self.describe = f"{inner.describe} or null"

    def check(self, value, path):
        if value is not None:
            try:
                self.inner.check(value, path)
            except RecordError as e:        # the wrong type here: say that null would do too
                if getattr(e, "path", None) == path:
                    fail(path, self.describe, value)
                raise


class _Either(_Spec):
    def __init__(self, *specs: _Spec, describe: str):
        self.specs, self.describe = specs, describe

    def check(self, value, path):
        for spec in self.specs:
            try:
                spec.check(value, path)
                return
            except RecordError:
                continue
        fail(path, self.describe, value)


class _List(_Spec):
    def __init__(self, item: _Spec):
        self.item = item
        self.describe = "a list"

    def check(self, value, path):
        if not isinstance(value, (list, tuple)):     # tuples: a traced record's, JSON lists
            fail(path, self.describe, value)
        for i, v in enumerate(value):
            self.item.check(v, path + (i,))


class _Obj(_Spec):
    """An object whose listed keys have their specs; ``other`` is the spec of the rest."""

    def __init__(self, fields=None, *, other: _Spec | None = None, required=(), after=None):
        self.fields, self.other, self.required, self.after = fields or {}, other, required, after
        self.describe = "an object"

    def check(self, value, path):
        if not isinstance(value, dict):
            fail(path, self.describe, value)
        for key in self.required:
            if key not in value:
                refuse(path + (key,), self.fields[key].describe, "nothing (the key is missing)")
        for key, v in value.items():
            spec = self.fields.get(key, self.other)
            if spec is not None:
                spec.check(v, path + (key,))
        if self.after is not None:
            self.after(value, path)


ANY = _Spec()
COUNT = _Count()
REAL = _Real()
NONNEG = _Real(0)
STR = _Str()
OPT_STR = _Null(STR)
OPT_COUNT = _Null(COUNT)
COUNTS = _Obj(other=COUNT)


def _categories_not_phase(memory: dict, path: tuple) -> None:
    if "phase" in (memory.get("categories") or []):
        refuse(path + ("categories",), "names of byte counts in the timeline rows", "'phase'")


def _allocator_summary(alloc: dict, path: tuple) -> None:
    if alloc.get("available") and "summary" not in alloc:
        refuse(path + ("summary",), "the allocator summary (available is true)", "nothing")


def _rank_in_world(totals: dict, path: tuple) -> None:
    """``rank`` below ``world_size``; the mesh, when given, has ``world_size`` ranks in all
    (records made before these keys existed lack them: rank 0 of 1)."""
    rank, world, mesh = totals.get("rank", 0), totals.get("world_size", 1), totals.get("mesh")
    if not (isinstance(rank, int) and isinstance(world, int)):
        return                              # their own specs have refused them already
    if rank >= world:
        refuse(path + ("rank",), f"a rank below totals.world_size ({world})", str(rank))
    if isinstance(mesh, list) and all(isinstance(n, int) for n in mesh):
        size = 1
        for n in mesh:
            size *= n
            if size > world:                # no bigger numbers than needed to say no
                break
        if not mesh or size != world:
            refuse(path + ("mesh",), f"a mesh shape whose sizes multiply to totals.world_size ({world})",
                   str(mesh) if len(mesh) <= 8 else arrived(mesh))


TOTALS = _Obj({
    **{k: COUNT for k in ("params", "matmul_params", "trainable_params", "tokens", "flops_causal",
                          "hardware_flops", "activation_bytes", "activation_bytes_peak",
                          "optimizer_state_bytes", "param_bytes", "trainable_param_bytes", "grad_bytes",
                          "grad_bytes_end", "buffer_bytes", "peak_bytes", "bytes_read", "bytes_written",
                          "copy_bytes", "param_matmul_flops_forward", "param_matmul_flops_grad")},
    **{k: COUNTS for k in ("flops", "attention_flops", "elementwise_flops", "view_ops")},
    "peak_phase": OPT_STR, "peak_module": OPT_STR, "tokens_source": OPT_STR, "mfu_source": OPT_STR,
    "step_seconds": _Null(NONNEG), "step_seconds_untraced": _Null(NONNEG), "mfu": _Null(NONNEG),
    "step_timing": _Obj({"steps": COUNT, "warmup_steps": COUNT, "median_seconds": NONNEG,
                         "min_seconds": NONNEG, "max_seconds": NONNEG, "spread": NONNEG}),
    "hfu": _Null(NONNEG),
    "comm_bytes": COUNTS,
    "rank": COUNT, "world_size": _Count(1), "mesh": _Null(_List(_Count(1))),
    "tensor_parallel": _Count(1),
    "layout": _Null(_Obj({"shard_group": _Count(1), "replicate_group": _Count(1), "tp": _Count(1),
                          "params": _List(_List(ANY))})),
}, after=lambda totals, path: _rank_in_world(totals, path))

COMPARISON = _Obj({"quantity": STR, "measured": _Null(REAL), "predicted": _Null(REAL),
                   "ratio": _Null(REAL), "explanation": OPT_STR, "unit": OPT_STR},
                  required=("quantity", "measured", "predicted"))
# audit --gpu: predictions.step_time (analyzers/steptime.py)
STEP_TIME = _Obj({"gpu": STR, "seconds": NONNEG, "micro_batches": COUNT,
                  **{k: _Null(NONNEG) for k in ("tokens_per_s_per_gpu", "mfu", "hfu", "measured_seconds",
                                                "predicted_over_measured", "matmul_fraction_of_peak")},
                  **{k: NONNEG for k in ("comm_seconds", "comm_exposed_seconds", "bubble_seconds",
                                         "fusable_seconds", "fusable_launch_seconds")},
                  "by_phase": _Obj(other=NONNEG), "by_kind": _Obj(other=NONNEG), "bound": STR,
                  "assumptions": _List(STR)}, required=("gpu", "seconds"))
PREDICTIONS = _Obj({"comparisons": _List(COMPARISON), "step_time": STEP_TIME},
                   other=_Either(_Null(REAL), _Obj(), _List(ANY),
                                 describe="a number, null, an object or a list"))

MODULE = _Obj({
    "name": STR, "type": STR, "depth": _Count(0, MAX_MODULE_DEPTH), "flops_share": NONNEG,
    **{k: COUNT for k in ("params", "flops_forward", "flops_backward", "flops_recompute", "flops_self",
                          "activation_bytes", "copy_bytes", "copies", "calls", "peak_bytes")},
    "predicted_seconds": NONNEG,
}, required=("name",))
OP = _Obj({"op": STR, "phase": STR, "module": OPT_STR, "kind": STR,
           **{k: COUNT for k in ("count", "flops", "flops_causal", "bytes_read", "bytes_written",
                                 "fused_bytes", "fused_kernels")}})
UNCOUNTED = _Obj({"op": STR, "count": COUNT, "phases": _List(STR), "modules": _List(OPT_STR)},
                 required=("op", "count"))
COPY = _Obj({"op": STR, "module": OPT_STR, "phase": STR, "location": OPT_STR, "reason": STR,
             "count": COUNT, "bytes": COUNT})
COLLECTIVE = _Obj({"op": STR, "phase": STR, "module": OPT_STR, "location": OPT_STR,
                   **{k: COUNT for k in ("bytes", "group_size", "count", "bytes_received", "algo_bytes",
                                         "bus_bytes", "group_span", "micro_steps")},
                   "predicted_seconds": NONNEG, "predicted_algorithm": STR},
                  required=("op", "bytes", "count"))
FINDING = _Obj({"rule": STR, "severity": _Str(("error", "warning", "info")), "message": STR,
                "module": OPT_STR, "location": OPT_STR, "hint": OPT_STR},
               required=("rule", "severity", "message"))

AUDIT = _Obj({"file": STR, "entry": STR, "device": STR, "steps": COUNT, "seq_len": OPT_COUNT,
              "spec_line": _Null(_Count(1, 2**31 - 1)), "loss": OPT_STR,
              "precision": OPT_STR, "kernels": OPT_STR})
COMPILED = _Obj({"modules": _List(STR), "calls": COUNT, "traced_step": STR, "note": OPT_STR})
AUTOCAST = _Obj({"device_type": STR, "dtype": STR})
GPU_KERNELS = _Obj(other=_Obj({"calls": COUNT, "note": STR}, required=("calls", "note")))
SUPPRESSED = _Obj({"ignore": _List(STR), "count": COUNT, "rules": COUNTS})
META = _Obj({"model": OPT_STR, "device": OPT_STR, "gpu": OPT_STR, "dtype": OPT_STR, "torch": OPT_STR,
             "attention_kernels": _Null(_List(STR)), "step_index": OPT_COUNT, "ops": COUNT,
             "failed": _Bool(), "phases": _List(STR), "seq_len": OPT_COUNT, "audit": AUDIT,
             "compiled": _Null(COMPILED), "autocast": _Null(AUTOCAST),
             "suppressed": _Null(SUPPRESSED), "gpu_kernels": _Null(GPU_KERNELS)})

TIMELINE_ROW = _Obj({"phase": STR}, other=COUNT)


class _OpRun(_Spec):
    describe = "an [op name, count, FLOPs] triple"

    def ok(self, v):
        return (isinstance(v, (list, tuple)) and len(v) == 3 and isinstance(v[0], str)
                and COUNT.ok(v[1]) and COUNT.ok(v[2]))


def _start_before_end(seg: dict, path: tuple) -> None:
    if seg["end"] < seg["start"]:
        refuse(path + ("end",), f"an op index >= start ({seg['start']})", repr(seg["end"]))


SEGMENT = _Obj({"start": COUNT, "end": COUNT, "phase": STR, "module": OPT_STR, "ops": _List(_OpRun())},
               required=("start", "end", "phase"), after=_start_before_end)
ALLOCATOR = _Obj({"available": _Bool(), "reason": OPT_STR,
                  "summary": _Obj({k: COUNT for k in ("reserved_bytes", "allocated_bytes",
                                                      "largest_free_bytes")} | {"fragmentation": NONNEG},
                                  required=("reserved_bytes", "allocated_bytes", "largest_free_bytes",
                                            "fragmentation"))},
                 after=_allocator_summary)
MEMORY = _Obj({"timeline": _List(TIMELINE_ROW), "categories": _List(STR), "note": OPT_STR,
               "peak_breakdown": COUNTS, "end_breakdown": COUNTS, "phase_peaks": COUNTS,
               "peak_bytes": COUNT, "peak_op_index": COUNT, "recompute_saved_bytes": COUNT,
               "retained_new": COUNTS, "grads": _Obj(other=OPT_COUNT), "allocator": ALLOCATOR,
               "retained": _List(_Obj()), "module_caches": _List(_Obj()), "output_cache": _Obj(),
               "segments": _List(SEGMENT), "segments_merged": _Bool(), "segments_dropped": COUNT},
              after=_categories_not_phase)
OPTIMIZER = _Obj({"names": _List(STR), "kind": OPT_STR, "precision": OPT_STR, "state": _List(_Obj()),
                  "state_bytes": COUNT, "params": COUNT, "bytes_per_param": _Null(NONNEG),
                  "master_weight_bytes": COUNT, "shards": _Count(1), "note": OPT_STR})

RECORD = _Obj({"schema": STR, "conventions": _Obj(), "meta": META, "totals": TOTALS,
               "predictions": PREDICTIONS, "modules": _List(MODULE), "ops": _List(OP),
               "uncounted_ops": _List(UNCOUNTED), "copies": _List(COPY), "memory": MEMORY,
               "optimizer": OPTIMIZER, "findings": _List(FINDING), "warnings": _List(STR),
               "collectives": _List(COLLECTIVE)})


def check_record(data, schema: str, *, values: bool = True) -> None:
    """Raise :class:`RecordError` unless ``data`` is a record of ``schema`` that renders.

    ``values=False`` skips the walk over every value, for data :func:`parse_record` returned."""
    if not isinstance(data, dict):
        raise RecordError(f"expected a JSON object with schema {schema!r}, got {arrived(data)}")
    if data.get("schema") != schema:
        raise RecordError(f"schema: expected {schema!r}, got {arrived(data.get('schema'))}; "
                          f"is this a torchledger record?")
    if values:
        check_values(data)
    RECORD.check(data, ())
