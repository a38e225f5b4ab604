"""Pricing the candidates of ``torchledger plan``: each is the audit its ``audit_args`` stand
for, run in this process (``audit.engine.run_audit`` at the candidate's world, mesh and plan
options, then ``steptime.predict.predict_into`` as ``audit --gpu`` calls it), with two
savings that keep the figures the audit's (tests/test_plan.py checks rows against ``audit``):

- *One trace, every schedule*: the candidates that differ only in their pipeline schedule
  (1F1B, GPipe, zero-bubble at the same virtual stages) are one trace of the stages, each
  schedule composed from it (``run_audit(schedules=...)``): a rank's micro-steps do not depend
  on the schedule, only which of them are in flight together.
- *Per block*: a model whose blocks are alike (from the second on: same modules, parameter
  shapes and attention kind) is traced at three short depths, 3, 4 and 5 blocks a pipeline
  chunk (``Layout.blocks``), and each figure taken at its own depth K by the line through the
  last two: f(K) = f(4) + (K - 4) x (f(5) - f(4)), once f(3) is on that line too
  (:data:`OFF_LINE`; else the layout is traced whole). Every figure is a sum over blocks plus
  what the ends add (the embedding, the head, the first gather, the last reduction), so the
  line is exact once the ends are past; the check catches a peak that has not settled yet.
  The peak is taken per pipeline stage and micro-step, then the largest, so a bound that
  moves from the head's stage to the first with depth is followed. Chunks under
  :data:`MIN_REDUCED` blocks are traced whole (benchmarks/plan_speed.py --check measures
  the line against whole audits of Llama-3-8B).
"""
from __future__ import annotations

from typing import Optional

from .space import Candidate, ModelFacts
from ..audit.errors import raised, where
from ..audit.layouts import decoder
from ..audit.loading import load_entry, quiet_torch_logs
from ..audit.spec import AuditError, as_spec
from ..parallel.layout import Layout
from ..record.tokens import infer_tokens
from ..steptime.predict import predict_into

__all__ = ["probe", "audit_args", "price", "price_group", "run_chain", "warm", "depths", "extrapolate",
           "block_signature", "STEPS", "DEPTHS"]

#: Steps each candidate's audit traces: the second is steady, and its figures are the third's
#: that ``audit`` reports by default (tests/test_plan.py). NB: one step with the steady
#: estimate of its peak (``record.steady.steady_peak``) would halve the tracing, but on
#: llama-tiny at dp=2,tp=2 with full checkpointing it is 844,120 B against the third step's
#: 857,560 (1.6%), past the plan's 1%.
STEPS = 2
#: The depths (blocks a pipeline chunk) a layout whose blocks are alike is traced at: the line
#: through the last two gives each figure at the model's own depth, the first checks that the
#: figures are on a line by then. Not shallower: the peak settles at the second-last block's
#: backward (FSDP2 keeps the last block and the root gathered, prefetches one ahead) only from
#: 3 blocks on (llama-tiny at dp=2, B=2: 1,865,176 / 2,391,804 / 2,850,848 / 3,309,892 B at 2 /
#: 3 / 4 / 5 blocks, the peak at blocks.0 / blocks.1.mlp / blocks.2.mlp / blocks.3.mlp), and a
#: GPipe last stage's from 5 (hence the check).
DEPTHS = (3, 4, 5)
#: Chunks shallower than this are traced whole: the three short traces (12 blocks, three
#: builds) would cost about as much. A pipeline's, deeper: its ranks trace three micro-steps
#: each, whose fixed costs the short traces triple (Llama-3-8B at pp=2, 16 blocks a chunk:
#: two short depths took 20.9 s against the whole trace's 25.0 s, 12.5 against 11.9;
#: ``benchmarks/plan_speed.py --check``).
MIN_REDUCED = 16
MIN_REDUCED_PIPELINE = 32
#: How far off the line the check depth may be, as the error it would make at the model's
#: depth (the deviation x the blocks beyond, over the figure there): a quarter of the plan's
#: bar (2% step time, 1% peak). Past it the layout is traced whole.
OFF_LINE = {"step_seconds": 0.005, "peak_bytes": 0.0025}


