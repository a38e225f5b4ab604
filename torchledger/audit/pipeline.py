"""Pipeline parallelism (``--mesh ...,pp=P [--virtual-stages V] [--micro-batches M]
[--schedule ...]``): each distinct pipeline rank's micro-steps traced, the schedule composed.

PyTorch's own ``PipelineStage`` and schedules do not run on fake tensors (their warm-up p2p
reads values: ``DataDependentOutputException`` in ``_warmup_p2p``), so the step is composed
from what each rank runs, traced on fake tensors under the fake process group:

1. The model's blocks are cut into p x v chunks (:func:`torchledger.formulas.pipeline.chunk_sizes`);
   rank r holds chunks r, r + p, ... (chunk 0 with the embedding, the last with the head).
   Ranks whose chunks have the same shape (same block counts, same ends) are alike: one is
   traced for all (Llama-3.1-405B at pp=9, v=7: 3 distinct ranks of 9).
2. For each distinct rank, in a fake world where it is that rank (its pp coordinate, the
   others 0), the model is built, every block it does not hold (and the embedding / head)
   replaced by ``nn.Identity``, the standard plan applied to what is left (FSDP2 with
   ``reshard_after_forward=False``, TP, CP, checkpointing, precision), AdamW's state made by one
   untraced step, and up to three micro-steps traced, each one micro-batch (the AuditSpec's
   inputs) forward through the rank's chunks and backward in reverse, with the p2p a real
   stage runs as collectives: ``recv`` of the previous chunk's activation and ``send`` of
   the output in forward, ``recv`` of the output's gradient and ``send`` of the input's
   gradient in backward. FSDP2 is driven as PyTorch's ``PipelineStage`` drives it: no
   gradient sync and no reshard until the last micro-batch. The micro-steps traced are the
   first (parameters all-gathered), a steady one (nothing but the micro-batch) and the last
   (gradients reduce-scattered, optimizer step): the step is first + (m - 2) x steady + last.
   An embedding the head shares (GPT-2's wte): the first and last stages each keep a copy,
   whose gradient the last micro-step all-reduces between the two before the optimizer step
   (Megatron-LM's embedding group; :data:`TIED_NOTE`): a row of the "other" phase.
3. Memory: a micro-step's peak holds one micro-batch's activations in each of the rank's v
   chunks; the rank's action list says which chunk-micro-batches the schedule holds at its
   peak (:func:`torchledger.formulas.pipeline.in_flight_bytes`: the first micro-step's up to
   its first backward, before any gradient; the later ones' after it), each chunk's own
   (the head's with its loss's), so the rank's peak is the traced peak plus those beyond one
   a chunk, plus what PyTorch's ``PipelineStage`` keeps outside autograd (``_stage_peak``):
   receive buffers for all m micro-batches, the outputs in flight, and the last stage's
   outputs (logits) of every micro-batch until the step ends.

The record of the audit is the bounding rank's (the largest peak), composed; every rank's
figures are in ``totals.pipeline``::

    {"stages": p, "virtual_stages": v, "micro_batches": m, "schedule": str,
     "bubble_fraction": float, "bounding_rank": int,
     "per_stage": [{"rank": r, "ranks_alike": [...], "chunks": [...], "blocks": int,
                    "flops": {...}, "comm_bytes": {...}, "p2p_bytes": int, "peak_bytes": int,
                    "static_bytes": int, "activation_bytes_per_micro_batch": int,
                    "chunk_activation_bytes": int, "in_flight": int, "traced_peak_bytes": int,
                    "chunk_micro_batch_bytes": {chunk: int}, "live_at_peak": {chunk: int},
                    "extra_activation_bytes": int, "stage_buffer_bytes": {"activations_received":
                    int, "gradients_received": int, "outputs_held": int}}]}

Known limitations: the spec's inputs are one micro-batch; the rank's peak adds whole
chunk-micro-batches to the traced one (the schedule's order of frees inside a micro-step is
not replayed); modules[] rows are the bounding rank's, their FLOPs over all m micro-batches;
ops[] rows are one micro-step's (the last, with the optimizer step); collectives[] rows are the
step's, each with ``micro_steps``, the number of micro-steps that issue it.
"""
from __future__ import annotations

import copy
import functools
import time

from ..units import fmt_bytes
from .errors import raised, where
from .spec import AuditError, as_spec
from ..analyzers.compare import record_predictions
from ..formulas.pipeline import (bubble_fraction, chunk_sizes, in_flight, in_flight_bytes, rank_chunks,
                                 schedule_problem)
from ..parallel.layout import Layout
from ..parallel.plan import cp_inputs, default_optimizer, make_optimizer
from ..record import StepRecord
from ..record.tokens import infer_tokens
from ..render.sarif import spec_location
from .layouts import batch_part, decoder, keep_blocks, kernel_notes, standard_plan, step_kernels
from .loading import AuditRun, device_context, fake_safe_init, load_entry, quiet_torch_logs, stdout_to_stderr
from .world import WorldError, fake_world

__all__ = ["run_pipeline_audit"]


