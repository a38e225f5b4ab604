"""Checks over step records: ``check_x(records, options) -> list[Finding]``.

Every check is a pure function over plain records, so it also runs offline on a record
loaded from JSON. ``ALL_CHECKS`` lists them; ``run_checks`` runs them all.
"""
from __future__ import annotations

from ..record import Finding
from .comm import check_comm_steps
from .compare import check_comparisons
from .copies import check_copies
from .fit import check_gpu_fit
from .interconnect import check_comm_time
from .leaks import check_leaks
from .mfu import check_mfu
from .outputs import check_output_cache
from .precision import check_precision
from .snapshot import check_snapshot

__all__ = ["ALL_CHECKS", "run_checks", "check_uncounted_ops", "check_fake_kernel_gaps",
           "check_tracer_warnings", "FAKE_KERNEL_GAPS", "may_be_matmul"]


#: Words of an op name (split at ``_``) that say it may multiply matrices: the matmul-class
#: work ``totals.flops`` counts (mm, convolution, attention, fused RNNs) or linear algebra and
#: FFTs built of it. ``upsample_bilinear2d`` has the word ``bilinear2d``, not ``bilinear``.
_MATMUL_WORDS = frozenset("""
    mm bmm mv dot vdot matmul linear bilinear trilinear einsum tensordot kron gemm gemv addr ger
    outer attention attn sdpa mha transformer linalg cholesky solve lstsq qr svd lu inverse inv
    pinv det slogdet logdet triangular geqrf ormqr orgqr householder cdist pdist matrix
    int4pack int8pack stft istft
""".split())
_MATMUL_PREFIXES = ("conv", "fft", "ifft", "rfft", "irfft", "hfft", "eig", "lstm", "gru", "rnn")
#: Namespaces whose ops are named plainly enough for the words above to decide; an op of any
#: other (a custom kernel, ``mylib::fused_ffn``) may multiply matrices whatever its name.
_NAMED_NAMESPACES = frozenset({"aten", "torchvision", "prims", "quantized"})


def may_be_matmul(op: str) -> bool:
    """Whether an uncounted op (``aten.hardswish.default``) may do matmul-class work, so that
    leaving it out makes ``totals.flops`` a lower bound. Judged by name: an aten or
    torchvision op whose name has none of :data:`_MATMUL_WORDS` (pooling, upsampling,
    activations and their backward, sorting, ROI align) does not; an op of another namespace
    always may.

        >>> may_be_matmul("aten.upsample_bilinear2d.vec"), may_be_matmul("aten._linalg_svd.default")
        (False, True)
    """
    parts = str(op).split(".")
    if len(parts) < 2 or parts[0] not in _NAMED_NAMESPACES:
        return True
    words = [w for w in parts[1].lower().split("_") if w]
    return any(w in _MATMUL_WORDS or w.startswith(_MATMUL_PREFIXES) or w.endswith(("mm", "mv"))
               for w in words)


def _listed(ops) -> str:
    shown = ", ".join(f"{u['op']} x{u['count']}" for u in ops[:5])
    return shown + (f" and {len(ops) - 5} more" if len(ops) > 5 else "")


def check_uncounted_ops(records, options=None) -> list:
    """TL-FLOP-001 (info): ops with no FLOP formula. Only those that may do matmul-class work
    (:func:`may_be_matmul`) make the FLOP totals a lower bound (the totals count matmul-class
    work alone); the others are listed as leaving the element-wise figure out, nothing more."""
    if not records:
        return []
    rec = records[-1]
    if not rec.uncounted_ops:
        return []
    matmul = [u for u in rec.uncounted_ops if may_be_matmul(u["op"])]
    other = [u for u in rec.uncounted_ops if not may_be_matmul(u["op"])]
    measured = sum(u["count"] for u in rec.uncounted_ops)
    if matmul:
        rest = (f"; {len(other)} other op kind(s) without a formula are not matmul-class and leave the "
                f"totals as they are: {_listed(other)}") if other else ""
        return [Finding("TL-FLOP-001", "info",
                        f"{len(matmul)} op kind(s) that may do matmul-class work have no FLOP formula and "
                        f"are not in the totals: {_listed(matmul)}; the FLOP totals are a lower bound{rest}",
                        measured=measured,
                        hint="a custom op can be given one with torch.utils.flop_counter."
                             "register_flop_formula; otherwise report the op")]
    return [Finding("TL-FLOP-001", "info",
                    f"{len(other)} op kind(s) have no FLOP formula: {_listed(other)}; none is "
                    f"matmul-class, so the FLOP totals (matmul-class work only) are not changed by them; "
                    f"the element-wise figure leaves them out",
                    measured=measured)]


#: Ops whose fake/meta kernel (``torch._meta_registrations``) returns an empty buffer where
#: the real kernel returns one that autograd saves for backward: on fake or meta tensors the
#: activation and peak bytes leave that buffer out.
FAKE_KERNEL_GAPS = {
    "mkldnn_rnn_layer": "oneDNN's RNN workspace",
    "_cudnn_rnn": "cuDNN's RNN reserve space",
    "miopen_rnn": "MIOpen's RNN reserve space",
}


def check_fake_kernel_gaps(records, options=None) -> list:
    """TL-FAKE-001 (warning): a fake/meta step ran an op whose fake kernel under-reports what
    the real kernel keeps for backward, so activation and peak bytes are low."""
    if not records:
        return []
    rec = records[-1]
    device = str(rec.meta.get("device") or "")
    if not (device == "meta" or device.startswith("fake")):
        return []
    seen: dict = {}
    for o in rec.ops:
        if o.get("phase") != "forward":
            continue
        name = str(o.get("op", "")).split(".", 2)
        if len(name) >= 2 and name[1] in FAKE_KERNEL_GAPS:
            first = seen.setdefault(name[1], [0, o.get("module")])
            first[0] += o.get("count", 0)
    return [Finding("TL-FAKE-001", "warning",
                    f"on {device} tensors aten.{op} (x{n}) returns an empty buffer where the real "
                    f"kernel keeps {FAKE_KERNEL_GAPS[op]} for backward: activation and peak bytes "
                    f"leave it out", module=module, measured=n,
                    hint="audit with --device cpu (or cuda) to measure it")
            for op, (n, module) in seen.items()]


def check_tracer_warnings(records, options=None) -> list:
    """TL-TRACE-001 (warning): the tracer could not record part of the step."""
    out = []
    for rec in records[-1:]:
        for w in rec.warnings[:3]:
            out.append(Finding("TL-TRACE-001", "warning", w))
    return out


def check_allocator(records, options=None) -> list:
    """TL-CUDA-001/002 from the CUDA allocator's snapshot of the last step (CUDA only)."""
    if not records:
        return []
    alloc = records[-1].memory.get("allocator") or {}
    if not alloc.get("available"):
        return []
    return check_snapshot(alloc["summary"], options or {})


def _all():
    return [check_comparisons, check_copies, check_leaks, check_output_cache, check_gpu_fit,
            check_comm_time, check_mfu, check_allocator, check_uncounted_ops, check_fake_kernel_gaps,
            check_tracer_warnings, check_comm_steps, check_precision]


ALL_CHECKS = _all()


def run_checks(records, options=None, checks=None) -> list:
    """Run every check (or ``checks``) over ``records``; findings sorted by severity."""
    order = {"error": 0, "warning": 1, "info": 2}
    out = []
    for check in checks or ALL_CHECKS:
        out.extend(check(list(records), options or {}))
    return sorted(out, key=lambda f: order[f.severity])
