"""``torchledger plan FILE.py --gpu NAME --gpus N --global-batch G``: the fastest layout that fits.

Thin: validate every flag (before torch is imported), call ``torchledger.plan.search.search``,
render. Exit codes: 0 a plan that fits was found, 1 none fits, 2 bad usage or input.
"""
from __future__ import annotations

import os

import click

from ..parallel.layout import KERNELS, PRECISIONS
from .types import FRACTION, GLOBAL_BATCH, ON_OFF, POS_INT, InputError, PlainNumber, gpu_part, on_off

__all__ = ["plan"]

FORMATS = ("table", "json", "markdown", "html")
#: GPUs a plan may search: the simulated world's own cap.
MAX_GPUS = 1 << 20


def _names(text: str, flag: str) -> tuple:
    return tuple(x.strip().lower() for x in str(text).split(",") if x.strip())


@click.command()
@click.argument("file", metavar="FILE.py")
@click.option("--gpu", required=True, help="The part to plan for (e.g. H100): its memory and speed.")
@click.option("--gpus", type=PlainNumber(1, MAX_GPUS, example="64"), required=True, help="GPUs to lay the step over.")
@click.option("--global-batch", type=GLOBAL_BATCH, default=None, help="Sequences per optimizer step, all ranks.")
@click.option("--global-tokens", type=GLOBAL_BATCH, default=None,
              help="Tokens per optimizer step, all ranks (the global batch is T / the sequence length).")
@click.option("--seq", type=POS_INT, default=None,
              help="Sequence length that --global-tokens divides by; must be the model file's own (the "
                   "traced step's) [default: the model file's].")
@click.option("--top", type=POS_INT, default=10, show_default=True, help="Plans to print.")
@click.option("--precision", type=click.Choice(list(PRECISIONS)), default="bf16-mixed", show_default=True,
              help="The standard plan's precision (as audit --precision).")
@click.option("--kernels", type=click.Choice(list(KERNELS)), default="eager", show_default=True,
              help="The kernels the step is priced as (as audit --kernels).")
@click.option("--sequence-parallel", type=click.Choice(ON_OFF), default=None,
              help="Every layout's tensor parallelism with or without sequence parallelism (as audit "
                   "--sequence-parallel) [default: the standard plan's choice for the model].")
@click.option("--max-memory", type=FRACTION, default=0.9, show_default=True,
              help="Fraction of the part's memory a rank's peak may use.")
@click.option("--dims", default="dp,tp,pp", show_default=True,
              help="Mesh dimensions to search, from dp, dp_replicate, tp, pp, cp, ep.")
@click.option("--checkpointing", default="none,full", show_default=True,
              help="Activation checkpointing policies to try (audit --checkpointing's names).")
@click.option("--schedules", default="1f1b", show_default=True,
              help="Pipeline schedules to try when pp > 1, from 1f1b, interleaved (virtual stages 2-4), "
                   "gpipe, zero-bubble.")
@click.option("--jobs", type=PlainNumber(1, 256, example="2"), default=1, show_default=True,
              help="Layouts traced at once, each in its own forked process.")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="table", show_default=True)
def plan(file, gpu, gpus, global_batch, global_tokens, seq, top, precision, kernels, max_memory, dims,
         checkpointing, schedules, jobs, fmt, sequence_parallel=None):
    """Search the layouts of the model in FILE.py on N GPUs: every mesh of the asked dimensions
    the model allows, the micro-batch size and count that make the global batch, the
    checkpointing policy and the pipeline schedule; price each as `audit` would (its
    audit_args reproduce it) and print the fastest that fit, with what separates each from
    the best and the rejected counted by reason."""
    if (global_batch is None) == (global_tokens is None):
        raise click.UsageError("give one of --global-batch G or --global-tokens T")
    if seq is not None and global_tokens is None:
        raise click.UsageError("--seq divides --global-tokens; give it with --global-tokens, or drop it")
    gpu_part(gpu)
    if max_memory <= 0:
        raise click.BadParameter(f"expected a fraction above 0 and at most 1, got {max_memory:g}",
                                 param_hint="--max-memory")
    lists = {"dims": _names(dims, "--dims"), "checkpointing": _names(checkpointing, "--checkpointing"),
             "schedules": _names(schedules, "--schedules")}
    from ..plan.space import check_choices  # lazy: CLI startup (before torch)
    try:
        check_choices(lists["dims"], lists["checkpointing"], lists["schedules"], precision, kernels)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    if not os.path.isfile(file):
        raise InputError(f"{file}: no such file; expected a Python model file that defines audit_spec()")
    result = _search(file, gpu, int(gpus), global_batch, global_tokens, seq, lists, precision, kernels,
                     max_memory, top, int(jobs), on_off(sequence_parallel))
    from ..render.plan import render_plan
    click.echo(render_plan(result, fmt))
    return 0 if any(p["fits"] for p in result["plans"]) else 1


def _search(file, gpu, gpus, global_batch, global_tokens, seq, lists, precision, kernels, max_memory, top, jobs,
            sequence_parallel=None):
    from ..audit.engine import stdout_to_stderr
    from ..audit.spec import AuditError  # lazy: CLI startup (before torch)
    from ..plan.evaluate import probe  # lazy: CLI startup (before torch)
    from ..plan.search import search  # lazy: CLI startup (before torch)
    try:
        with stdout_to_stderr():
            if global_tokens is not None:
                global_batch = _batch_of_tokens(probe(file, sequence_parallel=sequence_parallel).seq_len,
                                                global_tokens, seq)
            return search(file, gpu, gpus, global_batch, dims=lists["dims"], checkpointing=lists["checkpointing"],
                          schedules=lists["schedules"], precision=precision, kernels=kernels,
                          max_memory=max_memory, top=top, jobs=jobs, sequence_parallel=sequence_parallel)
    except AuditError as e:
        raise InputError(str(e)) from None


def _batch_of_tokens(model_seq: int, tokens: int, seq) -> int:
    if seq is not None and seq != model_seq:
        raise InputError(f"--seq {seq}: the model file's step is {model_seq} tokens a sequence, and plan traces "
                         f"that step; set the sequence length in the model file, or give --seq {model_seq}")
    if tokens % model_seq:
        raise InputError(f"--global-tokens {tokens:,}: not a multiple of the sequence length {model_seq:,}; "
                         f"give a multiple (e.g. {max(1, tokens // model_seq) * model_seq:,})")
    return tokens // model_seq