def run_pipeline_audit(path: str, entry: str, world, layout, schedules=None):
    """Trace each distinct pipeline rank and compose the schedule; an ``AuditRun`` whose
    record is the bounding rank's. ``schedules``: compose each of these (same virtual stages)
    from the one trace instead, {schedule: AuditRun} (a rank's micro-steps do not depend on
    the schedule: only which of them are in flight together does)."""
    p, v = layout.size("pp"), layout.virtual_stages
    t0 = time.perf_counter()
    fn = load_entry(path, entry)
    n_blocks, batch = _probe(fn, path, entry, layout)
    try:
        sizes = chunk_sizes(n_blocks, p * v)
    except ValueError as e:
        raise AuditError(f"--mesh {layout.text()} --virtual-stages {v}: {e} (the model has {n_blocks}); "
                     f"use fewer stages or virtual stages") from None
    m = _micro_batches(layout, layout.micro_batch_size or batch, p)
    names = tuple(schedules) if schedules is not None else (layout.schedule_name,)
    for schedule in names:
        problem = schedule_problem(p, v, m, schedule)
        if problem:
            raise AuditError(f"--mesh {layout.text()} --schedule {schedule} at {m} micro-batches: {problem}")
    groups = _trace_groups(path, entry, world, layout, sizes, m)
    runs = {s: _assemble(path, entry, world, layout.replace(schedule=s), groups, m, t0) for s in names}
    return runs if schedules is not None else runs[names[0]]


def _trace_groups(path, entry, world, layout, sizes, m) -> list:
    """[(ranks alike, traced micro-steps, plan notes, meta)]: one traced rank for each group of
    ranks whose chunks have the same shape."""
    p, v = layout.size("pp"), layout.virtual_stages
    last = p * v - 1
    groups = {}
    for r in range(p):
        chunks = rank_chunks(p, v, r)
        shape_key = (0 in chunks, last in chunks, tuple(sizes[c] for c in chunks))
        groups.setdefault(shape_key, []).append(r)
    out = []
    act_dtype = None            # what stage 0 sends: rank 0 (the first group) is traced first
    for alike in groups.values():
        traced, notes, meta = _trace_in_child(path, entry, world, layout, alike[0], sizes, m, act_dtype)
        act_dtype = act_dtype or meta.get("activation_dtype")
        out.append((alike, traced, notes, meta))
    return out


def _assemble(path, entry, world, layout, groups, m, t0):
    """The ``AuditRun`` of ``layout``'s schedule composed from the traced ranks."""
    import os
    n, shape = world
    p, v = layout.size("pp"), layout.virtual_stages
    schedule = layout.schedule_name
    stages, records = [], {}
    for alike, traced, notes, meta in groups:
        r = alike[0]
        stage = _compose(traced, layout, r, m, schedule, meta)
        stage["ranks_alike"] = alike
        stages.append(stage)
        records[r] = (traced, stage, notes, meta)
    stages.sort(key=lambda s: s["rank"])
    bound = max(stages, key=lambda s: (s["peak_bytes"], -s["rank"]))
    pipeline = {
        "stages": p, "virtual_stages": v, "micro_batches": m, "schedule": schedule,
        "bubble_fraction": bubble_fraction(p, v, m, schedule), "bounding_rank": bound["rank"],
        "ranks_traced": len(stages), "seconds": round(time.perf_counter() - t0, 3),
        "per_stage": stages}
    # every distinct stage composed: the step time is priced on each (the slowest sets it)
    composed = {}
    for r, (traced_r, stage_r, _, _) in records.items():
        composed[r] = _composed_record(traced_r, stage_r, m, dict(layout.dims))
        composed[r].totals.update(pipeline=pipeline, parallel_dims=dict(layout.dims))
    rec = composed[bound["rank"]]
    meta = records[bound["rank"]][3]
    per_rank = n // p
    for r, stage_rec in composed.items():       # each stage's record says what ran (its pricing reads it)
        stage_rec.meta["audit"] = {
            "file": os.path.relpath(path), "entry": entry, "device": "fake", "steps": 1,
            "seq_len": meta["seq_len"], "spec_line": spec_location(path, entry)[1],
            "loss": "the last chunk's cross-entropy (pipeline stage)",
            "world_size": n, "mesh": list(shape), "rank": r * per_rank,
            "mesh_dims": list(layout.names), "plan": records[r][2], "precision": layout.precision,
            "kernels": layout.kernels}
        stage_rec.totals.update(rank=r * per_rank, world_size=n, mesh=list(shape))
        stage_rec.meta["device"] = "fake (cpu)"
    run = AuditRun([rec], None, "fake", path)
    run.snapshot, run.untraced_seconds = None, []
    run.stage_records = composed
    return run


