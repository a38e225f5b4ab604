"""The record room: one traced step as data (``StepRecord``, ``Finding``), its JSON reader
with limits (``jsonio``) and the schema every record is checked against (``schema``).

Everything above reads records; the record imports nothing of the package but ``units``
(its ``to_trace()`` / ``save()`` conveniences hand the work to ``render``, imported inside
the method, see ``core``)."""
from .core import (CONVENTIONS, SAMPLES_NOT_TOKENS, SCHEMA, SEVERITIES, TOKENS_FROM_SPEC, TOKENS_GIVEN,  # noqa: F401
                   Finding, StepRecord, attention_ran_causal, compute_dtype, counts_samples,
                   matmul_flops_by_dtype)

__all__ = ["StepRecord", "Finding", "SCHEMA", "SEVERITIES", "CONVENTIONS", "TOKENS_GIVEN", "TOKENS_FROM_SPEC",
           "SAMPLES_NOT_TOKENS", "counts_samples", "attention_ran_causal", "compute_dtype",
           "matmul_flops_by_dtype"]
