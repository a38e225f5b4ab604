"""``torchledger plan`` against the layouts experts chose: the published runs of
``benchmarks/data/calibration-runs.json``, each searched on its own model, GPUs and global batch.

    PYTHONPATH=$PWD python benchmarks/plan_published.py [--only ID,...] [--json] [--save FILE] [--budget S]

For each run, the model file is predict_published's with one sequence a micro-batch and no
``AuditSpec(tokens=)`` (plan resizes the batch with ``audit --micro-batch-size``). The search:
the mesh dimensions the run uses (its ``--mesh``, plus ``dp`` always), checkpointing the
run's policy plus ``none`` and ``full``, schedule ``1f1b`` (plus ``interleaved`` at 2 to 4
virtual stages and the run's own when it has them), the run's ``--precision``, ``--kernels``
and ``--gpu``, ``--sequence-parallel on`` where the run says it used sequence parallelism
(``"sp": true``: Korthikanti's GPT runs, whose learned positions the standard plan otherwise
runs without it); ``jobs=1``.

First the published layout alone is priced (a search held to it: its figures, whether it
fits, or why the plan cannot price it, and the seconds it took). The whole search is then
estimated as its chains x :data:`CHAIN_GROUPS` x those seconds; while that is over ``--budget``, the
run's dimensions other than dp are held at the published sizes one at a time, in the order
of :data:`PIN_ORDER` (said in the row as "held"). A search that still runs past twice the
budget is stopped and the run reported as such.

Printed per run: the published layout, its predicted step, whether it fits and its rank
among the fitting rows, the plan's best (mesh, micro-batch, policy, schedule, step) and
what separates the published from it (``plan.search.versus_best``), the candidates and the
seconds. No constant is tuned here: the rows are the plan's.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from predict_published import DEFAULT_RUNS, model_file  # noqa: E402

#: Dimensions held at the published size, in this order, while the search is over budget.
PIN_ORDER = ("cp", "tp", "dp_replicate", "ep", "pp")
#: Traced groups a chain is estimated at: its smallest micro-batches are traced until one does
#: not fit (a first pass held to the published tp and pp: 19 audits for kor-175b's 12 chains,
#: 10 for dgxc-l31-70b's 8).
CHAIN_GROUPS = 2
DEFAULT_BUDGET = 600.0


def flag(run, name, default=None):
    f = run["flags"]
    return f[f.index(name) + 1] if name in f else default


def published(run) -> dict:
    """The run's layout in the plan's terms: mesh sizes, micro-batch size, policy, virtual
    stages, precision, kernels, GPU."""
    mesh = {k: int(v) for k, v in (x.split("=") for x in flag(run, "--mesh").split(","))}
    vp = int(flag(run, "--virtual-stages", 1))
    return {"mesh": mesh, "micro_batch_size": int(run["micro_batch"]), "checkpointing": flag(run, "--checkpointing"),
            "virtual_stages": vp, "schedule": "interleaved" if vp > 1 else ("1f1b" if mesh.get("pp", 1) > 1 else None),
            "precision": flag(run, "--precision"), "kernels": flag(run, "--kernels"), "gpu": flag(run, "--gpu")}


def search_options(run) -> dict:
    """The search's keyword arguments for ``run`` (see the module docstring)."""
    from torchledger.plan.space import MAX_VIRTUAL_STAGES
    pub = published(run)
    dims = ["dp"] + [k for k in pub["mesh"] if k != "dp"]
    vp = pub["virtual_stages"]
    opts = {"dims": tuple(dims), "checkpointing": tuple(dict.fromkeys([pub["checkpointing"], "none", "full"])),
            "schedules": ("1f1b", "interleaved") if vp > 1 else ("1f1b",),
            "precision": pub["precision"], "kernels": pub["kernels"], "virtual_stages": None,
            "sequence_parallel": True if run.get("sp") else None}
    if vp > MAX_VIRTUAL_STAGES:
        opts["virtual_stages"] = tuple(range(2, MAX_VIRTUAL_STAGES + 1)) + (vp,)
    return opts


def is_published(row, pub) -> bool:
    sizes = {k: int(v) for k, v in (x.split("=") for x in row["mesh"].split(","))}
    names = set(sizes) | set(pub["mesh"])
    return (all(sizes.get(k, 1) == pub["mesh"].get(k, 1) for k in names)
            and row["micro_batch_size"] == pub["micro_batch_size"] and row["checkpointing"] == pub["checkpointing"]
            and row["virtual_stages"] == pub["virtual_stages"] and row["schedule"] == pub["schedule"])


