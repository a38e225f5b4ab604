"""TL-PREC-001: matmuls that ran in fp32 under a 16-bit plan.

A step meant to compute in 16 bits (``--precision bf16-mixed``/``fp16-mixed``/``bf16``, or
autocast seen in the step) whose matmuls ran in fp32 is priced, and would run, at the fp32
peak (19.5 TF/s on an A100 instead of 312): a runner that calls the model without the plan's
autocast, a module outside the autocast region, a cast back to fp32 before a linear layer.
The share is read from the traced matmuls' operand dtypes (``record.ops[].shapes[].dtype``).

    >>> from torchledger.analyzers.precision import check_precision
    >>> check_precision([record], {})        # [] when the matmuls ran as the plan meant

Known limitations: a step whose fp32 matmuls are deliberate (an fp32 router or loss head)
gets the warning when they are over ``fp32_matmul_share`` (default 1%) of the matmul FLOPs;
ignore the rule there (``ignore = ["TL-PREC-001"]``).
"""
from __future__ import annotations

from ..record import Finding, matmul_flops_by_dtype

__all__ = ["check_precision", "matmul_flops_by_dtype", "intended_compute_dtype"]

SIXTEEN_BIT = {"bf16-mixed": "bf16", "fp16-mixed": "fp16", "bf16": "bf16"}
_AUTOCAST = {"bfloat16": "bf16", "float16": "fp16"}


def intended_compute_dtype(rec):
    """(dtype, why) the step was meant to compute in when 16-bit, else (None, None): the
    audit's ``--precision``, else autocast seen in the step."""
    audit = rec.meta.get("audit") if isinstance(rec.meta.get("audit"), dict) else {}
    precision = audit.get("precision")
    if precision in SIXTEEN_BIT:
        return SIXTEEN_BIT[precision], f"--precision {precision}"
    cast = (rec.meta.get("autocast") or {}).get("dtype") if isinstance(rec.meta.get("autocast"), dict) else None
    if cast in _AUTOCAST:
        return _AUTOCAST[cast], f"autocast {cast}"
    return None, None


def check_precision(records, options=None) -> list:
    """TL-PREC-001 (warning): over ``fp32_matmul_share`` of the matmul FLOPs ran in fp32 in a
    step meant to compute in 16 bits."""
    if not records:
        return []
    rec = records[-1]
    want, why = intended_compute_dtype(rec)
    if want is None:
        return []
    by_dtype = matmul_flops_by_dtype(rec)
    total = sum(by_dtype.values())
    fp32 = by_dtype.get("fp32", 0)
    share = float((options or {}).get("fp32_matmul_share", 0.01))
    if not total or fp32 <= share * total:
        return []
    return [Finding("TL-PREC-001", "warning",
                    f"{why}: {fp32:,} of {total:,} matmul FLOPs ({100 * fp32 / total:.1f}%) ran in fp32, "
                    f"not {want}: they are counted and priced at the fp32 rate",
                    measured=fp32, expected=0,
                    hint="run the model inside the plan's autocast (or give the module 16-bit weights); "
                         "ignore TL-PREC-001 where fp32 matmuls are deliberate")]