def _probe(fn, path, entry, layout):
    """(blocks, batch) of the spec's model, built on the meta device (no world, no memory)."""
    import torch
    try:
        with torch.device("meta"):
            spec = as_spec(fn())
    except Exception as e:
        raise AuditError(f"{where(e, path)}: {entry}() {raised(e)}") from None
    dec = decoder(spec.model, layout, path)
    if dec is not None:
        keep_blocks(spec.model, layout, path)       # the same blocks list dec holds
    if dec is None:
        raise AuditError(f"{path}: pp: pipeline stages are cut by blocks of decoders the standard plan "
                     f"recognises (torchledger's models, Hugging Face Llama/Mistral/Qwen2, "
                     f"Mixtral/Qwen2-MoE/Qwen3-MoE/GPT-OSS/DeepSeek-V2/V3), not "
                     f"{type(spec.model).__name__}; drop pp from --mesh")
    seq = infer_tokens(spec.inputs)
    batch = (seq.tokens // seq.seq_len) if seq.tokens and seq.seq_len else 1
    return len(dec.blocks), batch


def _micro_batches(layout, batch: int, p: int) -> int:
    if layout.micro_batches is not None:
        return layout.micro_batches
    if layout.global_batch is not None:
        per = layout.dp_degree * batch
        if layout.global_batch % per:
            raise AuditError(f"--global-batch {layout.global_batch}: not a multiple of dp x the spec's batch "
                         f"({layout.dp_degree} x {batch} = {per}); the spec's inputs are one micro-batch")
        return layout.global_batch // per
    return p


# -- one rank --------------------------------------------------------------------------------
#: How each distinct rank is traced in its own process: ``spawn`` a fresh Python (the audit's
#: default: nothing of the caller's process is shared), or ``fork`` the caller (no second
#: import of torch and the model file's modules: ``torchledger plan`` sets it in its own forked
#: children, whose process has made no world yet). POSIX only for ``fork``.
RANK_PROCESS = {"start": "spawn"}


def _trace_in_child(path, entry, world, layout, r, sizes, m, act_dtype=None):
    """``_trace_rank`` in a process of its own: each rank is its own fake world, and DTensor
    keeps caches keyed by meshes that compare equal across worlds (a second world in the same
    process would be handed the first one's process groups)."""
    import dataclasses
    import json
    import os
    import tempfile
    args = {"path": os.path.abspath(path), "entry": entry, "world": [world[0], list(world[1])],
            "layout": {k: (list(map(list, v)) if k == "dims" else v)
                       for k, v in dataclasses.asdict(layout).items()},
            "rank": r, "sizes": list(sizes), "m": m, "act_dtype": act_dtype}
    with tempfile.TemporaryDirectory(prefix="torchledger-pp-") as tmp:
        out = os.path.join(tmp, "out.json")
        run = _forked if RANK_PROCESS["start"] == "fork" else _spawned
        code, tail = run(args, out)
        if not os.path.exists(out):
            raise AuditError(f"{path}: tracing pipeline rank {r} failed (exit {code}): {tail}")
        with open(out, encoding="utf-8") as f:
            data = json.load(f)
    if "error" in data:
        raise AuditError(data["error"])
    traced = {k: StepRecord.from_dict(v) for k, v in data["records"].items()}
    for rec in traced.values():         # the p2p torchledger's stage runner issues: no user line
        for c in rec.collectives:
            if str(c.get("location") or "").startswith("<string>"):
                c["location"] = None
    return traced, data["notes"], data["meta"]


def _spawned(args, out):
    """A fresh Python runs :func:`_child`; (exit code, its last stderr line)."""
    import json
    import os
    import subprocess
    import sys
    code = "from torchledger.audit.pipeline import _child; _child()"
    env = dict(os.environ)
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([here] + [x for x in [env.get("PYTHONPATH")] if x])
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(args), out], env=env,
                          capture_output=True, text=True, cwd=os.getcwd())
    if os.environ.get("TORCHLEDGER_DEBUG") == "1" and proc.stderr:
        sys.stderr.write(proc.stderr)
    return proc.returncode, " ".join((proc.stderr or "").strip().splitlines()[-1:])[:300]


def _forked(args, out):
    """A fork of this process runs :func:`_trace_to_file`; (exit code, "")."""
    import os
    import sys
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:                    # the child: trace, write, leave without the parent's clean-up
        code = 1
        try:
            _trace_to_file(args, out)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), "the forked tracer died"


def _child() -> None:
    """The child process of :func:`_trace_in_child`: trace one rank, write JSON."""
    import json
    import sys
    _trace_to_file(json.loads(sys.argv[1]), sys.argv[2])


def _trace_to_file(args, out) -> None:
    import json
    lay = dict(args["layout"])
    lay["dims"] = tuple(tuple(d) for d in lay["dims"])
    layout = Layout(**lay)
    n, shape = args["world"]
    r = args["rank"]
    per_rank = n // layout.size("pp")
    try:
        with stdout_to_stderr(), quiet_torch_logs(True):
            fn = load_entry(args["path"], args["entry"])
            with fake_world(n, tuple(shape), rank=r * per_rank, names=layout.names) as mesh:
                traced, notes, meta = _trace_rank(fn, args["path"], args["entry"], layout, mesh, r,
                                                  args["sizes"], args["m"], args.get("act_dtype"))
        data = {"records": {k: v.to_dict() for k, v in traced.items()}, "notes": notes, "meta": meta}
    except (AuditError, WorldError) as e:
        data = {"error": str(e)}
    with open(out, "w", encoding="utf-8") as f:
        json.dump(data, f)