def chains(path, run, gpus_per_node, opts, fixed) -> int:
    """The chains the search would run (a chain: one mesh, policy and schedule, in rising
    micro-batch size; each stops at its first micro-batch that does not fit)."""
    from torchledger.plan import search as plan_search
    from torchledger.plan.evaluate import probe
    from torchledger.plan.space import enumerate_space
    facts = probe(path, sequence_parallel=opts["sequence_parallel"])
    space = enumerate_space(facts, int(run["gpus"]), int(run["global_batch"]), opts["dims"], opts["checkpointing"],
                            opts["schedules"], opts["precision"], opts["kernels"], gpus_per_node,
                            opts["virtual_stages"], fixed, opts["sequence_parallel"])
    return len(plan_search.chains(space.candidates, facts))


def held(run, path, opts, per_group, budget) -> tuple:
    """(fixed, estimated seconds): the published sizes held, in PIN_ORDER, until the
    estimate (``per_group`` seconds a traced group) is within ``budget``."""
    from torchledger.formulas.hardware import get_gpu
    pub = published(run)
    per_node = get_gpu(pub["gpu"]).gpus_per_node
    fixed = {}
    estimate = CHAIN_GROUPS * chains(path, run, per_node, opts, fixed) * per_group
    for name in [n for n in PIN_ORDER if n in opts["dims"]]:
        if estimate <= budget:
            break
        fixed[name] = pub["mesh"].get(name, 1)
        estimate = CHAIN_GROUPS * chains(path, run, per_node, opts, fixed) * per_group
    return fixed, estimate


def alone(run, path, opts) -> dict:
    """The published layout priced by a search held to it: its row, or why not; seconds (and
    those of reading the model's facts, which every search spends first)."""
    from torchledger.plan.evaluate import probe, warm
    from torchledger.plan.search import search
    warm()
    t0 = time.perf_counter()
    probe(path, sequence_parallel=opts["sequence_parallel"])
    probe_s = time.perf_counter() - t0
    pub = published(run)
    one = dict(opts, checkpointing=(pub["checkpointing"],),
               schedules=(pub["schedule"],) if pub["schedule"] else ("1f1b",),
               virtual_stages=(pub["virtual_stages"],) if pub["virtual_stages"] > 1 else None)
    fixed = {k: pub["mesh"].get(k, 1) for k in opts["dims"]}
    t0 = time.perf_counter()
    res = search(path, pub["gpu"], int(run["gpus"]), int(run["global_batch"]), jobs=1, top=1000,
                 fixed=fixed, stderr=open(os.devnull, "w"), **one)
    rows = [r for r in res["candidates"] if is_published(r, pub)]
    return {"row": rows[0] if rows else None, "rejected": res["rejected"], "seconds": time.perf_counter() - t0,
            "traced": res["traced"], "probe_s": probe_s}


def plan_run(run, models, budget, folder) -> dict:
    """One run's row (see the module docstring)."""
    from torchledger.plan.search import rank, search
    path = os.path.join(folder, run["id"].replace("-", "_") + ".py")
    with open(path, "w", encoding="utf-8") as f:
        f.write(model_file(run, models, micro=1, tokens=False))
    pub = published(run)
    opts = search_options(run)
    out = {"id": run["id"], "gpus": run["gpus"], "gpu": pub["gpu"], "global_batch": run["global_batch"],
           "published": pub, "search": {k: v for k, v in opts.items()}}
    first = alone(run, path, opts)
    out["published_alone_s"] = round(first["seconds"], 1)
    if first["row"] is None:
        out["status"] = "the plan cannot price the published layout: " + "; ".join(first["rejected"])
        return out
    # a group's seconds: the search held to the published layout less what every search
    # spends before tracing (reading the model's facts off the meta device)
    fixed, estimate = held(run, path, opts, max(1.0, first["seconds"] - first["probe_s"]), budget)
    out.update(held=fixed, estimate_s=round(estimate))
    t0 = time.perf_counter()
    res = search(path, pub["gpu"], int(run["gpus"]), int(run["global_batch"]), jobs=1, top=10, fixed=fixed,
                 **opts)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    ranked = rank(res["candidates"])
    mine = [r for r in res["candidates"] if is_published(r, pub)]
    row = mine[0] if mine else first["row"]
    best = ranked[0] if ranked and ranked[0]["fits"] else None
    out.update(status="ok", candidates=len(res["candidates"]), searched=res["searched"], traced=res["traced"],
               rejected=res["rejected"], fitting=sum(r["fits"] for r in res["candidates"]),
               published_row=_brief(row), best=_brief(best) if best else None,
               rank=next((i + 1 for i, r in enumerate(ranked) if r is row), None) if row["fits"] else None,
               limit_bytes=res["memory_limit_bytes"], in_search=bool(mine),
               versus_best=why(row, best, res["memory_limit_bytes"]),
               top=[_brief(r) for r in ranked[:5]])
    return out


