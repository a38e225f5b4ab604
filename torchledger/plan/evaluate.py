"""Pricing the candidates of ``torchledger plan``: each is the audit its ``audit_args`` stand
for, run in this process (``audit.engine.run_audit`` at the candidate's world, mesh and plan
options, then ``steptime.predict.predict_into`` as ``audit --gpu`` calls it), so a plan's
figures are the audit's by construction.

A *chain* is the candidates of one mesh, policy and schedule in rising micro-batch size. The
peak only grows with the micro-batch (the activations do, nothing else changes), so once one
does not fit, the larger ones are not traced: they are reported as not fitting, by the smaller
one's figures. Each chain runs in a forked child (``search``), so that one model file's
state, or one world's, never meets the next.
"""
from __future__ import annotations

from typing import Optional

from .space import Candidate, ModelFacts
from ..audit.errors import raised, where
from ..audit.loading import load_entry, quiet_torch_logs
from ..audit.spec import AuditError, as_spec
from ..parallel.plan import find_decoder
from ..record.tokens import infer_tokens
from ..steptime.predict import predict_into

__all__ = ["probe", "audit_args", "price", "run_chain", "warm", "STEPS"]

#: Steps each candidate's audit traces: the second is steady, and its figures are the third's
#: that ``audit`` reports by default (tests/test_plan.py). NB: one step with the steady
#: estimate of its peak (``record.steady.steady_peak``) would halve the tracing, but on
#: llama-tiny at dp=2,tp=2 with full checkpointing it is 844,120 B against the third step's
#: 857,560 (1.6%), past the plan's 1%.
STEPS = 2


def warm() -> None:
    """Import what every candidate's audit imports, once, in the process the chains fork from
    (torch.distributed's FSDP2, DTensor and TP, the tracer, the plans): 6 s a chain otherwise."""
    import importlib
    for name in ("torch", "torch.distributed.fsdp", "torch.distributed.tensor", "torch.distributed.tensor.parallel",
                 "torch._dynamo", "torchledger.ledger", "torchledger.parallel.plan", "torchledger.audit.engine",
                 "torchledger.audit.world", "torchledger.audit.pipeline", "torchledger.steptime.predict",
                 "torchledger.analyzers.compare", "torchledger.render.sarif"):
        importlib.import_module(name)


