"""What the plan tests share: a layout audited through the command line, as a user reproduces
a plan's row from its ``audit_args``."""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli_audit(path, gpus, args):
    """(predicted step seconds, peak bytes) of ``torchledger audit PATH --gpu h100
    --world-size GPUS ARGS`` run in a fresh process."""
    proc = subprocess.run([sys.executable, "-m", "torchledger", "audit", path, "--gpu", "h100", "--world-size",
                           str(gpus), *args, "--format", "json", "--fail-on", "never"],
                          capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=REPO), cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-500:]
    rec = json.loads(proc.stdout)
    return rec["predictions"]["step_time"]["seconds"], rec["totals"]["peak_bytes"]