def _trace_rank(fn, path, entry, layout, mesh, r, sizes, m, act_dtype=None):
    """Build, prune, plan and trace rank ``r``'s micro-steps; (records by kind, notes, meta)."""
    from ..ledger import Ledger
    p, v = layout.size("pp"), layout.virtual_stages
    chunks = rank_chunks(p, v, r)
    starts = [sum(sizes[:c]) for c in range(len(sizes))]
    blocks = {c: list(range(starts[c], starts[c] + sizes[c])) for c in chunks}
    keep = {i for c in chunks for i in blocks[c]}
    last = p * v - 1
    pp_ranks = [int(x) for x in mesh["pp"].mesh.tolist()]
    with device_context("fake"):
        try:
            with fake_safe_init("fake"):
                spec = as_spec(fn())
        except Exception as e:
            raise AuditError(f"{where(e, path)}: {entry}() {raised(e)}") from None
        model = spec.model
        keep_blocks(model, layout, path)
        dec = decoder(model, layout, path)
        inputs = batch_part(spec.inputs, spec, layout)        # --micro-batch-size
        seq = infer_tokens(inputs)
        tied = tied_weight(model, dec, has_first=0 in chunks, has_last=last in chunks)
        _prune(model, dec, keep, has_first=0 in chunks, has_last=last in chunks)
        if spec.parallelize is not None:
            model = spec.parallelize(model, mesh)
            notes = ["AuditSpec.parallelize on each stage's model"]
        else:
            model, notes = standard_plan(model, mesh, layout, path, seq.seq_len, blocks=keep, pipelined=True)
        if layout.size("cp") > 1:
            inputs = cp_inputs(inputs, layout.size("cp"), mesh["cp"].get_local_rank(), seq.seq_len)
        opt = make_optimizer(spec.optimizer or default_optimizer(layout), model, layout)
        runner = _StageRunner(model, dec, inputs, chunks, blocks, last, pp_ranks, mesh["pp"].get_group(),
                              layout, spec, _dtype_named(act_dtype))
        if tied:
            runner.tie(tied, [pp_ranks[0], pp_ranks[-1]])
            notes.append(TIED_NOTE)
        _warm_optimizer(model, opt)
        kinds = ["only"] if m == 1 else ["first", "last"] if m == 2 else ["first", "steady", "last"]
        ledger = Ledger(model, optimizer=opt, keep=len(kinds))
        tokens = infer_tokens(inputs)
        traced, applied = {}, {}
        for kind in kinds:
            _fsdp_flags(model, last_micro_batch=kind in ("only", "last"))
            try:
                with step_kernels(layout, applied), \
                        ledger.step(tokens=tokens.tokens, seq_len=tokens.seq_len, tokens_source=tokens.source):
                    runner.micro_step(optimizer=opt if kind in ("only", "last") else None)
            except Exception as e:
                raise AuditError(f"{where(e, path)}: pipeline rank {r}'s micro-step raised "
                             f"{type(e).__name__}: {_msg(e)}") from None
            traced[kind] = ledger.records[-1]
            # the world this rank sits in (the tracer sees the mesh FSDP2 was given)
            traced[kind].totals.update(rank=int(mesh.get_rank()), world_size=int(mesh.size()),
                                       mesh=list(mesh.shape))
    notes = [*notes, *kernel_notes(applied)]
    block_names = [f"{dec.prefix}.{i}" for i in sorted(keep)]
    # the rank's own sequence length (a cp-th of the spec's under context parallelism), as
    # an audit without pp records it
    meta = {"rank": r, "chunks": chunks, "blocks": len(keep), "block_names": block_names,
            "chunk_blocks": {str(c): [f"{dec.prefix}.{i}" for i in blocks[c]] for c in chunks},
            "seq_len": tokens.seq_len, "activation_dtype": _dtype_name(runner.act_dtype),
            "sent_dtypes": sorted(_dtype_name(d) for d in runner.sent_dtypes),
            "recv_bytes": {str(c): n for c, n in runner.recv_bytes.items()},
            "grad_recv_bytes": {str(c): n for c, n in runner.grad_recv_bytes.items()},
            "output_bytes": runner.output_bytes, "tied_weight": tied, "tied_grad_bytes": runner.tied_bytes}
    return traced, notes, meta


def _msg(e):
    text = " ".join(str(e).split())
    return text if len(text) <= 300 else text[:297] + "..."


def _prune(model, dec, keep, has_first: bool, has_last: bool) -> None:
    """Blocks this rank does not hold, and the embedding / final norm / head unless it holds
    the first / last chunk, become ``nn.Identity`` (their FQNs stay those of the model)."""
    import torch.nn as nn
    for i in range(len(dec.blocks)):
        if i not in keep:
            dec.blocks[i] = nn.Identity()
    drop = ([] if has_first else [dec.embed]) + ([] if has_last else [dec.norm, dec.head])
    if dec.family == "torchledger" and not has_first and getattr(model, "pos_emb", None) is not None:
        drop.append("pos_emb")
    for fqn in drop:
        parent, _, name = fqn.rpartition(".")
        setattr(dec.module(model, parent), name, nn.Identity())


#: What the stage runner does with an embedding the first and last stages share (GPT-2's wte
#: and lm_head): each stage keeps its own copy and its own gradient; Megatron-LM all-reduces
#: that gradient between the two after the backward (``finalize_model_grads`` ->
#: ``_allreduce_word_embedding_grads``, over its embedding group), so the copies stay equal.
#: PyTorch's ``torch.distributed.pipelining`` does not (``_IR.py``: "investigate gradient sync
#: for shared parameters" is a TODO; a manually split model holds two unrelated parameters):
#: without that all-reduce in the training loop the two copies diverge from the first step.
TIED_NOTE = ("tied embedding under pp: the first and last stages each hold the shared weight; its "
             "gradient is all-reduced between them once a step, after the last micro-batch's backward "
             "(Megatron-LM's embedding-group all-reduce; torch.distributed.pipelining does not do it: "
             "without it in the training loop the two copies diverge)")


def tied_weight(model, dec, has_first: bool, has_last: bool):
    """The FQN of this stage's copy of an embedding the head shares (the embedding's on the
    first stage, the head's on the last), or None: untied, or the stage holds neither end."""
    try:
        embed = dec.module(model, dec.embed).weight
        head = dec.module(model, dec.head).weight
    except AttributeError:
        return None
    if embed is not head or has_first == has_last:
        return None
    return f"{dec.embed}.weight" if has_first else f"{dec.head}.weight"


def _warm_optimizer(model, opt) -> None:
    """AdamW's state as every step after the first holds it: one untraced optimizer step
    on zero gradients (fake tensors: no values, no memory)."""
    import torch
    params = [q for q in model.parameters() if q.requires_grad]
    for q in params:
        q.grad = torch.zeros_like(q)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _fsdp_flags(model, last_micro_batch: bool) -> None:
    """As ``PipelineStage`` drives FSDP2: sync and reshard only on the last micro-batch."""
    for name in ("set_is_last_backward", "set_requires_gradient_sync", "set_reshard_after_backward"):
        method = getattr(model, name, None)
        if method is not None:
            method(last_micro_batch)


