"""``torchledger calibrate RECORD.json... --gpu NAME``: fit a part's kernel efficiency from
measured CUDA records and write a ``TORCHLEDGER_HARDWARE`` file."""
from __future__ import annotations

import json
import os

import click

from .types import InputError, check_output, gpu_part

__all__ = ["calibrate"]


@click.command()
@click.argument("record_files", metavar="RECORD.json...", nargs=-1, required=True)
@click.option("--gpu", required=True, help="The part the records were measured on (e.g. H100).")
@click.option("--output", default="torchledger-hardware.json", show_default=True,
              help="The TORCHLEDGER_HARDWARE file to write (an existing one keeps its other parts).")
@click.option("--compiled", is_flag=True, default=False, help="The records' steps ran under torch.compile.")
def calibrate(record_files, gpu, output, compiled):
    """Fit the step-time model's kernel efficiency (matmul fraction of peak, HBM fraction,
    launch floor, attention) to the measured step times of real CUDA records of that part,
    and write them as the part's "efficiency" row of a TORCHLEDGER_HARDWARE file.

    Use it with: export TORCHLEDGER_HARDWARE=torchledger-hardware.json"""
    from ..steptime.calibrate import fit_efficiency, measured_seconds  # lazy: CLI startup
    from ..render.output import write_atomic  # lazy: CLI startup
    from .audit import load_record  # lazy: CLI startup
    check_output(output)
    part = gpu_part(gpu)
    records = []
    for path in record_files:
        rec = load_record(path, path)
        device = str(rec.meta.get("device") or "")
        if not device.startswith("cuda") or not measured_seconds(rec):
            raise InputError(f"{path}: expected a record of a real CUDA step with a measured step time, got "
                             f"device {device or '?'} and step_seconds {rec.totals.get('step_seconds')}; "
                             f"record one with: torchledger audit model.py --device cuda --format json")
        records.append(rec)
    try:
        fit = fit_efficiency(records, part, {"compiled": compiled})
    except ValueError as e:
        raise InputError(str(e)) from None
    table = {}
    if os.path.exists(output):
        try:
            with open(output, encoding="utf-8") as f:
                table = json.load(f)
        except (OSError, ValueError) as e:
            raise InputError(f"--output {output}: exists but is not a JSON object ({e}); remove it or "
                             f"write elsewhere") from None
    row = dict(table.get(part.name) or {})
    # the fitted keys replace the row's; the ones calibrate does not fit (tiles, the attention
    # kernel, ...) stay: the fit was made with them when this file is TORCHLEDGER_HARDWARE
    row["efficiency"] = {**(row.get("efficiency") or {}), **fit["efficiency"]}
    row.setdefault("sources", {})["efficiency"] = (
        f"torchledger calibrate from {fit['records']} record(s); rms log error "
        f"{fit['rms_log_error_before']:.3f} -> {fit['rms_log_error_after']:.3f}")
    table[part.name] = row
    write_atomic(output, json.dumps(table, indent=2) + "\n")
    e = fit["efficiency"]
    click.echo(f"{part.name}: matmul {e['matmul_peak_fraction']:.3f} of peak, HBM {e['memory_fraction']:.3f}, "
               f"launch {e['launch_s'] * 1e6:.1f} us, attention x{fit['attention_scale']:.2f}; rms log error "
               f"{fit['rms_log_error_before']:.3f} -> {fit['rms_log_error_after']:.3f} over {fit['records']} "
               f"record(s); wrote {output} (export TORCHLEDGER_HARDWARE={output})")
