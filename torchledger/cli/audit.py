"""``torchledger audit FILE.py`` and ``torchledger report RECORD.json``.

Thin: parse flags, call ``torchledger.audit.run_audit``, run the analyzers, render, write.
Exit codes: 0 clean, 1 a finding at or above ``--fail-on``, 2 bad usage or input.
"""
from __future__ import annotations

import os

import click

from ..parallel.layout import CHECKPOINTING, KERNELS, PRECISIONS
from ..audit.supervise import supervised
from .types import (BANDWIDTH, FLOPS, FRACTION, GLOBAL_BATCH, MICRO_BATCHES, ON_OFF, POS_INT, SECONDS,
                    InputError, PlainNumber, check_folder, check_output, echo_out, gpu_part, on_off)

__all__ = ["audit", "report"]

FORMATS = ("table", "json", "csv", "markdown", "sarif", "html", "trace")
SEVERITIES = ("error", "warning", "info", "never")
#: ``audit --timeout`` default, seconds: generous for a 7B fake audit on a laptop.
TIMEOUT_S = 1800.0


def _resolve_format(fmt, output):
    from ..render import format_from_path  # lazy: CLI startup
    check_output(output)
    if fmt:
        return fmt
    if output:
        try:
            return format_from_path(output)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--output") from None
    return "table"


def _peak(peak_flops, gpu, dtype="bf16"):
    if peak_flops and gpu is not None:
        raise click.UsageError("give --peak-flops or --gpu, not both")
    if peak_flops:
        return peak_flops, "--peak-flops"
    if gpu is not None:                     # '' too: refused, not a memory gate turned off
        spec = gpu_part(gpu)
        peak = spec.peak_flops.get(dtype) if hasattr(spec, "peak_flops") else None
        if not peak:
            raise click.BadParameter(f"{gpu} has no {dtype} peak in the hardware table", param_hint="--gpu")
        return peak, f"{gpu} {dtype} peak"
    return None, None


def _emit(text: str, output) -> None:
    from ..render import write_atomic  # lazy: CLI startup
    from ..render.output import make_folders  # lazy: CLI startup
    from ..audit.supervise import handed_over  # lazy: CLI startup
    if handed_over(text, output):       # in audit's child process: the parent writes it
        return
    if output:
        try:
            make_folders(output, f"--output {output}")
            write_atomic(output, text if text.endswith("\n") else text + "\n")
        except OSError as e:
            raise InputError(f"--output {output}: cannot write ({e.strerror or e})") from None
        click.echo(f"torchledger: wrote {output}", err=True)
    else:
        echo_out(text)


#: The totals a record must carry to be rendered, and to serve as a --baseline (the numbers
#: compare_baseline compares). A record missing them (a truncated file, a hand-written
#: ``{"schema": "torchledger/1"}``) is bad input, not an empty report or a gate that passes.
REPORT_TOTALS = ("flops.total",)
BASELINE_TOTALS = ("flops.total", "params", "peak_bytes", "activation_bytes")
_MAKE_ONE = "write one with `torchledger audit FILE.py --format json --output a.json`"


def load_record(path, label, needed=REPORT_TOTALS):
    """A saved record, validated (:mod:`torchledger.record.schema`), or one line saying what
    arrived instead and how to make one. A baseline's totals must also be positive: a zero
    baseline compares as no growth, so a gate against it would always pass."""
    from ..inputs import RECORD_MAX_BYTES, InputFileError, read_input  # lazy: CLI startup
    from ..record import StepRecord  # lazy: CLI startup
    from ..record.schema import RecordError, parse_record  # lazy: CLI startup
    try:
        data = parse_record(read_input(path, what="record JSON", max_bytes=RECORD_MAX_BYTES))
        rec = StepRecord.from_dict(data)
    except InputFileError as e:
        raise InputError(f"{label}: {_after_path(str(e), path)}; {_MAKE_ONE}") from None
    except RecordError as e:
        raise InputError(f"{label}: not a torchledger record ({e}); {_MAKE_ONE}") from None
    data = data.get("totals")
    missing = [key for key in needed if not _is_number(_dig(data, key))]
    if missing:
        what = "no totals" if not data else "no " + ", ".join(f"totals.{k}" for k in missing)
        raise InputError(f"{label}: an incomplete torchledger record ({what}); expected a whole record "
                         f"with {', '.join(f'totals.{k}' for k in needed)}; {_MAKE_ONE}")
    if needed is BASELINE_TOTALS:
        zero = [key for key in ("flops.total", "params", "peak_bytes") if not _dig(data, key)]
        if zero:
            raise InputError(f"{label}: totals.{zero[0]}: expected a positive number (a step that ran), "
                             f"got 0; a baseline of nothing would pass every gate; {_MAKE_ONE}")
    return rec