class _StageRunner:
    """One micro-batch forward through a rank's chunks and backward in reverse, with the p2p
    of a pipeline stage issued through ``torch.distributed`` (the fake group records them)."""

    def __init__(self, model, dec, inputs, chunks, blocks, last, pp_ranks, group, layout, spec,
                 act_dtype=None):
        self.model, self.dec, self.inputs = model, dec, inputs
        self.chunks, self.blocks, self.last = chunks, blocks, last
        self.pp_ranks, self.group, self.spec = pp_ranks, group, spec
        self.p = layout.size("pp")
        idx = self._ids()
        self.B, self.T = idx.shape[0], idx.shape[1]
        d = _width(model, dec)
        tp = layout.size("tp")
        t_local = self.T // tp if dec.sequence_parallel and tp > 1 else self.T
        self.act_shape = (self.B, t_local, d)
        # the dtype of what flows between stages is what chunk 0 sends (fp32 under autocast
        # on fp32 weights: the residual stream adds fp32 embeddings to 16-bit outputs; the
        # compute dtype under FSDP2's MixedPrecisionPolicy): given by the rank-0 trace to the
        # other ranks, taken from chunk 0's output on rank 0 (it runs before any receive)
        self.act_dtype = act_dtype
        self.sent_dtypes = set()
        self.original_forward = model.forward
        # what a PipelineStage keeps per micro-batch beside autograd's saved tensors: a receive
        # buffer of the activation for each chunk but the first, one of its gradient for each
        # chunk but the last (bytes of one, by chunk), and the last chunk's output (its
        # ``output_chunks``: the logits, held until the next step starts)
        self.recv_bytes, self.grad_recv_bytes, self.output_bytes = {}, {}, 0
        self.outputs = []
        # Megatron's schedule (--kernels te) keeps each micro-batch's loss, not its logits
        self.megatron = layout.megatron
        self.tied, self.tied_ranks, self.tied_bytes = None, None, 0

    def tie(self, fqn: str, ranks: list) -> None:
        """Sync the gradient of parameter ``fqn`` (a tied embedding's copy) with the other
        end's stage (global ``ranks``) after the last micro-batch's backward."""
        import torch.distributed as dist
        self.tied, self.tied_ranks = fqn, ranks
        self.tied_group = dist.new_group(ranks)

    def _sync_tied(self) -> None:
        """Megatron-LM's embedding-group all-reduce of the tied weight's gradient (this
        rank's shard of it under FSDP2 / TP: both ends hold the same shards)."""
        import torch.distributed as dist
        grad = self.model.get_parameter(self.tied).grad
        if grad is None:
            return
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        self.tied_bytes = local.numel() * local.element_size()
        dist.all_reduce(local, group=self.tied_group)

    def _ids(self):
        x = self.inputs
        if isinstance(x, dict):
            return x.get("idx", x.get("input_ids"))
        return x[0] if isinstance(x, (list, tuple)) else x

    def _targets(self, idx):
        x = self.inputs
        if isinstance(x, dict):
            for k in ("targets", "labels"):
                if x.get(k) is not None:
                    return x[k]
        return idx

    def micro_step(self, optimizer=None) -> None:
        import torch
        handles = []
        for c in self.chunks:
            self.model.forward = functools.partial(self._chunk_forward, c)
            try:
                handles.append(self.model())
            finally:
                self.model.forward = self.original_forward
        # one backward over the rank's chunks (last first), as FSDP2 sees one backward per
        # micro-batch: its end-of-backward callback (reshard, reduce) runs once
        torch.autograd.backward(handles[::-1])
        if optimizer is not None and self.tied:
            self._sync_tied()
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        self.outputs.clear()        # the stage's outputs live through the step's optimizer step

    def _chunk_forward(self, c):
        import torch
        import torch.distributed as dist
        model, dec = self.model, self.dec
        if c == 0:
            x = self._embed()
        else:
            buf = torch.empty(self.act_shape, dtype=self.act_dtype or _param_dtype(model))
            self.recv_bytes[c] = buf.numel() * buf.element_size()
            dist.recv(buf, src=self.pp_ranks[(c - 1) % self.p], group=self.group)
            buf.requires_grad_()
            x = _SendGradBack.apply(buf, self.pp_ranks[(c - 1) % self.p], self.group)
        extra = self._block_args(x)
        for i in self.blocks[c]:
            out = dec.blocks[i](x, *extra[0], **extra[1])
            x = out[0] if isinstance(out, tuple) else out
        if c == self.last:
            return self._loss(x)
        if self.act_dtype is None:
            self.act_dtype = x.dtype
        self.sent_dtypes.add(x.dtype)
        self.grad_recv_bytes[c] = x.numel() * x.element_size()
        dist.send(x, dst=self.pp_ranks[(c + 1) % self.p], group=self.group)
        return _RecvGrad.apply(x, self.pp_ranks[(c + 1) % self.p], self.group)

    def _embed(self):
        import torch
        model, dec = self.model, self.dec
        idx = self._ids()
        x = dec.module(model, dec.embed)(idx)
        if dec.family == "torchledger" and getattr(model, "pos_emb", None) is not None:
            x = x + model.pos_emb(torch.arange(idx.shape[1], device=idx.device))
        return x

    def _block_args(self, x):
        import torch
        model, dec = self.model, self.dec
        if dec.family == "torchledger":
            if getattr(model, "pos_emb", None) is not None or model.config.n_positions:
                return (None,), {}
            from ..models.transformer import rope_tables
            cfg = model.config
            return (rope_tables(self.T, cfg.head_dim, cfg.rope_theta, x.device, x.dtype),), {}
        pos = torch.arange(self.T, device=x.device)[None]
        probe = torch.empty(self.B, self.T, 1, dtype=x.dtype)
        return (), {"position_embeddings": model.model.rotary_emb(probe, pos), "position_ids": pos}

    def _loss(self, x):
        import torch.nn.functional as F
        model, dec = self.model, self.dec
        from ..tracer.memory import tensor_bytes
        logits = dec.module(model, dec.head)(dec.module(model, dec.norm)(x))
        if not self.megatron:
            self.outputs.append(logits)     # PipelineStage's output_chunks
            self.output_bytes = tensor_bytes(logits)
        idx = self._ids()
        targets = self._targets(idx)
        flat = logits.reshape(-1, logits.shape[-1])
        # Megatron's loss (--kernels te, patched in while the step runs) makes its own fp32 copy
        return F.cross_entropy(flat if self.megatron else flat.float(), targets.reshape(-1))