def why(row, best, limit) -> str:
    """What separates the published row from the best: ``versus_best`` when it fits; when it
    does not, by how much its peak passes the limit, and its step against the best's."""
    from torchledger.plan.search import versus_best
    if best is None:
        return "nothing fits"
    if row["audit_args"] == best["audit_args"]:
        return "best"
    if row["fits"]:
        return versus_best(row, best)
    step = row["step_seconds"] / best["step_seconds"] - 1
    return (f"does not fit: peak {gib(row['peak_bytes'])} over the {gib(limit)} limit "
            f"(+{row['peak_bytes'] / limit - 1:.0%}); its step {abs(step):.0%} "
            f"{'shorter' if step < 0 else 'longer'} than the best's")


def _brief(r) -> dict:
    keys = ("mesh", "micro_batch_size", "micro_batches", "checkpointing", "schedule", "virtual_stages",
            "step_seconds", "peak_bytes", "fits", "comm_exposed_seconds", "bubble_seconds", "recompute_seconds",
            "compute_seconds", "launch_seconds", "mfu", "tokens_per_s_per_gpu", "versus_best", "audit_args")
    return {k: r.get(k) for k in keys}


def one(args) -> int:
    """``--one ID``: plan one run in this process, its row to ``--out``."""
    with open(args.runs) as f:
        data = json.load(f)
    run = next(r for r in data["runs"] if r["id"] == args.one)
    with tempfile.TemporaryDirectory(prefix="tl-plan-published-") as tmp:
        row = plan_run(run, data["models"], args.budget, tmp)
    with open(args.out, "w") as f:
        json.dump(row, f)
    return 0


def in_child(run, args) -> dict:
    """The run planned in a fresh process (its own session, so that a search past twice the
    budget is stopped with every process it forked)."""
    with tempfile.TemporaryDirectory(prefix="tl-plan-published-") as tmp:
        out = os.path.join(tmp, "row.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--one", run["id"], "--out", out, "--runs", args.runs,
               "--budget", str(args.budget)]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        limit = 2 * args.budget + 300
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        try:
            proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return {"id": run["id"], "gpus": run["gpus"], "status": f"stopped: no result in {limit:.0f} s"}
        if proc.returncode or not os.path.exists(out):
            return {"id": run["id"], "gpus": run["gpus"], "status": f"exit {proc.returncode} after "
                                                                    f"{time.perf_counter() - t0:.0f} s"}
        with open(out) as f:
            return json.load(f)


def cost_order(runs) -> list:
    """Cheapest first: by GPUs, pipelines last among them."""
    return sorted(runs, key=lambda r: (int(r["gpus"]), "pp=" in flag(r, "--mesh")))


def gib(n) -> str:
    return f"{n / 2**30:.1f} GiB"


def rank_words(r) -> str:
    """The published row's rank among the fitting, or why it has none."""
    if r["rank"]:
        return f"{r['rank']} of {r['fitting']}"
    if r["published_row"]["fits"]:       # priced alone, but the search did not trace it
        return "not traced by the search (a smaller micro-batch of its chain did not fit)"
    return f"does not fit ({gib(r['published_row']['peak_bytes'])})"


def layout(r) -> str:
    sched = r["schedule"] or "-"
    if r.get("virtual_stages", 1) > 1:
        sched += f" v={r['virtual_stages']}"
    return f"{r['mesh']} B={r['micro_batch_size']}x{r['micro_batches']} {r['checkpointing']} {sched}"


def limit_of(r) -> float:
    """The row's memory limit (rows saved before it was kept: the plan's default share)."""
    from torchledger.formulas.hardware import get_gpu
    from torchledger.plan.search import DEFAULT_MAX_MEMORY
    return r.get("limit_bytes") or DEFAULT_MAX_MEMORY * get_gpu(r["gpu"]).memory_bytes


