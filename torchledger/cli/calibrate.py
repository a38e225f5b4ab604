"""``torchledger calibrate RECORD.json... --gpu NAME``: fit a part's kernel efficiency from
measured CUDA records and write a ``TORCHLEDGER_HARDWARE`` file.

Every input is bounded: records are read as ``report`` reads them (regular files, at most
``RECORD_MAX_BYTES``, validated), an existing ``--output`` as ``TORCHLEDGER_HARDWARE`` is
(a regular JSON object of parts, each row checked); ``--output`` naming one of the records
is refused, and a FIFO or device as ``--output`` is written in place, never read. A record
says which GPU it was measured on (``meta.gpu``): one of another part than ``--gpu`` is
refused (its times would fit the wrong part's row); one that does not say (older records)
is taken as ``--gpu``'s, with a warning. A parameter the fit drove onto a bound is written
with a warning naming it and the bound.
"""
from __future__ import annotations

import json
import os

import click

from .types import InputError, check_folder, check_output, gpu_part

__all__ = ["calibrate", "PROGRESS_MIN"]

#: From this many records on, reading and fitting them (about 0.5 s a record) is shown on stderr.
PROGRESS_MIN = 8


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
    from ..steptime.calibrate import fit_efficiency  # lazy: CLI startup
    check_output(output)
    part = gpu_part(gpu)
    _not_an_input(output, record_files)
    table = _existing_table(output)
    check_folder("--output", output)
    records = _records(record_files, part)
    shown = len(records) >= PROGRESS_MIN

    def progress(sweep, sweeps, rms):
        click.echo(f"torchledger: calibrate: sweep {sweep} of at most {sweeps}: rms log error {rms:.3f}",
                   err=True)
    try:
        fit = fit_efficiency(records, part, {"compiled": compiled}, progress=progress if shown else None)
    except ValueError as e:
        raise InputError(str(e)) from None
    bounds = _bound_notes(fit)
    table[part.name] = _merged_row(table.get(part.name), fit, bounds)
    _write(output, json.dumps(table, indent=2) + "\n")
    for note in bounds:
        click.echo(f"torchledger: warning: {part.name}: {note}; written as fitted: check that the records are "
                   f"real steps of {part.name} whose step time is the GPU's work (not data loading)", err=True)
    e = fit["efficiency"]
    click.echo(f"{part.name}: matmul {e['matmul_peak_fraction']:.3f} of peak, HBM {e['memory_fraction']:.3f}, "
               f"launch {e['launch_s'] * 1e6:.1f} us, attention x{fit['attention_scale']:.2f}; rms log error "
               f"{fit['rms_log_error_before']:.3f} -> {fit['rms_log_error_after']:.3f} over {fit['records']} "
               f"record(s); wrote {output} (export TORCHLEDGER_HARDWARE={output})")


def _not_an_input(output, record_files) -> None:
    """``--output`` that is one of the records (by name, a link or a hard link) would replace
    that record with a hardware table."""
    for path in record_files:
        try:
            same = os.path.samefile(output, path)
        except OSError:             # one of them does not exist: not the same file
            same = False
        if same:
            raise InputError(f"--output {output}: is the input record {path}; calibrate would replace it with a "
                             f"hardware table; write elsewhere (e.g. --output torchledger-hardware.json)")


def _existing_table(output) -> dict:
    """The parts already in ``--output`` (kept; the part's row is updated), or {} for a new
    file or one that is not a regular file (a FIFO, a device: written in place, never read)."""
    import stat
    from ..formulas.hardware import read_table  # lazy: CLI startup
    try:
        st = os.stat(output)
    except FileNotFoundError:
        return {}
    except OSError as e:
        raise InputError(f"--output {output}: cannot read ({e.strerror or e}); write elsewhere") from None
    if stat.S_ISDIR(st.st_mode):
        raise InputError(f"--output {output}: is a directory; expected a file name such as "
                         f"{os.path.join(output, 'torchledger-hardware.json')}")
    if not stat.S_ISREG(st.st_mode):
        return {}
    try:
        return read_table(output)
    except ValueError as e:      # InputFileError, HardwareFieldError: one line each
        message = str(e)
        if message.startswith(f"{output}: "):
            message = message[len(output) + 2:]
        raise InputError(f"--output {output}: exists and is not a hardware file calibrate can update "
                         f"({message}); fix or remove it, or write elsewhere") from None


def _records(record_files, part) -> list:
    """The records, each a real CUDA step of ``part`` with a measured time (see the module)."""
    from ..formulas.hardware import get_gpu  # lazy: CLI startup
    from ..steptime.calibrate import measured_seconds  # lazy: CLI startup
    from .audit import load_record  # lazy: CLI startup
    records, unnamed = [], 0
    for i, path in enumerate(record_files):
        if len(record_files) >= PROGRESS_MIN and i % PROGRESS_MIN == 0:
            click.echo(f"torchledger: calibrate: reading record {i + 1} of {len(record_files)}", err=True)
        rec = load_record(path, path)
        device = str(rec.meta.get("device") or "")
        if not device.startswith("cuda") or not measured_seconds(rec):
            raise InputError(f"{path}: expected a record of a real CUDA step with a measured step time, got "
                             f"device {device or '?'} and step_seconds {rec.totals.get('step_seconds')}; "
                             f"record one with: torchledger audit model.py --device cuda --format json")
        name = rec.meta.get("gpu")
        if not name:
            unnamed += 1
        else:
            try:
                measured_on = get_gpu(name).name
            except (KeyError, ValueError):
                measured_on = None
            if measured_on != part.name:
                known = (f" ({measured_on})" if measured_on else
                         f" (no known part; if it is {part.name}, add {name!r} to its aliases in TORCHLEDGER_HARDWARE)")
                raise InputError(f"{path}: measured on {name}{known}, not on --gpu {part.name}; calibrate each "
                                 f"part from its own records")
        records.append(rec)
    if unnamed:
        click.echo(f"torchledger: warning: {unnamed} of {len(records)} record(s) do not say which GPU they were "
                   f"measured on (meta.gpu; older records): taken as {part.name}'s", err=True)
    return records


def _bound_notes(fit) -> list:
    return [f"{b['name']} = {b['value']:.4g} is at its {b['bound']} bound ({b['limit']:g}): the records ask "
            f"for a part {'slower' if (b['bound'] == 'lower') != (b['name'] == 'launch_s') else 'faster'} "
            f"than the model allows" for b in fit["at_bounds"]]


def _merged_row(row, fit, bounds) -> dict:
    """The part's row with the fitted keys replaced; the ones calibrate does not fit (tiles, the
    attention kernel, nic, nvlink, ...) stay: the fit was made with them when this file is
    TORCHLEDGER_HARDWARE."""
    row = dict(row or {})
    row["efficiency"] = {**(row.get("efficiency") or {}), **fit["efficiency"]}
    note = (f"torchledger calibrate from {fit['records']} record(s); rms log error "
            f"{fit['rms_log_error_before']:.3f} -> {fit['rms_log_error_after']:.3f}")
    if bounds:
        note += f"; at a bound: {', '.join(b['name'] for b in fit['at_bounds'])}"
    row["sources"] = {**(row.get("sources") or {}), "efficiency": note}
    return row


def _write(output, text: str) -> None:
    from ..files import make_folders, write_atomic  # lazy: CLI startup
    try:
        make_folders(output, f"--output {output}")
        write_atomic(output, text)
    except OSError as e:
        raise InputError(f"--output {output}: cannot write ({e.strerror or e})") from None