def _dtype_name(dtype):
    """``torch.bfloat16`` -> "bfloat16" (None stays None)."""
    return None if dtype is None else str(dtype).replace("torch.", "")


def _dtype_named(name):
    """"bfloat16" -> ``torch.bfloat16`` (None stays None)."""
    import torch
    return None if name is None else getattr(torch, name)


def _param_dtype(model):
    """The dtype of the model's first floating parameter (the default dtype without one)."""
    import torch
    for q in model.parameters():
        if q.is_floating_point():
            return q.dtype
    return torch.get_default_dtype()


def _width(model, dec) -> int:
    if dec.family == "torchledger":
        return model.config.d_model
    return model.config.hidden_size


def _autograd_functions():
    import torch
    import torch.distributed as dist

    class SendGradBack(torch.autograd.Function):
        """Identity forward on a received activation; backward sends its gradient back."""

        @staticmethod
        def forward(ctx, x, peer, group):
            ctx.peer, ctx.group = peer, group
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            dist.send(grad.contiguous(), dst=ctx.peer, group=ctx.group)
            return grad, None, None

    class RecvGrad(torch.autograd.Function):
        """A scalar handle for a chunk's sent output; its backward receives the output's
        gradient from the next stage and passes it into the chunk."""

        @staticmethod
        def forward(ctx, x, peer, group):
            ctx.peer, ctx.group, ctx.shape, ctx.dtype = peer, group, x.shape, x.dtype
            return x.new_zeros(())

        @staticmethod
        def backward(ctx, grad):
            buf = torch.empty(ctx.shape, dtype=ctx.dtype)
            dist.recv(buf, src=ctx.peer, group=ctx.group)
            return buf, None, None
    return SendGradBack, RecvGrad


class _Lazy:
    def __init__(self, i):
        self.i = i

    def apply(self, *args):
        return _autograd_functions()[self.i].apply(*args)


_SendGradBack, _RecvGrad = _Lazy(0), _Lazy(1)


# -- composing the schedule ---------------------------------------------------------------------
def _weights(m: int) -> dict:
    return {"only": 1} if m == 1 else {"first": 1, "last": 1} if m == 2 else {"first": 1, "steady": m - 2, "last": 1}


def _compose(traced, layout, r, m, schedule, meta) -> dict:
    """Rank ``r``'s step: the weighted sum of its micro-steps, and its peak under the schedule."""
    p, v = layout.size("pp"), layout.virtual_stages
    w = _weights(m)
    flops = {"forward": 0, "backward": 0, "optimizer": 0}
    comm = {"forward": 0, "backward": 0, "optimizer": 0, "other": 0}
    p2p = 0
    for kind, rec in traced.items():
        f = rec.totals["flops"]
        flops["forward"] += w[kind] * f.get("forward", 0)
        flops["backward"] += w[kind] * f.get("backward", 0)
        flops["optimizer"] += w[kind] * f.get("optimizer", 0)
        for phase in comm:
            comm[phase] += w[kind] * rec.totals["comm_bytes"].get(phase, 0)
        p2p += w[kind] * sum(c["bytes"] + c.get("bytes_received", 0) for c in rec.collectives
                             if c["op"] in ("send", "recv"))
    flops["total"] = flops["forward"] + flops["backward"] + flops["optimizer"]
    comm["total"] = sum(comm[k] for k in ("forward", "backward", "optimizer", "other"))
    steady = traced.get("steady") or traced.get("first") or traced["only"]
    names = set(meta["block_names"])
    block_act = sum(row["activation_bytes"] for row in steady.modules if row["name"] in names)
    chunk_act = block_act // v
    held = in_flight(p, v, m, r, schedule)
    first = traced.get("first") or traced["only"]
    sharded = first.totals.get("param_bytes") or 0
    last = traced.get("last") or traced["only"]
    # parameters and optimizer state as the step starts (sharded), gradients as the rank
    # holds them during the step (accumulated unsharded until the last micro-batch's reduce)
    static = sharded + (last.totals.get("grad_bytes") or 0) + (first.totals.get("optimizer_state_bytes") or 0)
    stage = {"rank": r, "chunks": meta["chunks"], "blocks": meta["blocks"], "flops": flops,
             "embedding": 0 in meta["chunks"], "head": p * v - 1 in meta["chunks"],
             "comm_bytes": comm, "p2p_bytes": p2p, "static_bytes": static,
             "activation_bytes_per_micro_batch": steady.totals["activation_bytes"],
             "chunk_activation_bytes": chunk_act, "in_flight": held}
    stage.update(_stage_peak(traced, meta, layout, r, m, schedule, sharded))
    return stage