def warm() -> None:
    """Import what every candidate's audit imports, once, in the process the chains fork from
    (torch.distributed's FSDP2, DTensor and TP, the tracer, the plans): 6 s a chain otherwise."""
    import importlib
    for name in ("torch", "torch.distributed.fsdp", "torch.distributed.tensor", "torch.distributed.tensor.parallel",
                 "torch._dynamo", "torchledger.ledger", "torchledger.parallel.plan", "torchledger.audit.engine",
                 "torchledger.audit.world", "torchledger.audit.pipeline", "torchledger.steptime.predict",
                 "torchledger.analyzers.compare", "torchledger.render.sarif"):
        importlib.import_module(name)


def probe(path: str, entry: str = "audit_spec", sequence_parallel=None) -> ModelFacts:
    """What the model allows (blocks, heads, KV heads, MLP width, experts, sequence, batch),
    read off the model file's spec built on the meta device (no memory), under
    ``--sequence-parallel`` ``sequence_parallel`` (None: the plan's default). AuditError if the
    model is not a decoder the standard plan knows or cannot take that choice."""
    import torch
    fn = load_entry(path, entry)
    try:
        with quiet_torch_logs(), torch.device("meta"):
            spec = as_spec(fn())
    except Exception as e:  # noqa: BLE001  (the user's code: one line)
        raise AuditError(f"{where(e, path)}: {entry}() {raised(e)}") from None
    dec = decoder(spec.model, Layout(sequence_parallel=sequence_parallel), path)
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
    signatures = [block_signature(b) for b in dec.blocks]
    alike_from = len(signatures) - 1
    while alike_from > 0 and signatures[alike_from - 1] == signatures[-1]:
        alike_from -= 1
    return ModelFacts(blocks=len(dec.blocks), n_heads=dec.n_heads, n_kv_heads=dec.n_kv_heads, d_ff=dec.d_ff,
                      seq_len=count.seq_len, experts=dec.experts, sequence_parallel=dec.sequence_parallel,
                      batch=count.tokens // count.seq_len, alike_from=alike_from)


#: Module attributes that make two blocks of the same shapes run differently (Hugging Face's
#: per-layer attention kinds: Gemma-2/3, Qwen2, GPT-OSS, Mistral's sliding windows).
KIND_ATTRS = ("attention_type", "layer_type", "is_sliding", "sliding_window", "use_sliding_window")


def block_signature(block) -> tuple:
    """What makes a block trace as it does: its modules' names and classes, its parameters'
    names, shapes and dtypes, and the attention kind its modules say they are."""
    mods = []
    for name, mod in block.named_modules():
        kinds = tuple((a, getattr(mod, a)) for a in KIND_ATTRS
                      if isinstance(getattr(mod, a, None), (int, str, bool, type(None))) and hasattr(mod, a))
        mods.append((name, type(mod).__name__, kinds))
    params = tuple((n, tuple(p.shape), str(p.dtype)) for n, p in block.named_parameters())
    return tuple(mods), params


def depths(facts: ModelFacts, c: Candidate) -> Optional[tuple]:
    """(k0, k1, k2, K): the three depths to trace (:data:`DEPTHS`) and the chunk's own (blocks
    a pipeline chunk), or None to trace the model whole (chunks under :data:`MIN_REDUCED` blocks, blocks not alike
    past the first)."""
    chunks = c.size("pp") * c.virtual_stages
    K = facts.blocks // chunks
    if K < (MIN_REDUCED_PIPELINE if chunks > 1 else MIN_REDUCED) or facts.alike_from > 1:
        return None
    return DEPTHS + (K,)


def audit_args(c: Candidate, global_batch: int) -> list:
    """The flags that, after ``audit FILE --gpu NAME --world-size N``, audit this candidate."""
    args = ["--mesh", c.mesh, "--micro-batch-size", str(c.micro_batch_size), "--global-batch", str(global_batch),
            "--checkpointing", c.checkpointing, "--precision", c.precision, "--kernels", c.kernels]
    if c.schedule is not None:
        args += ["--schedule", c.schedule]
    if c.virtual_stages > 1:
        args += ["--virtual-stages", str(c.virtual_stages)]
    if c.sequence_parallel is not None:
        args += ["--sequence-parallel", "on" if c.sequence_parallel else "off"]
    return args


def price(path: str, entry: str, gpu: str, gpus: int, c: Candidate, depth: Optional[tuple] = None) -> dict:
    """The candidate's figures (see the module docstring). AuditError as the audit raises it."""
    return price_group(path, entry, gpu, gpus, [c], depth)[0]


def price_group(path: str, entry: str, gpu: str, gpus: int, group: list, depth: Optional[tuple] = None) -> list:
    """The figures of each candidate of ``group`` (one layout, micro-batch and policy; its
    pipeline schedules, if any), in order: from one trace of the whole model (``depth`` None)
    or from three short ones (``depth`` = (k0, k1, k2, K) of :func:`depths`): the line through
    k1 and k2 (:func:`extrapolate`), once k0 shows the figures are on it (:func:`off_line`);
    when they are not, from a trace of the whole model after all."""
    if depth is None:
        return _priced_at(path, entry, gpu, gpus, group, None)
    k0, k1, k2, K = depth
    chunks = group[0].size("pp") * group[0].virtual_stages
    first, low, high = (_priced_at(path, entry, gpu, gpus, group, k * chunks) for k in (k0, k1, k2))
    if any(off_line(c, a, b, k0, k1, k2, K) for c, a, b in zip(first, low, high)):
        return _priced_at(path, entry, gpu, gpus, group, None)
    out = [extrapolate(a, b, k1, k2, K) for a, b in zip(low, high)]
    for row in out:
        row["blocks_traced"] = [k0, k1, k2]
        row["bound"] = None         # the short trace's shares are not the model's
    return out


def off_line(c: dict, a: dict, b: dict, k0: int, k1: int, k2: int, K: int) -> bool:
    """Whether the figures at k0 (``c``) are off the line through k1 (``a``) and k2 (``b``) by
    more than :data:`OFF_LINE` would make them off at K: the deviation grows with every block
    past k2 as it did over the k1 - k0 blocks before k1."""
    back, there = extrapolate(a, b, k1, k2, k0), extrapolate(a, b, k1, k2, K)
    for key, bar in OFF_LINE.items():
        err = abs(back[key] - c[key]) * (K - k2) / (k1 - k0)
        if err > bar * abs(there[key]):
            return True
    return False


def _priced_at(path, entry, gpu, gpus, group, blocks) -> list:
    """``group``'s figures from one audit of its layout with ``blocks`` blocks kept (None: all)."""
    from ..audit.engine import run_audit
    c = group[0]
    plan = {"micro_batch_size": c.micro_batch_size, "global_batch": c.global_batch,
            "checkpointing": c.checkpointing, "precision": c.precision, "kernels": c.kernels,
            "schedule": c.schedule, "virtual_stages": c.virtual_stages if c.virtual_stages > 1 else None,
            "blocks": blocks, "sequence_parallel": c.sequence_parallel}
    schedules = [x.schedule for x in group] if c.schedule is not None else None
    out = run_audit(path, entry=entry, device="fake", steps=STEPS, world_size=gpus, mesh=c.mesh, plan=plan,
                    schedules=schedules)
    figs = []
    for run in ([out[s] for s in schedules] if schedules else [out]):
        predict_into(run.record, gpu, {"compiled": c.kernels == "compiled" or None},
                     stages=getattr(run, "stage_records", None))
        figs.append(figures(run.record))
    return figs


#: Figures that are a sum over the blocks plus the ends' share: on the line through two depths.
LINEAR = ("step_seconds", "comm_exposed_seconds", "bubble_seconds", "recompute_seconds", "compute_seconds",
          "launch_seconds")


def extrapolate(a: dict, b: dict, k1: int, k2: int, K: int) -> dict:
    """The figures at K blocks a chunk from those at k1 (``a``) and k2 (``b``): each on the line
    through the two (times never below 0); tokens/s from the step time (the tokens do not
    change with depth), MFU from its numerator (model FLOPs, on the line); the peak per
    pipeline stage and micro-step on its line, the largest the bound (a largest of lines, so
    a peak that moves to another micro-step or stage with depth is followed)."""
    def line(x1, x2):
        return x1 + (K - k1) * (x2 - x1) / (k2 - k1)

    out = dict(b)
    for key in LINEAR:
        out[key] = max(0.0, line(a[key], b[key]))
    step = out["step_seconds"]
    out["tokens_per_s_per_gpu"] = b["tokens_per_s_per_gpu"] * b["step_seconds"] / step
    out["mfu"] = line(a["mfu"] * a["step_seconds"], b["mfu"] * b["step_seconds"]) / step
    stages = {r: int(round(max(line(a["stage_peak_by_micro_step"][r][k], v)
                               for k, v in b["stage_peak_by_micro_step"][r].items())))
              for r in b["stage_peak_by_micro_step"]}
    if stages:
        out["stage_peak_bytes"] = stages
        out["peak_rank"] = max(stages, key=lambda r: (stages[r], -r))
        out["peak_bytes"] = stages[out["peak_rank"]]
    else:
        out["peak_bytes"] = int(round(line(a["peak_bytes"], b["peak_bytes"])))
    out["blocks_traced"] = [k1, k2]
    return out


def figures(rec) -> dict:
    """What a plan row shows of an audited record (``predictions.step_time`` and the peak)."""
    pred = rec.predictions.get("step_time")
    if not isinstance(pred, dict):
        why = next((w for w in rec.warnings if "predicted step time" in w), "no prediction")
        raise AuditError(f"the step time could not be predicted: {why}")
    pipe = rec.totals.get("pipeline") if isinstance(rec.totals.get("pipeline"), dict) else {}
    stages = {s["rank"]: s["peak_bytes"] for s in pipe.get("per_stage") or ()}
    # each stage's peak is the largest of its micro-steps' (first, steady, last): each on its
    # own line with depth (extrapolate)
    by_step = {s["rank"]: dict(s.get("peak_by_micro_step") or {"only": s["peak_bytes"]})
               for s in pipe.get("per_stage") or ()}
    by_phase, by_kind = pred.get("by_phase") or {}, pred.get("by_kind") or {}
    return {
        "step_seconds": pred["seconds"], "tokens_per_s_per_gpu": pred["tokens_per_s_per_gpu"],
        "mfu": pred["mfu"], "peak_bytes": int(rec.totals.get("peak_bytes") or 0),
        "peak_rank": int(pipe.get("bounding_rank", 0)) if pipe else 0,
        "stage_peak_bytes": stages, "stage_peak_by_micro_step": by_step,
        "comm_exposed_seconds": pred.get("comm_exposed_seconds") or 0.0,
        "bubble_seconds": pred.get("bubble_seconds") or 0.0,
        "recompute_seconds": by_phase.get("recompute") or 0.0,
        "compute_seconds": sum(by_kind.get(k) or 0.0 for k in ("matmul", "attention", "memory_bound")),
        "launch_seconds": by_kind.get("launch") or 0.0,
        "bound": pred.get("bound"),
        "blocks_traced": None,
    }


def run_chain(path: str, entry: str, gpu: str, gpus: int, chain: list, limit_bytes: float) -> list:
    """Price a chain (see the module docstring): ``chain`` is [(group, depth)] in rising
    micro-batch size, a group the candidates of one micro-batch size (one per schedule). A
    dict per candidate with ``figures`` (None when not priced), ``error`` (the audit's one
    line, or None), ``audits`` (the traces its group ran, on its first row) and ``skipped``:
    once a schedule's candidate does not fit, its larger micro-batches are not traced (the
    smaller one's peak); a group with none left is not traced at all."""
    out, over = [], {}
    for group, depth in chain:
        rows = [{"candidate": c, "figures": None, "error": None, "audits": 0, "skipped": over.get(c.schedule)}
                for c in group]
        out += rows
        live = [r for r in rows if r["skipped"] is None]
        if not live:
            continue
        try:
            figs = price_group(path, entry, gpu, gpus, [r["candidate"] for r in live], depth)
        except AuditError as e:
            for r in live:
                r["error"] = str(e)
            continue
        # one whole trace, or three short ones (and a whole one when they were off the line)
        live[0]["audits"] = 1 if depth is None else len(DEPTHS) + (0 if figs[0]["blocks_traced"] else 1)
        for r, f in zip(live, figs):
            r["figures"] = f
            if f["peak_bytes"] > limit_bytes:
                c = r["candidate"]
                over[c.schedule] = {"micro_batch_size": c.micro_batch_size, "peak_bytes": f["peak_bytes"]}
    return out