def _after_path(message: str, path) -> str:
    """``read_input``'s message without its leading ``path: `` (the label already names it)."""
    prefix = f"{os.fspath(path)}: "
    return message[len(prefix):] if message.startswith(prefix) else message


def _dig(d, dotted: str):
    for part in dotted.split("."):
        if not isinstance(d, dict):
            return None
        d = d.get(part)
    return d


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _debug() -> bool:
    """``torchledger --debug`` (or ``TORCHLEDGER_DEBUG=1``): tracebacks and torch's own logs."""
    ctx = click.get_current_context(silent=True)
    root = ctx.find_root() if ctx is not None else None
    return bool(root is not None and root.params.get("debug")) or os.environ.get("TORCHLEDGER_DEBUG") == "1"


def _exit_code(findings, fail_on: str) -> int:
    from ..settings import SEVERITY_RANK  # lazy: CLI startup
    limit = SEVERITY_RANK[fail_on]
    return 1 if any(SEVERITY_RANK[f.severity] >= limit for f in findings) else 0


@click.command()
@click.argument("file", metavar="FILE.py")
@click.option("--entry", default="audit_spec", show_default=True,
              help="Function in FILE.py that returns a torchledger.AuditSpec.")
@click.option("--device", type=click.Choice(["fake", "meta", "cpu", "cuda"], case_sensitive=False),
              default="fake",
              show_default=True, help="fake: FakeTensors with CPU kernels (no memory, no GPU).")
@click.option("--steps", type=POS_INT, default=3, show_default=True, help="Training steps to run and trace.")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default=None,
              help="Output format (default: from --output's extension, else table).")
@click.option("--output", type=click.Path(dir_okay=False), default=None, help="Write here (atomically).")
@click.option("--fail-on", type=click.Choice(SEVERITIES), default=None,
              help="Exit 1 on findings at or above this severity [default: error, or fail_on in "
                   "[tool.torchledger]].")
@click.option("--baseline", type=click.Path(dir_okay=False), default=None,
              help="A previous audit JSON: fail when FLOPs or bytes grew beyond the tolerance.")
@click.option("--peak-flops", type=FLOPS, default=None, help="Peak FLOP/s for MFU (e.g. 989.5T).")
@click.option("--gpu", default=None,
              help="GPU (e.g. H100) whose memory the step's peak must fit (TL-MEM-002) and whose bf16 "
                   "peak MFU is measured against.")
@click.option("--world-size", type=PlainNumber(), default=None,
              help="Simulate this many ranks (fake tensors, fake process group; AuditSpec(parallelize=fn) "
                   "shards the model); the report is rank 0's.")
@click.option("--mesh", default=None, metavar="DxD|dp=..,tp=..",
              help="Device mesh of the simulated world: 8x8 (dims dp, tp) or named dims dp (FSDP2), "
                   "dp_replicate (DDP; HSDP with dp), cp, tp, pp, e.g. dp=4,cp=2,tp=8,pp=9; implies "
                   "--world-size. Without AuditSpec(parallelize=fn) the standard plan applies it.")
@click.option("--virtual-stages", type=POS_INT, default=None,
              help="Pipeline: model chunks per pp rank (interleaved schedule) [default: 1].")
@click.option("--micro-batches", type=MICRO_BATCHES, default=None,
              help="Pipeline: micro-batches per step, each the AuditSpec's inputs [default: pp].")
@click.option("--micro-batch-size", type=MICRO_BATCHES, default=None, metavar="B",
              help="Sequences in one micro-batch of one data-parallel rank: the spec's inputs repeated or cut "
                   "along their batch dim to B rows [default: the spec's batch].")