def probe(path: str, entry: str = "audit_spec") -> ModelFacts:
    """What the model allows (blocks, heads, KV heads, MLP width, experts, sequence, batch),
    read off the model file's spec built on the meta device (no memory). AuditError if the
    model is not a decoder the standard plan knows."""
    import torch
    fn = load_entry(path, entry)
    try:
        with quiet_torch_logs(), torch.device("meta"):
            spec = as_spec(fn())
    except Exception as e:  # noqa: BLE001  (the user's code: one line)
        raise AuditError(f"{where(e, path)}: {entry}() {raised(e)}") from None
    dec = find_decoder(spec.model)
    if dec is None:
        raise AuditError(f"{path}: plan searches the layouts of decoders the standard plan knows "
                         f"(torchledger's models, Hugging Face Llama/Mistral/Qwen2 and their MoE kin), not "
                         f"{type(spec.model).__name__}")
    if spec.parallelize is not None:
        raise AuditError(f"{path}: the spec brings its own AuditSpec(parallelize=fn); plan searches the "
                         f"standard plan's layouts: drop parallelize= from the spec to plan it")
    count = infer_tokens(spec.inputs)
    if not (count.tokens and count.seq_len):
        raise AuditError(f"{path}: the spec's inputs have no [batch, sequence] token ids; plan needs them to "
                         f"size the micro-batches")
    return ModelFacts(blocks=len(dec.blocks), n_heads=dec.n_heads, n_kv_heads=dec.n_kv_heads, d_ff=dec.d_ff,
                      seq_len=count.seq_len, experts=dec.experts, sequence_parallel=dec.sequence_parallel,
                      batch=count.tokens // count.seq_len)


def audit_args(c: Candidate, global_batch: int) -> list:
    """The flags that, after ``audit FILE --gpu NAME --world-size N``, audit this candidate."""
    args = ["--mesh", c.mesh, "--micro-batch-size", str(c.micro_batch_size), "--global-batch", str(global_batch),
            "--checkpointing", c.checkpointing, "--precision", c.precision, "--kernels", c.kernels]
    if c.schedule is not None:
        args += ["--schedule", c.schedule]
    if c.virtual_stages > 1:
        args += ["--virtual-stages", str(c.virtual_stages)]
    return args


def price(path: str, entry: str, gpu: str, gpus: int, c: Candidate) -> dict:
    """The candidate's figures from its audit (see the module docstring). AuditError as the
    audit raises it."""
    from ..audit.engine import run_audit
    plan = {"micro_batch_size": c.micro_batch_size, "global_batch": c.global_batch,
            "checkpointing": c.checkpointing, "precision": c.precision, "kernels": c.kernels,
            "schedule": c.schedule, "virtual_stages": c.virtual_stages if c.virtual_stages > 1 else None}
    run = run_audit(path, entry=entry, device="fake", steps=STEPS, world_size=gpus, mesh=c.mesh, plan=plan)
    rec = run.record
    predict_into(rec, gpu, {"compiled": c.kernels == "compiled" or None},
                 stages=getattr(run, "stage_records", None))
    return figures(rec)


def figures(rec) -> dict:
    """What a plan row shows of an audited record (``predictions.step_time`` and the peak)."""
    pred = rec.predictions.get("step_time")
    if not isinstance(pred, dict):
        why = next((w for w in rec.warnings if "predicted step time" in w), "no prediction")
        raise AuditError(f"the step time could not be predicted: {why}")
    pipe = rec.totals.get("pipeline") if isinstance(rec.totals.get("pipeline"), dict) else {}
    stages = {s["rank"]: s["peak_bytes"] for s in pipe.get("per_stage") or ()}
    by_phase, by_kind = pred.get("by_phase") or {}, pred.get("by_kind") or {}
    return {
        "step_seconds": pred["seconds"], "tokens_per_s_per_gpu": pred["tokens_per_s_per_gpu"],
        "mfu": pred["mfu"], "peak_bytes": int(rec.totals.get("peak_bytes") or 0),
        "peak_rank": int(pipe.get("bounding_rank", 0)) if pipe else 0,
        "stage_peak_bytes": stages,
        "comm_exposed_seconds": pred.get("comm_exposed_seconds") or 0.0,
        "bubble_seconds": pred.get("bubble_seconds") or 0.0,
        "recompute_seconds": by_phase.get("recompute") or 0.0,
        "compute_seconds": sum(by_kind.get(k) or 0.0 for k in ("matmul", "attention", "memory_bound")),
        "launch_seconds": by_kind.get("launch") or 0.0,
        "bound": pred.get("bound"),
    }


def run_chain(path: str, entry: str, gpu: str, gpus: int, chain: list, limit_bytes: float) -> list:
    """Price a chain (see the module docstring): a dict per candidate with ``figures`` (None
    when not priced), ``error`` (the audit's one line, or None) and ``traced``; past the first
    that does not fit, the rest are not traced (``skipped``: the smaller micro-batch's peak)."""
    out, over = [], None
    for c in chain:
        row = {"candidate": c, "figures": None, "error": None, "traced": False, "skipped": None}
        out.append(row)
        if over is not None:
            row["skipped"] = over
            continue
        row["traced"] = True
        try:
            row["figures"] = price(path, entry, gpu, gpus, c)
        except AuditError as e:
            row["error"] = str(e)
            continue
        if row["figures"]["peak_bytes"] > limit_bytes:
            over = {"micro_batch_size": c.micro_batch_size, "peak_bytes": row["figures"]["peak_bytes"]}
    return out
