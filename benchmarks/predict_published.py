"""Predict the step time of the published, measured runs in ../shared/calibration-runs.json
(a check of the step-time model, never a fit: no constant here is taken from these runs).

    PYTHONPATH=$PWD python benchmarks/predict_published.py [--runs PATH] [--json]

Each run's model is built from torchledger's presets (or the hyperparameters the file gives),
traced on fake tensors at the run's per-GPU layout under a simulated world (``run_audit``
with ``world_size``/``mesh``), and priced with ``analyzers.steptime`` on the run's part.
Layouts torchledger cannot build yet (sequence parallelism, context parallelism: the layouts
issue, i22-plan) are approximated as printed beside each row:

* kor-22b-tp8: TP 8 (Megatron column/row split) without sequence parallelism: the norms and
  dropout-free elementwise ops run on the whole sequence on every rank (SP would split them 8
  ways), and the all-reduces stand for SP's all-gather + reduce-scatter (the same bytes).
  fp16 mixed precision as fp16 weights (the fp32 master copy's optimizer traffic is not
  priced). Selective recompute (Korthikanti: only the attention core) is a no-op with a
  fused attention kernel: traced without recompute.
* tt-l3-8b-a100-64: FSDP2 over 64 ranks, bf16 parameters for compute (MixedPrecisionPolicy),
  fp32 reductions; selective-op AC (torchtitan: every second matmul recomputed) traced as
  selective activation checkpointing with that policy.
* dgxc-l31-8b-h100-8: NeMo runs Transformer Engine's fused kernels (RMSNorm, RoPE, SwiGLU,
  cross-entropy): priced as ``--compiled`` (elementwise chains fused), a fact of the framework,
  not a fit. CP 2 x DP 4 needs context parallelism. Approximated as 8 data-parallel
  ranks each taking half the samples at the full 8,192 tokens (CP splits every sample's
  tokens and its causal attention evenly over 2 ranks, so each GPU does half a sample's
  FLOPs per micro-batch, as here), 16 micro-batches of 1 per GPU, DDP-style gradient
  all-reduce once per step (NeMo's distributed optimizer moves the same bytes as a
  reduce-scatter + all-gather); CP's K/V exchange is not priced.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import textwrap
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_RUNS = os.path.join(HERE, "..", "..", "..", "shared", "calibration-runs.json")
if not os.path.exists(DEFAULT_RUNS):
    DEFAULT_RUNS = "/work/shared/calibration-runs.json"

SPEC = textwrap.dedent('''
    import torch
    import torchledger
    from torchledger.models import build_model, get_config
    from torchledger.models.config import TransformerConfig

    MODEL = {model!r}
    LAYOUT = {layout!r}

    def _config():
        if isinstance(MODEL, dict):
            return TransformerConfig(**{{k: v for k, v in MODEL.items()}}, max_seq_len=LAYOUT["seq"])
        return get_config(MODEL)

    def _selective_op(block):
        # torchtitan's "op" selective AC: save matmul outputs except every second one, and
        # attention's; recompute the rest in backward
        from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts, CheckpointPolicy
        import functools
        aten = torch.ops.aten
        save = {{aten._scaled_dot_product_flash_attention.default,
                 aten._scaled_dot_product_efficient_attention.default,
                 aten._scaled_dot_product_flash_attention_for_cpu.default}}
        forward = block.forward

        def policy(meta):
            def fn(ctx, op, *args, **kwargs):
                key = "recompute" if ctx.is_recompute else "forward"
                if op == aten.mm.default:
                    meta[key] = meta.get(key, 0) + 1
                    return CheckpointPolicy.MUST_SAVE if meta[key] % 2 == 0 else CheckpointPolicy.PREFER_RECOMPUTE
                return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE
            return fn

        def wrapped(*args, **kwargs):
            meta = {{}}
            return checkpoint(forward, *args, use_reentrant=False,
                              context_fn=functools.partial(create_selective_checkpoint_contexts, policy(meta)),
                              **kwargs)
        block.forward = wrapped

    def parallelize(model, mesh):
        from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy
        kind = LAYOUT["kind"]
        if LAYOUT.get("ac") == "selective-op":
            for block in model.blocks:
                _selective_op(block)
        if kind == "tp":
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
            plan = {{"attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(),
                     "attn.v_proj": ColwiseParallel(), "attn.o_proj": RowwiseParallel(),
                     "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}}
            if getattr(model.blocks[0].mlp, "gate_proj", None) is not None:
                plan["mlp.gate_proj"] = ColwiseParallel()
            n = mesh.size()
            for block in model.blocks:
                parallelize_module(block, mesh, plan)
                block.attn.n_heads //= n
                block.attn.n_kv_heads //= n
            return model
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        reshard = kind == "fsdp"
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
        return fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)

    def audit_spec():
        cfg = _config()
        if LAYOUT.get("dtype") == "fp16":      # fake tensors cannot be cast in place: build in fp16
            old = torch.get_default_dtype()
            torch.set_default_dtype(torch.float16)
            try:
                model = build_model(cfg)
            finally:
                torch.set_default_dtype(old)
        else:
            model = build_model(cfg)
        idx = torch.randint(0, cfg.vocab_size, (LAYOUT["micro_batch"], LAYOUT["seq"]))
        return torchledger.AuditSpec(model, {{"idx": idx, "targets": idx}}, parallelize=parallelize)
''')

SAVE = None
GPUS = {"A100 SXM 80GB": "A100 SXM", "H100 SXM": "H100 SXM"}


def layout(run) -> tuple:
    """(layout dict for the spec, world size, micro-batches per step, tokens per GPU per step, note)."""
    seq, mb = run["seq"], run["micro_batch"]
    if run.get("tp", 1) > 1:
        micro = run["global_batch"] // (mb * run.get("dp", 1))
        return ({"kind": "tp", "seq": seq, "micro_batch": mb, "dtype": "fp16"}, run["tp"], micro,
                seq * mb * micro, "TP 8 without sequence parallelism (needs i22-plan's sp); fp16 weights")
    if run.get("cp", 1) > 1:
        ranks = run["gpus"]
        micro = run["global_batch"] // (run["dp"] * mb) // run["cp"]
        return ({"kind": "ddp", "seq": seq, "micro_batch": mb, "compiled": True}, ranks, micro, seq * mb * micro,
                f"CP {run['cp']} approximated: each GPU half the samples at full length (needs i22-plan's cp); "
                f"NeMo's Transformer Engine fused norm/RoPE/SwiGLU kernels priced as --compiled")
    micro = run["global_batch"] // (run["dp"] * mb)
    return ({"kind": "fsdp", "seq": seq, "micro_batch": mb, "ac": run.get("ac")}, run["gpus"], micro,
            seq * mb * micro, "FSDP2, bf16 compute, selective-op AC")


def measured_step(run, tokens_per_gpu) -> float:
    m = run["measured"]
    if "step_s" in m:
        return float(m["step_s"])
    return tokens_per_gpu / float(m["tokens_per_s_per_gpu"])


def predict(run, models) -> dict:
    from torchledger.audit import run_audit
    from torchledger.analyzers.steptime import attach_step_time
    spec_layout, world, micro, tokens, note = layout(run)
    model = models[run["model"]]
    model = run["model"] if model == "preset" else dict(model)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"{run['id'].replace('-', '_')}.py")
        with open(path, "w") as f:
            f.write(SPEC.format(model=model, layout=spec_layout))
        t0 = time.perf_counter()
        result = run_audit(path, steps=1, world_size=world)
        audit_s = time.perf_counter() - t0
    rec = result.record
    if spec_layout["kind"] == "ddp":
        # DDP's bucketed all-reduce of the bf16... fp32 gradients: FSDP2 without resharding
        # traced, its reduce-scatter + the all-gather of the next step stand for it
        pass
    pred = attach_step_time(rec, GPUS[run["gpu"]], {"micro_batches": micro,
                                                    "compiled": spec_layout.get("compiled", False)})
    if SAVE:
        rec.save(os.path.join(SAVE, run["id"] + ".json"))
    measured = measured_step(run, tokens)
    return {"id": run["id"], "gpu": pred["gpu"], "layout": note, "micro_batches": micro,
            "predicted_s": pred["seconds"], "measured_s": measured,
            "error": pred["seconds"] / measured - 1, "mfu_predicted": pred["mfu"],
            "mfu_published": run["measured"].get("mfu"), "bound": pred["bound"], "audit_s": audit_s,
            "tokens_per_s_per_gpu": pred["tokens_per_s_per_gpu"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default=DEFAULT_RUNS)
    ap.add_argument("--only", default=None, help="one run id")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--save", default=None, help="write each run's record (with its prediction) here")
    args = ap.parse_args(argv)
    global SAVE
    SAVE = args.save
    with open(args.runs) as f:
        data = json.load(f)
    rows = []
    for run in data["runs"]:
        if args.only and run["id"] != args.only:
            continue
        rows.append(predict(run, data["models"]))
        if not args.json:
            r = rows[-1]
            print(f"{r['id']:20s} {r['gpu']:9s} predicted {r['predicted_s']:7.3f} s  measured {r['measured_s']:7.3f} s  "
                  f"error {100 * r['error']:+6.1f}%  MFU pred {r['mfu_predicted']:.3f} / published "
                  f"{r['mfu_published']}  ({r['layout']}; audit {r['audit_s']:.0f} s)", flush=True)
            print(f"{'':20s} where the time goes: {r['bound']}", flush=True)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        errs = sorted(abs(r["error"]) for r in rows)
        if errs:
            print(f"median |error| {100 * errs[len(errs) // 2]:.1f}%, worst {100 * errs[-1]:.1f}% over {len(errs)} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
