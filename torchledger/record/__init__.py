"""The record room: one traced step as data (``StepRecord``, ``Finding``), its JSON reader
with limits (``jsonio``) and the schema every record is checked against (``schema``).

Everything above reads records; the record imports nothing of the package but ``units``
(its ``to_trace()`` / ``save()`` conveniences hand the work to ``render``, imported inside
the method, see ``core``)."""
from .core import (CONVENTIONS, OPTIMIZER_SHARDS_ATTR, SAMPLES_NOT_TOKENS, SCHEMA, SEVERITIES,  # noqa: F401
                   TOKENS_FROM_SPEC, TOKENS_GIVEN,
                   Finding, StepRecord, attention_ran_causal, compute_dtype, counts_samples,
                   matmul_flops_by_dtype)

__all__ = ["StepRecord", "Finding", "SCHEMA", "SEVERITIES", "CONVENTIONS", "TOKENS_GIVEN", "TOKENS_FROM_SPEC",
           "OPTIMIZER_SHARDS_ATTR",
           "SAMPLES_NOT_TOKENS", "counts_samples", "attention_ran_causal", "compute_dtype",
           "matmul_flops_by_dtype"]