@click.option("--global-batch", type=GLOBAL_BATCH, default=None,
              help="Pipeline: sequences per step over all data-parallel ranks (micro-batches = G / (dp x B)).")
@click.option("--schedule", type=click.Choice(["1f1b", "interleaved", "gpipe", "zero-bubble"]), default=None,
              help="Pipeline schedule [default: 1f1b; interleaved with --virtual-stages > 1].")
@click.option("--checkpointing", type=click.Choice(list(CHECKPOINTING)),
              default=None, help="Standard plan: activation checkpointing per block (torchtitan's policies; "
                                 "selective-attention: Megatron's selective recompute, core attention only).")
@click.option("--precision", type=click.Choice(list(PRECISIONS)), default=None,
              help="Standard plan: bf16-mixed/fp16-mixed FSDP2's MixedPrecisionPolicy (autocast without "
                   "FSDP); bf16 parameters; bf16-params/fp16-params 16-bit weights and gradients with fp32 "
                   "master weights and optimizer state (Megatron, NeMo); fp8: bf16-params with the blocks' "
                   "GEMMs in fp8 (Transformer Engine).")
@click.option("--kernels", type=click.Choice(list(KERNELS)), default=None,
              help="With --gpu: eager (PyTorch eager, the default), compiled (torch.compile's fusion of the "
                   "model, as --compiled), te (Megatron-Core / NeMo with Transformer Engine: cuDNN fused "
                   "attention, fused norm/activation/bias, TP communication overlapped with GEMMs, fused Adam, "
                   "distributed optimizer).")
@click.option("--sequence-parallel", type=click.Choice(ON_OFF), default=None,
              help="Standard plan with tp: whether tensor parallelism also splits the sequence between the "
                   "blocks (Megatron's sequence parallelism) [default: on for RoPE decoders, off for learned "
                   "positions (GPT-2/3: Megatron's GPT ran without it before 2022) and Hugging Face decoders].")
@click.option("--link-bandwidth", type=BANDWIDTH, default=None, metavar="450GB/s",
              help="Bus bandwidth per rank for the communication time (default: --gpu's NVLink, or its "
                   "node's InfiniBand when the world spans nodes); B is bytes, b bits (400Gb/s = 50 GB/s).")
@click.option("--mfu", type=FRACTION, default=None,
              help="MFU assumed for the compute time beside the communication time of --link-bandwidth "
                   "(with --gpu alone the predicted step time is used) [default: 0.4].")
@click.option("--depth", type=POS_INT, default=2, show_default=True, help="Module depth in the tables.")
@click.option("--memory-snapshot", type=click.Path(dir_okay=False), default=None,
              help="CUDA only: write the allocator snapshot of the last step (opens in PyTorch's memory_viz).")
@click.option("--compiled", is_flag=True, default=False,
              help="With --gpu: predict the step as torch.compile runs it (elementwise chains between "
                   "matmuls fused: one read and one write per chain); the same as --kernels compiled.")
@click.option("--ignore", "ignore", multiple=True, metavar="RULE",
              help="Suppress this rule's findings (repeatable; adds to ignore in [tool.torchledger]); "
                   "the report counts them and they do not fail --fail-on.")
@click.option("--timing-steps", type=PlainNumber(0, 1000, example="3"), default=None, metavar="N",
              help="cpu/cuda: untraced steps timed for MFU, after one untimed warm-up step; 0 times none "
                   "[default: 3 to 20, until they add up to 0.5 s].")
@click.option("--timeout", type=SECONDS, default=TIMEOUT_S, show_default=True,
              metavar="SECONDS",
              help="Stop an audit that runs longer (a loop in the model file) and say where it was; "
                   "0: no limit. The model file runs in a child process: its exit code, hang or prints "
                   "cannot decide the result (--debug: in this process, no limit).")
