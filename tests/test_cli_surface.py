"""The command-line surface is a contract (README's command line): the flags users rely on must
exist, and any new flag is a deliberate choice (torchtitan's test_no_new_cli_options).
Adding one: update SURFACE here in the same commit, and say why in the message."""
from __future__ import annotations

import click

from torchledger.cli import cli

SURFACE = {
    'audit': ['--baseline', '--checkpointing', '--compiled', '--depth', '--device', '--entry', '--fail-on', '--format', '--global-batch', '--gpu', '--ignore', '--kernels', '--link-bandwidth', '--memory-snapshot', '--mesh', '--mfu', '--micro-batch-size', '--micro-batches', '--output', '--peak-flops', '--precision', '--schedule', '--sequence-parallel', '--steps', '--timeout', '--timing-steps', '--virtual-stages', '--world-size'],
    'calibrate': ['--compiled', '--gpu', '--output'],
    'estimate decode': ['--batch', '--dtype', '--gpu', '--json', '--matmul-params', '--params', '--preset'],
    'estimate kv-cache': ['--batch', '--dtype', '--head-dim', '--json', '--kv-heads', '--layers', '--preset', '--tokens'],
    'estimate memory': ['--gpu', '--gpu-memory', '--gpus', '--json', '--optimizer', '--params', '--precision', '--preset', '--zero'],
    'estimate params': ['--bias', '--ffn', '--heads', '--hidden', '--json', '--kv-heads', '--layers', '--mlp', '--no-bias', '--no-tie-embeddings', '--norm', '--positions', '--preset', '--tie-embeddings', '--vocab'],
    'estimate train': ['--dtype', '--gpu', '--gpus', '--json', '--mfu', '--params', '--peak-flops', '--preset', '--price', '--seq-len', '--tokens'],
    'lint': ['--fail-on', '--format'],
    'plan': ['--checkpointing', '--dims', '--format', '--global-batch', '--global-tokens', '--gpu', '--gpus', '--jobs', '--kernels', '--max-memory', '--precision', '--schedules', '--seq', '--sequence-parallel', '--top'],
    'report': ['--depth', '--fail-on', '--format', '--output'],
    'snapshot': ['--format', '--output', '--top', '-o'],
}

#: What INTERFACE.md names; these must never go away.
INTERFACE = {
    "estimate params": ["--preset", "--vocab", "--hidden", "--layers", "--heads", "--kv-heads", "--ffn",
                        "--mlp", "--norm", "--bias", "--no-bias", "--tie-embeddings",
                        "--no-tie-embeddings", "--positions", "--json"],
    "estimate train": ["--params", "--tokens", "--gpu", "--gpus", "--mfu", "--dtype", "--peak-flops",
                       "--json"],
    "estimate memory": ["--params", "--optimizer", "--precision", "--gpus", "--gpu", "--gpu-memory",
                        "--zero", "--json"],
    "estimate kv-cache": ["--layers", "--kv-heads", "--head-dim", "--tokens", "--batch", "--dtype",
                          "--json"],
    "estimate decode": ["--params", "--gpu", "--dtype", "--batch", "--json"],
    "audit": ["--entry", "--device", "--steps", "--format", "--output", "--fail-on", "--baseline",
              "--peak-flops", "--gpu", "--world-size", "--mesh", "--micro-batches", "--virtual-stages",
              "--checkpointing", "--precision", "--kernels"],
    "lint": ["--format", "--fail-on"],
    "plan": ["--gpu", "--gpus", "--global-batch", "--global-tokens", "--seq", "--top", "--precision", "--kernels",
             "--max-memory", "--dims", "--checkpointing", "--schedules", "--jobs", "--format"],
    "report": ["--format"],
    "snapshot": ["--format"],
}


def surface() -> dict:
    ctx = click.Context(cli)

    def walk(cmd, path):
        out = {}
        if isinstance(cmd, click.Group):
            for name in cmd.list_commands(ctx):
                out.update(walk(cmd.get_command(ctx, name), path + [name]))
        else:
            out[" ".join(path)] = sorted(o for p in cmd.params for o in p.opts + p.secondary_opts
                                         if o.startswith("-"))
        return out
    return walk(cli, [])


def test_interface_flags_exist():
    now = surface()
    for command, flags in INTERFACE.items():
        assert command in now, command
        missing = set(flags) - set(now[command])
        assert not missing, f"{command} lost {sorted(missing)}"


def test_no_new_cli_options():
    assert surface() == SURFACE