def _chunk_activations(steady, meta, last_chunk: int) -> dict:
    """One micro-batch's activation bytes in each of the rank's chunks: its blocks' rows, and
    what the rank saves outside its blocks (the embedding's; the final norm's, the head's and
    the loss's) in the chunk at the model's end it holds (spread over its chunks if neither)."""
    rows = {row["name"]: row["activation_bytes"] for row in steady.modules}
    per = {int(c): sum(rows.get(n, 0) for n in names) for c, names in meta["chunk_blocks"].items()}
    rest = max(0, steady.totals["activation_bytes"] - sum(per.values()))
    ends = [c for c in per if c in (0, last_chunk)]
    if ends:
        per[ends[0]] += rest
    else:
        for k, c in enumerate(sorted(per)):
            per[c] += rest // len(per) + (1 if k < rest % len(per) else 0)
    return per


def _stage_peak(traced, meta, layout, r, m, schedule, sharded) -> dict:
    """Rank ``r``'s peak under the schedule: each traced micro-step's peak (one micro-batch in
    each chunk, its own output held), plus what the schedule holds beside it when that
    micro-step peaks, from the rank's action list (:func:`in_flight_bytes`): the first
    micro-step's (no gradients yet) up to and through the rank's first backward, the later
    ones' after it. Beside it: the other chunk-micro-batches in flight (each chunk's own
    activations: the head's chunk keeps its loss's too, GPipe m of them), and what PyTorch's
    ``PipelineStage`` keeps: the last chunk's output of every micro-batch run so far
    (``output_chunks``, until the next step; none under ``--kernels te``: Megatron's schedule
    keeps each micro-batch's loss, its logits freed once the loss is computed, and
    ``meta["output_bytes"]`` is 0), the other chunks' outputs in flight (its
    ``fwd_cache``, until their backward), and m receive buffers of the activation per
    chunk but the first (allocated once, for every micro-batch; those in flight are their
    first block's saved input, in the activations already) and m of the output's gradient per
    chunk but the last (the traced micro-step receives its own). Under ``--kernels te``
    Megatron's: a buffer made per receive (none beyond those in flight) and each output freed
    once sent."""
    p, v = layout.size("pp"), layout.virtual_stages
    last_chunk = p * v - 1
    steady = traced.get("steady") or traced.get("first") or traced["only"]
    per_chunk = _chunk_activations(steady, meta, last_chunk)
    out = (meta.get("output_bytes") or 0) if last_chunk in per_chunk else 0
    # Megatron's p2p (--kernels te) receives each micro-batch into a buffer made for it
    # (``p2p_communication._communicate``: torch.empty per call), consumed by its forward or
    # backward: no receive buffers beyond those in flight, which the activations hold already
    megatron = layout.megatron
    grad_buffers = 0 if megatron else sum((m - 1) * n for n in meta["grad_recv_bytes"].values())
    # a chunk's sent output stays in the stage's fwd_cache until its backward: held as long
    # as the micro-batch's activations, though autograd does not save it. Megatron frees it
    # once sent (``deallocate_output_tensor``: its .data made a scalar; Megatron-LM and NeMo
    # set ``deallocate_pipeline_outputs``)
    sent = {} if megatron else {int(c): n for c, n in meta["grad_recv_bytes"].items()}
    held = {c: n + sent.get(c, 0) for c, n in per_chunk.items()}
    best, by_kind = None, {}
    for kind, rec in traced.items():
        peak, extra_params = rec.totals["peak_bytes"], 0
        if (rec.totals.get("param_bytes") or 0) > sharded:
            # NB: parameters FSDP2 keeps gathered across micro-batches are the module's
            # parameters then; the sharded ones (the first micro-step's) are alive beside them
            extra_params = sharded
        _, live, runs = in_flight_bytes(p, v, m, r, schedule, held, {last_chunk: out},
                                        since_backward=kind in ("steady", "last"))
        extra_act = sum((live.get(c, 0) - 1) * n for c, n in per_chunk.items())
        buffers = {"activations_received": 0 if megatron else sum(max(0, m - live.get(int(c), 0)) * n
                                                                  for c, n in meta["recv_bytes"].items()),
                   "gradients_received": grad_buffers,
                   "outputs_held": max(0, runs.get(last_chunk, 0) - 1) * out +
                   sum(live.get(c, 0) * n for c, n in sent.items())}
        total = peak + extra_params + max(0, extra_act) + sum(buffers.values())
        by_kind[kind] = total
        if best is None or total > best[0]:
            best = (total, kind, extra_params, max(0, extra_act), buffers, live, peak + extra_params)
    total, kind, extra_params, extra_act, buffers, live, traced_peak = best
    return {"traced_peak_bytes": traced_peak, "peak_bytes": total, "peak_micro_step": kind,
            "peak_by_micro_step": by_kind,
            "chunk_micro_batch_bytes": {str(c): n for c, n in per_chunk.items()},
            "live_at_peak": {str(c): n for c, n in live.items()}, "extra_activation_bytes": extra_act,
            "stage_buffer_bytes": buffers, "micro_steps_traced": list(traced),
            "peak_sharded_param_bytes": extra_params}


#: Totals that add up over micro-steps (ints, or dicts of ints per phase/kind).
ADDITIVE = ("flops", "flops_causal", "attention_flops", "hardware_flops", "elementwise_flops",
            "bytes_read", "bytes_written", "copy_bytes", "param_matmul_flops_forward",
            "param_matmul_flops_grad", "tokens", "view_ops", "comm_bytes")