@supervised(lambda text, output: _emit(text, output), check=lambda **kw: _check_world(**kw))
def audit(file, entry, device, steps, fmt, output, fail_on, baseline, peak_flops, gpu, world_size, mesh,
          virtual_stages, micro_batches, global_batch, schedule, checkpointing, precision,
          link_bandwidth, mfu, depth, memory_snapshot, ignore, timing_steps, compiled=False, kernels=None,
          micro_batch_size=None, sequence_parallel=None):
    """Run and trace training steps of the model in FILE.py, compare with the closed forms,
    report per layer and gate CI on findings, budgets and a baseline.

    With --world-size N (or --mesh DxD) the step runs as rank 0 of N simulated ranks: fake
    tensors under a fake process group, sharded by the file's AuditSpec(parallelize=fn).

    Trust: FILE.py runs with the same trust as `python FILE.py`; audit only model files you
    would run. The audit runs it in a child process that guards against accidents (an exit, a
    hang, stray prints, a stray line on the result pipe), not against a file written to deceive
    the audit: code that runs as the audit can make it say anything."""
    from ..audit.engine import run_audit, stdout_to_stderr
    from ..audit.spec import AuditError  # lazy: CLI startup
    from ..settings import (SettingsError, check_budgets, compare_baseline, load_settings,  # lazy: CLI startup
                            rule_ids, suppress)

    if compiled and kernels not in (None, "compiled"):
        raise InputError(f"--compiled and --kernels {kernels}: --compiled is --kernels compiled; give one")
    kernels = "compiled" if compiled else kernels
    fmt = _resolve_format(fmt, output)
    output = _rank_output(output)           # under torchrun: out.json -> out.rank{r}.json
    peak, peak_source = _peak(peak_flops, gpu)
    try:
        settings = load_settings(file if os.path.exists(file) else os.getcwd())
        ignore = rule_ids(list(settings.get("ignore", [])) + list(ignore), "--ignore")
    except SettingsError as e:
        raise InputError(str(e)) from None
    for flag, path in (("--output", output), ("--memory-snapshot", memory_snapshot)):
        check_folder(flag, path)            # before the audit runs, not after minutes of it
    base = load_record(baseline, f"--baseline {baseline}", BASELINE_TOTALS) if baseline else None
    if timing_steps is not None and device not in ("cpu", "cuda"):
        raise InputError(f"--timing-steps {timing_steps}: times real steps, so it needs --device cpu or cuda; "
                         f"a {device} step has no real time (drop --timing-steps, or pick cpu/cuda)")
    if memory_snapshot and device != "cuda":
        from ..tracer.cuda_history import UNAVAILABLE  # lazy: CLI startup
        raise InputError(f"--memory-snapshot needs --device cuda: {UNAVAILABLE}")
    try:
        with stdout_to_stderr():        # stdout is the report's alone
            run = run_audit(file, entry=entry, device=device, steps=steps, peak_flops=peak,
                            torch_logs=_debug(), world_size=world_size, mesh=mesh,
                            timing_steps=timing_steps,
                            plan=_plan(virtual_stages, micro_batches, global_batch, schedule,
                                       checkpointing, precision, kernels, micro_batch_size,
                                       sequence_parallel))
    except AuditError as e:
        raise InputError(str(e)) from None
    if memory_snapshot:
        _write_snapshot(run, memory_snapshot)
    if device == "cpu" and peak is None:
        from ..tracer.peak import measure_matmul_peak  # lazy: CLI startup
        peak, peak_source = measure_matmul_peak(), "measured CPU matmul peak"
    findings = _findings(run, settings, peak, peak_source, gpu,
                         {"link_bandwidth": link_bandwidth, "assumed_mfu": mfu,
                          "compiled": compiled or kernels == "compiled" or None, "kernels": kernels})
    rec = run.record
    findings += check_budgets(rec, settings)
    if base is not None:
        more, rows = compare_baseline(rec, base, settings.get("baseline_tolerance", 0.01))
        findings += more
        rec.meta["baseline_diff"] = rows
        from ..analyzers.steptime import compare_step_time, step_time_skipped    # (--gpu)
        findings += compare_step_time(rec, base, settings.get("baseline_tolerance", 0.01))
        skipped = step_time_skipped(rec, base)
        if skipped:
            click.echo(f"torchledger: warning: --baseline: the predicted step time was not compared: {skipped}",
                       err=True)
    findings, suppressed = suppress(findings, ignore)
    if ignore:
        rec.meta["suppressed"] = {"ignore": ignore, "count": len(suppressed),
                                  "rules": {r: sum(f.rule == r for f in suppressed)
                                            for r in ignore if any(f.rule == r for f in suppressed)}}
    rec.findings = findings
    _check_counts(rec, micro_batches, global_batch)
    from ..render import render  # lazy: CLI startup
    text = render(rec, findings, fmt, depth=depth)
    _emit(text, output)
    return _exit_code(findings, fail_on or settings.get("fail_on", "error"))


