"""Plain records of a traced step: no tensors, no module references.

:class:`StepRecord` is what a tracer hands back on exit and what analyzers, renderers and
the CLI consume. It round-trips through JSON (``to_json``/``from_json``) so a step can be
saved in CI and analysed offline. :class:`Finding` is one verdict of an analyzer.

Conventions (stated in every record under ``conventions``):
FLOP = 2 x multiply-add. ``totals.flops`` counts matmul-class work only (mm, bmm, addmm,
baddbmm, convolution, attention, scaled_mm); attention is counted dense, its causal-halved
figure is in ``totals.attention_flops.causal``; attention backward = 2 x forward;
recomputation (activation checkpointing) is excluded from model FLOPs and included in
``totals.hardware_flops``; element-wise/norm/softmax FLOPs are in ``totals.elementwise_flops``.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from .finding import EMPTY_SENTENCE, SEVERITIES, Finding, as_findings, is_empty  # noqa: F401  (re-exported)
from ..files import make_folders, rank_path, write_atomic
from .schema import check_record, parse_record
from .trace import trace_events

__all__ = ["StepRecord", "Finding", "SCHEMA", "CONVENTIONS", "TOKENS_GIVEN", "TOKENS_FROM_SPEC",
           "SAMPLES_NOT_TOKENS", "OPTIMIZER_SHARDS_ATTR", "counts_samples", "EMPTY_SENTENCE", "is_empty", "as_findings",
           "attention_ran_causal", "matmul_flops_by_dtype", "compute_dtype"]

SCHEMA = "torchledger/1"

CONVENTIONS = {
    "flop": "FLOP = 2 x multiply-add",
    "flops_total": "matmul-class work only (mm/bmm/addmm/baddbmm/convolution/attention/scaled_mm); "
                   "element-wise, norm and softmax FLOPs are in elementwise_flops",
    "attention": "counted dense (no causal discount); causal-halved figure in attention_flops.causal; "
                 "backward = 2 x forward in model FLOPs; hardware_flops counts the flash, memory-efficient "
                 "and cuDNN backward kernels as 2.5 x forward (they recompute Q K^T)",
    "recompute": "activation-checkpoint recomputation excluded from model FLOPs, included in hardware_flops",
    "bytes": "bytes = numel x element size; activation bytes are unique storages saved for backward, "
             "parameters excluded",
}

#: ``totals.tokens_source``: how D (tokens per step) was obtained. Optional: records made
#: before it existed have no such key. ``None`` when no tokens were given to the tracer.
TOKENS_GIVEN = "given"                          # trace(..., tokens=N) / Ledger.step(tokens=N)
TOKENS_FROM_SPEC = "AuditSpec(tokens=...)"      # the audited file set it
SAMPLES_NOT_TOKENS = "samples, not tokens"      # in the source when D is a batch of images

#: ``optimizer.shards``: the attribute an optimizer carries when its state is split over that
#: many ranks, each updating its own part (Megatron's distributed optimizer, as the standard
#: plan builds it under ``--kernels te``); the tracer reports it.
OPTIMIZER_SHARDS_ATTR = "torchledger_shards"


def counts_samples(totals: dict) -> bool:
    """True when ``totals["tokens"]`` counts samples (the batch of an image-like input), not tokens."""
    return SAMPLES_NOT_TOKENS in str(totals.get("tokens_source") or "")


def attention_ran_causal(record):
    """Whether the step's attention ran causal: True when a kernel was told ``is_causal`` (the
    record's causal count is below its dense one) or got an explicit mask the tracer took for
    the causal one (``mask_causal`` in an op's shapes: a causal LM traced on fake tensors);
    False when attention kernels ran and none was causal (an encoder, a UNet's cross-attention);
    None when no attention kernel ran (attention written as matmuls, or none)."""
    attn = (record.totals or {}).get("attention_flops") or {}
    dense, causal = int(attn.get("dense") or 0), int(attn.get("causal") or 0)
    if dense <= 0:
        return None
    if causal < dense:
        return True
    return any(s.get("mask_causal") for row in record.ops or () if row.get("kind") == "attention"
               for s in row.get("shapes") or ())


def matmul_flops_by_dtype(record, kinds=("matmul",)) -> dict:
    """{dtype: FLOPs} of the record's rows of ``kinds`` (matmul; attention too where asked),
    from their shapes' operand dtypes (``"bf16"``, ``"fp32"``, ...)."""
    out: dict = {}
    for row in record.ops or ():
        if row.get("kind") not in kinds:
            continue
        for s in row.get("shapes") or ():
            dt = s.get("dtype") or "?"
            out[dt] = out.get(dt, 0) + int(s.get("flops") or 0)
    return out


_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp8": "float8", "tf32": "float32"}


def compute_dtype(record) -> tuple:
    """(dtype, how) the step computed in, as measured: the dtype of most of its matmul and
    attention FLOPs (``"bfloat16"`` under autocast or FSDP's MixedPrecisionPolicy, whose
    weights stay float32), ``how`` naming what made it so (``"autocast"``, the audit's
    ``"--precision bf16-mixed"``, or ``"matmuls"``); without traced shapes (older records),
    autocast's dtype, else the weights' dtype with ``how`` ``"weights"``."""
    meta = record.meta or {}
    weights = str(meta.get("dtype") or "float32").replace("torch.", "")
    cast = (meta.get("autocast") or {}).get("dtype") if isinstance(meta.get("autocast"), dict) else None
    precision = (meta.get("audit") or {}).get("precision") if isinstance(meta.get("audit"), dict) else None
    how = ("autocast" if cast else f"--precision {precision}" if precision and precision != "fp32"
           else "matmuls")
    by_dtype = {k: v for k, v in matmul_flops_by_dtype(record, ("matmul", "attention")).items()
                if k in _DTYPE_NAMES and v}
    if by_dtype:
        return _DTYPE_NAMES[max(by_dtype, key=by_dtype.get)], how
    if cast:
        return str(cast), "autocast"
    return weights, "weights"


def _empty_totals() -> dict:
    return {
        "params": 0, "matmul_params": 0, "tokens": 0,
        "flops": {"forward": 0, "backward": 0, "optimizer": 0, "total": 0, "other": 0},
        "flops_causal": 0,
        "attention_flops": {"dense": 0, "causal": 0},
        "hardware_flops": 0,
        "elementwise_flops": {"forward": 0, "backward": 0, "recompute": 0, "optimizer": 0, "other": 0,
                              "total": 0},
        "activation_bytes": 0, "optimizer_state_bytes": 0, "param_bytes": 0, "grad_bytes": 0,
        "buffer_bytes": 0, "peak_bytes": 0, "peak_phase": None, "peak_module": None,
        "bytes_read": 0, "bytes_written": 0, "copy_bytes": 0,
        "step_seconds": None, "mfu": None,
        "rank": 0, "world_size": 1, "mesh": None,     # torch.distributed: tracer/ranks.py
        "tensor_parallel": 1,
        "comm_bytes": {"forward": 0, "backward": 0, "optimizer": 0, "other": 0, "total": 0},
    }


@dataclass
class StepRecord:
    """Everything measured about one training step, as plain data.

    Fields are dicts and lists of plain values so that ``to_dict`` is the JSON shape of
    docs/record-format.md and new fields can be added without breaking old files (readers use
    ``.get(key, default)``).
    """

    meta: dict = field(default_factory=dict)
    """device, dtype, attention kernels seen, torch version, model class, step index."""
    totals: dict = field(default_factory=_empty_totals)
    predictions: dict = field(default_factory=dict)
    modules: list = field(default_factory=list)
    """Per module (inclusive of children), in ``named_modules()`` order."""
    ops: list = field(default_factory=list)
    """Aggregated per (op, phase, module): count, kind, flops, bytes."""
    uncounted_ops: list = field(default_factory=list)
    copies: list = field(default_factory=list)
    """Copy events grouped by (op, module, location, reason)."""
    memory: dict = field(default_factory=dict)
    """Peak breakdown by category, timeline, per-phase and CUDA allocator figures."""
    optimizer: dict = field(default_factory=dict)
    findings: list = field(default_factory=list)
    warnings: list = field(default_factory=list)
    collectives: list = field(default_factory=list)
    """Distributed steps only: collectives grouped by (op, group size, phase, module, location)."""

    # -- serialisation --------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = {
            "schema": SCHEMA,
            "conventions": dict(CONVENTIONS),
            "meta": self.meta,
            "totals": self.totals,
            "predictions": self.predictions,
            "modules": self.modules,
            "ops": self.ops,
            "uncounted_ops": self.uncounted_ops,
            "copies": self.copies,
            "memory": self.memory,
            "optimizer": self.optimizer,
            "findings": [f.to_dict() if isinstance(f, Finding) else f for f in self.findings],
            "warnings": self.warnings,
        }
        if self.collectives:            # distributed steps only: single-process records unchanged
            d["collectives"] = self.collectives
        return d

    def to_json(self, indent: Optional[int] = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=False, default=_jsonable)

    def to_trace(self, findings=None) -> dict:
        """The step as Trace Event JSON (a dict: ``{"traceEvents": [...], ...}``) for
        ui.perfetto.dev and chrome://tracing; ``json.dump`` it to a ``.trace.json`` file.
        The clock is synthetic (1 op = 1 us): see :mod:`torchledger.render.trace_events`."""
        return trace_events(self, findings)

    def save(self, path, *, regular_only: bool = False) -> str:
        """Write the record as JSON (atomically, UTF-8) and return the path written.

        Under torchrun each rank can save to the same ``path``: ``{rank}`` in it becomes
        ``totals.rank``, a folder gets ``rank{r}.json`` in it, and a plain file name gets
        ``.rank{r}`` before its extension when ``totals.world_size > 1``
        (``record.save("runs/step.json")`` -> ``runs/step.rank1.json``). Merge the ranks' files
        with ``torchledger report runs/step.rank*.json``.

        Missing folders on the way are created (``mkdir -p``; ranks racing to make the same
        one is fine); a folder that cannot be made raises ``OSError`` naming it.
        ``regular_only``: a path that is a FIFO or a device raises ``OSError`` rather than being
        written in place (``write_atomic``; ``Ledger(save_to=)`` must never block a step)."""
        out = rank_path(path, self.totals.get("rank", 0), self.totals.get("world_size", 1))
        make_folders(out, f"save({os.fspath(path)!r})")
        write_atomic(out, self.to_json() + "\n", regular_only=regular_only)
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "StepRecord":
        """A record from its ``to_dict()`` shape, validated first (:mod:`torchledger.record.schema`):
        a malformed one raises ``RecordError`` (a ``ValueError``) naming the field, what was
        expected and what arrived. Fields older records lack take their defaults."""
        check_record(d, SCHEMA)
        return cls._from_checked(d)

    @classmethod
    def _from_checked(cls, d: dict) -> "StepRecord":
        totals = _empty_totals()
        for key, value in d.get("totals", {}).items():      # nested parts keep their defaults
            totals[key] = {**totals[key], **value} if key in _NESTED_TOTALS else value
        return cls(meta=d.get("meta", {}), totals=totals, predictions=d.get("predictions", {}),
                   modules=d.get("modules", []), ops=d.get("ops", []),
                   uncounted_ops=d.get("uncounted_ops", []), copies=d.get("copies", []),
                   memory=d.get("memory", {}), optimizer=d.get("optimizer", {}),
                   findings=[Finding.from_dict(f) for f in d.get("findings", [])],
                   warnings=d.get("warnings", []), collectives=d.get("collectives", []))

    @classmethod
    def from_json(cls, text) -> "StepRecord":
        """A record from JSON text (str or UTF-8 bytes), parsed in bounded work: nesting is
        checked before ``json`` recurses, NaN/Infinity and numbers past int64 are refused."""
        d = parse_record(text)                  # every value already bounded: check the shape
        check_record(d, SCHEMA, values=False)
        return cls._from_checked(d)

    # -- tables ---------------------------------------------------------------------------
    def ops_df(self):
        """One row per (op, phase, module): count, kind, flops, flops_causal, bytes."""
        import pandas as pd
        return pd.DataFrame(self.ops, columns=_OP_COLUMNS)

    def modules_df(self):
        import pandas as pd
        return pd.DataFrame(self.modules)

    def memory_df(self):
        """The live-memory timeline: one row per sample, bytes per category."""
        import pandas as pd
        return pd.DataFrame(self.memory.get("timeline", []))


_OP_COLUMNS = ["op", "phase", "module", "kind", "count", "flops", "flops_causal",
               "bytes_read", "bytes_written"]


_NESTED_TOTALS = ("flops", "attention_flops", "elementwise_flops")


def _jsonable(x):
    if hasattr(x, "item"):
        return x.item()
    if isinstance(x, (set, tuple)):
        return list(x)
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")