def _composed_record(traced, stage, m, dims):
    """The bounding rank's record: its last micro-step's, with the step's totals; ``dims`` the
    layout's ({"pp": 9, "cp": 2, ...}), which its references read."""
    w = _weights(m)
    last = traced.get("last") or traced["only"]
    rec = copy.deepcopy(last)
    t = rec.totals
    t["parallel_dims"] = dims
    if dims.get("cp", 1) > 1:            # every rank's inputs cut to T/cp (cp_inputs)
        t["context_parallel"] = dims["cp"]
    _sum_micro_steps(t, traced, w)
    _compose_peak(rec, traced, stage, last)
    first = traced.get("first") or traced["only"]
    # the static figures as the step starts (the first micro-step's): in the later ones FSDP2
    # keeps the parameters gathered, so model.parameters() are the unsharded tensors, and the
    # optimizer's sharded fp32 parameters, not among them, would read as master weights
    for key in ("param_bytes", "trainable_param_bytes", "optimizer_state_bytes"):
        t[key] = first.totals.get(key, t.get(key))
    if first.optimizer:
        rec.optimizer = copy.deepcopy(first.optimizer)
    t["activation_bytes"] = stage["activation_bytes_per_micro_batch"] + stage["extra_activation_bytes"]
    cfg = rec.meta.get("config")
    if isinstance(cfg, dict) and "n_layers" in cfg:
        # the closed forms of this rank: its blocks (attention 12LTd, Korthikanti per layer)
        # what the stage holds (the parameter rows count its ends only), and the layers of one
        # micro-batch's activations it keeps at its peak (Korthikanti's row per layer): its
        # blocks, plus the schedule's extra chunk-micro-batches of blocks / v layers each
        extra = max(0, stage["in_flight"] - len(stage["chunks"]))
        rec.meta["config"] = dict(cfg, n_layers=stage["blocks"], pipeline_stage=True,
                                  stage_embedding=stage["embedding"], stage_head=stage["head"],
                                  stage_micro_batches=m,
                                  stage_layers_in_flight=stage["blocks"] + extra * stage["blocks"] / len(stage["chunks"]))
    rec.predictions = record_predictions(rec)
    rec.collectives = _composed_collectives(traced, w)
    # the rank's own modules: the placeholders of what other ranks hold are not its rows
    rec.modules = [row for row in rec.modules if not (row.get("type") == "Identity" and not row.get("params"))]
    for row in rec.modules:
        for k in ("flops_forward", "flops_backward", "flops_recompute"):
            if isinstance(row.get(k), int):
                row[k] *= m
    rec.meta["pipeline_note"] = (
        f"pipeline: composed from {len(traced)} traced micro-steps ({', '.join(traced)}) of rank "
        f"{stage['rank']}: the step is first + (m - 2) x steady + last at m = {m}; its peak adds "
        f"{max(0, stage['in_flight'] - len(stage['chunks']))} chunk-micro-batches of activations to the traced one "
        f"and the stage's buffers (PipelineStage's receive buffers for all m micro-batches, the last "
        f"stage's outputs held until the step ends): {fmt_bytes(sum(stage['stage_buffer_bytes'].values()))}")
    return rec


def _sum_micro_steps(t: dict, traced, w) -> None:
    """The ADDITIVE totals into ``t``: each traced micro-step's times its weight ``w[kind]``
    (how many of the m micro-steps it stands for)."""
    for key in ADDITIVE:
        values = [r.totals.get(key) for r in traced.values()]
        if all(isinstance(x, int) and not isinstance(x, bool) for x in values):
            t[key] = sum(w[k] * r.totals[key] for k, r in traced.items())
        elif all(isinstance(x, dict) for x in values):
            t[key] = {sub: sum(w[k] * (r.totals[key].get(sub) or 0) for k, r in traced.items())
                      for sub in values[-1]}


def _compose_peak(rec, traced, stage, last) -> None:
    """The stage's peak into ``rec``: its bytes, and its categories (which add up to it)."""
    t = rec.totals
    t["peak_bytes"] = stage["peak_bytes"]
    # the peak's categories add up to it: the micro-step that peaked, the sharded parameters
    # alive beside the gathered ones, the schedule's extra chunk-micro-batches as activations
    src = traced.get(stage.get("peak_micro_step")) or last
    breakdown = dict((src.memory or {}).get("peak_breakdown") or {})
    if breakdown:
        breakdown["parameters"] = breakdown.get("parameters", 0) + stage.get("peak_sharded_param_bytes", 0)
        breakdown["activations"] = breakdown.get("activations", 0) + stage["extra_activation_bytes"]
        # the stage's receive buffers and held outputs: not autograd's, the stage's own
        breakdown["temporaries"] = breakdown.get("temporaries", 0) + sum(stage["stage_buffer_bytes"].values())
        rec.memory["peak_breakdown"] = breakdown
        rec.memory["peak_bytes"] = stage["peak_bytes"]
        for key in ("peak_phase", "peak_module"):
            t[key] = src.totals.get(key, t.get(key))


_COLLECTIVE_KEY = ("op", "group_size", "phase", "module", "location", "group_span")


def _composed_collectives(traced, w) -> list:
    """The traced micro-steps' collectives, each times its weight, merged by (op, group, phase,
    module, location, span); most bytes first."""
    rows = {}
    for kind, r in traced.items():
        for c in r.collectives:
            key = tuple(c.get(k) for k in _COLLECTIVE_KEY)
            row = rows.setdefault(key, dict(c, count=0, bytes=0, bytes_received=0, algo_bytes=0, bus_bytes=0,
                                            micro_steps=0))
            for k in ("count", "bytes", "bytes_received", "algo_bytes", "bus_bytes"):
                row[k] += w[kind] * (c.get(k) or 0)
        for key in {tuple(c.get(k) for k in _COLLECTIVE_KEY) for c in r.collectives}:
            # how many of the m micro-steps issue this row (m: every one; 1: FSDP2's gathers
            # in the first, its reductions in the last): the step-time prediction's schedule
            rows[key]["micro_steps"] += w[kind]
    return sorted(rows.values(), key=lambda c: -c["bytes"] - c["bytes_received"])