def _plan(virtual_stages, micro_batches, global_batch, schedule, checkpointing, precision, kernels,
          micro_batch_size=None, sequence_parallel=None) -> dict:
    return {"virtual_stages": virtual_stages, "micro_batches": micro_batches, "global_batch": global_batch,
            "schedule": schedule, "micro_batch_size": micro_batch_size, "checkpointing": checkpointing,
            "precision": precision, "kernels": kernels,
            "sequence_parallel": on_off(sequence_parallel)}


def _check_world(*, device, world_size, mesh, virtual_stages, micro_batches, global_batch, schedule,
                 checkpointing, precision, compiled=False, kernels=None, micro_batch_size=None,
                 sequence_parallel=None, **_) -> None:
    """``--world-size``, ``--mesh`` and the plan options, checked in this process before the
    audit's child starts (and spends seconds importing torch): the parsers import no torch. The
    child checks them again where it uses them (``run_audit``)."""
    from ..audit.layouts import resolve, resolve_layout  # lazy: CLI startup
    from ..audit.spec import AuditError  # lazy: CLI startup
    kernels = "compiled" if compiled and kernels in (None, "compiled") else kernels
    try:
        world = resolve(world_size, mesh, device)
        resolve_layout(world, mesh, _plan(virtual_stages, micro_batches, global_batch, schedule,
                                          checkpointing, precision, kernels, micro_batch_size,
                                          sequence_parallel))
    except AuditError as e:
        raise InputError(str(e)) from None


def _check_counts(rec, micro_batches, global_batch) -> None:
    """Records hold counts (FLOPs, bytes) in int64, as ``report`` reads them back: a step past
    that (1e6 micro-batches of a large step) is one line naming the count, not a record that
    ``report`` refuses."""
    from ..record.jsonio import MAX_INT, past_int64  # lazy: CLI startup
    found = past_int64(rec.to_dict())
    if found is None:
        return
    where, value = found
    flags = [f"{flag} {v:,}" for flag, v in (("--micro-batches", micro_batches), ("--global-batch", global_batch))
             if v]
    cause = (f"{' and '.join(flags)} multiplies the step's counts; give fewer" if flags
             else "audit a smaller step")
    raise InputError(f"the audit's record has {where} = {value:.3g}, past int64 ({MAX_INT:,}), which records "
                     f"count in: {cause}")


def _rank_output(output):
    """``--output`` for this rank: under torchrun each rank writes its own file (``{rank}``
    in the name, else ``.rank{r}`` before the extension); one process keeps the name."""
    from ..render.output import launcher_rank, rank_path  # lazy: CLI startup
    launched = launcher_rank()
    if not output or (launched is None and "{rank}" not in output):
        return output
    rank, world = launched or (0, 1)
    return rank_path(output, rank, world)


def _write_snapshot(run, path) -> None:
    import pickle
    from ..render import write_atomic  # lazy: CLI startup
    if run.snapshot is None:
        reason = run.record.memory.get("allocator", {}).get("reason", "no allocator history")
        raise InputError(f"--memory-snapshot {path}: {reason}")
    try:
        from ..render.output import make_folders  # lazy: CLI startup
        make_folders(path, f"--memory-snapshot {path}")
        write_atomic(path, pickle.dumps(run.snapshot))
    except OSError as e:
        raise InputError(f"--memory-snapshot {path}: cannot write ({e.strerror or e})") from None
    click.echo(f"torchledger: wrote {path} (open it at https://pytorch.org/memory_viz)", err=True)