def print_row(r) -> None:
    if r["status"] != "ok":
        print(f"{r['id']}: {r['status']}", flush=True)
        return
    p, b = r["published_row"], r["best"]
    r["versus_best"] = why(p, b, limit_of(r))
    rank = f"rank {rank_words(r)} fitting" if r["rank"] else rank_words(r).upper()
    print(f"{r['id']} ({r['gpus']} x {r['gpu']}, global batch {r['global_batch']}):", flush=True)
    print(f"  published  {layout(p)}: {p['step_seconds']:.3f} s, peak {gib(p['peak_bytes'])}, {rank}")
    if b:
        print(f"  plan best  {layout(b)}: {b['step_seconds']:.3f} s, peak {gib(b['peak_bytes'])}")
    print(f"  published vs best: {r['versus_best']}")
    held_ = ", ".join(f"{k}={v}" for k, v in r["held"].items()) or "nothing"
    print(f"  {r['candidates']} priced of {r['searched']} searched, {r['traced']} traced, {r['seconds']:.0f} s "
          f"(estimate {r['estimate_s']} s; held {held_}; published alone {r['published_alone_s']:.0f} s)",
          flush=True)


def short(r) -> str:
    """A row's layout in few words: the mesh's dimensions past 1, B x M, policy, schedule."""
    mesh = ",".join(x for x in r["mesh"].split(",") if not x.endswith("=1")) or r["mesh"].split(",")[0]
    sched = f", {r['schedule']}" if r["schedule"] else ""
    if r.get("virtual_stages", 1) > 1:
        sched += f" v={r['virtual_stages']}"
    return f"{mesh}, {r['micro_batch_size']} x {r['micro_batches']}, {r['checkpointing']}{sched}"


def markdown(rows) -> str:
    """The rows as docs/plan.md's table."""
    from torchledger.formulas.hardware import get_gpu
    out = ["| run | GPUs | published layout | its step | rank (fitting) | plan's best | best's step | published vs best "
           "| priced, s |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if r["status"] != "ok":
            out.append(f"| {r['id']} | {r['gpus']} | | | | | | {r['status']} | |")
            continue
        p, b = r["published_row"], r["best"]
        part = get_gpu(r["gpu"])
        rank = rank_words(r)
        held_ = f" (held {', '.join(f'{k}={v}' for k, v in r['held'].items())})" if r["held"] else ""
        out.append(f"| {r['id']} | {r['gpus']} x {part.name} | {short(p)} | {p['step_seconds']:.3f} s | {rank} | "
                   f"{short(b) + held_ if b else 'nothing fits'} | {b['step_seconds']:.3f} s | "
                   f"{why(p, b, limit_of(r))} | {r['candidates']}, {r['seconds']:.0f} |" if b else
                   f"| {r['id']} | {r['gpus']} x {part.name} | {short(p)} | {p['step_seconds']:.3f} s | {rank} | "
                   f"nothing fits{held_} | - | - | {r['candidates']}, {r['seconds']:.0f} |")
    return "\n".join(out)


def merged(path, rows) -> list:
    """``rows`` over the rows already saved in ``path`` (by run id, in the saved order)."""
    if not os.path.exists(path):
        return rows
    with open(path) as f:
        old = json.load(f)["rows"]
    new = {r["id"]: r for r in rows}
    return [new.pop(r["id"], r) for r in old] + list(new.values())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default=DEFAULT_RUNS)
    ap.add_argument("--only", default=None, help="run ids, comma-separated")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--budget", type=float, default=DEFAULT_BUDGET, help="estimated seconds a run's search may take")
    ap.add_argument("--save", default=None, metavar="FILE", help="also write the rows' JSON here")
    ap.add_argument("--load", default=None, metavar="FILE", help="print the rows a --save wrote, search nothing")
    ap.add_argument("--markdown", action="store_true", help="with --load: the rows as a Markdown table")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        return one(args)
    if args.load:
        with open(args.load) as f:
            rows = json.load(f)["rows"]
        if args.markdown:
            print(markdown(rows))
        else:
            for r in rows:
                print_row(r)
        return 0
    with open(args.runs) as f:
        data = json.load(f)
    only = set(args.only.split(",")) if args.only else None
    rows = []
    for run in cost_order(data["runs"]):
        if only and run["id"] not in only:
            continue
        rows.append(in_child(run, args))
        rows[-1]["budget_s"] = args.budget
        if not args.json:
            print_row(rows[-1])
        if args.save:                   # rows of other runs already there are kept (by id)
            keep = merged(args.save, rows)
            with open(args.save, "w") as f:
                json.dump({"rows": keep}, f, indent=1)
    if args.json:
        print(json.dumps({"rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