def _findings(run, settings, peak, peak_source, gpu=None, network=None) -> list:
    from ..analyzers.checks import run_checks  # lazy: CLI startup
    from ..audit.engine import set_mfu  # lazy: CLI startup
    options = {k: v for k, v in settings.items() if not k.startswith("_")}
    options.update({k: v for k, v in (network or {}).items() if v is not None})   # TL-NET-001
    if gpu:
        options["gpu"] = gpu                    # TL-MEM-002: does the peak fit in its memory?
    if peak:
        options.update(peak_flops=peak, peak_source=peak_source)
    if gpu:                                     # predictions.step_time on that part
        from ..steptime.predict import predict_into  # lazy: CLI startup
        predict_into(run.record, gpu, options, stages=getattr(run, "stage_records", None))
    options = set_mfu(run, options)             # the one MFU the header and TL-MFU-001 print
    findings = run_checks(run.records, options)
    try:
        from ..lint import LintError, lint_paths  # lazy: CLI startup
    except ImportError:  # lint not part of this build
        return findings
    try:
        return findings + list(lint_paths([run.path]))
    except LintError as e:  # the model file removed itself, or the folder it was read from
        click.echo(f"torchledger: warning: the model file was not linted: {e}", err=True)
        return findings


@click.command()
@click.argument("record_files", metavar="RECORD.json...", nargs=-1, required=True)
@click.option("--format", "fmt", type=click.Choice(FORMATS), default=None,
              help="Output format (default: from --output's extension, else table).")
@click.option("--output", type=click.Path(dir_okay=False), default=None, help="Write here (atomically).")
@click.option("--depth", type=POS_INT, default=2, show_default=True, help="Module depth in the tables.")
@click.option("--fail-on", type=click.Choice(SEVERITIES), default="never", show_default=True,
              help="Exit 1 on findings (the record's, or the merge's TL-RANK-*) at or above this severity.")
def report(record_files, fmt, output, depth, fail_on):
    """Render a saved audit or trace record (JSON) in any format, offline. Given the records
    of several ranks of one run (torchrun: rank0.json rank1.json ...), merge them: a per-rank
    table, the skew across ranks and the findings only a merge can make (TL-RANK-*)."""
    from ..render import render  # lazy: CLI startup
    fmt = _resolve_format(fmt, output)
    if len(record_files) > 1:
        return _exit_code(_report_ranks(record_files, fmt, output), fail_on)
    (record_file,) = record_files
    rec = load_record(record_file, record_file)
    from ..analyzers.ranks import lone_rank_findings  # lazy: CLI startup
    findings = list(rec.findings) + lone_rank_findings(rec, record_file)   # TL-RANK-004: rank 1 of 2 missing
    _emit(render(rec, findings, fmt, depth=depth), output)
    return _exit_code(findings, fail_on)


def _report_ranks(paths, fmt, output) -> list:
    """``report rank0.json rank1.json ...``: the ranks' records merged (analyzers/ranks.py),
    written; returns the merge's findings (for ``--fail-on``)."""
    from ..analyzers.ranks import RanksError, merge_ranks  # lazy: CLI startup
    from ..render.ranks import RANK_FORMATS, render_ranks  # lazy: CLI startup
    if fmt not in RANK_FORMATS:
        raise InputError(f"--format {fmt}: merged ranks render as {', '.join(RANK_FORMATS)}; "
                         f"{fmt} is for one record's report")
    from ..settings import SettingsError, load_settings, suppress  # lazy: CLI startup
    try:
        settings = load_settings(os.getcwd())       # rank_*_skew thresholds, ignore
    except SettingsError as e:
        raise InputError(str(e)) from None
    records = [load_record(p, p) for p in paths]
    try:
        merged = merge_ranks(records, names=list(paths), options=settings)
    except RanksError as e:
        raise InputError(str(e)) from None
    merged["findings"], _ = suppress(merged["findings"], settings.get("ignore"))
    if merged["missing_ranks"]:
        missing, count = merged["missing_ranks"], merged["missing_count"]
        click.echo(f"torchledger: warning: {count} of {merged['world_size']} ranks missing "
                   f"(rank {', '.join(str(r) for r in missing[:16])}{', ...' if count > 16 else ''}); "
                   f"the skew covers the {len(records)} given", err=True)
    _emit(render_ranks(merged, fmt), output)
    return merged["findings"]
