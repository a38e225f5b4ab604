"""What the audit says when the model file's code fails: one line naming the model file's
frame (``where``), what was raised (``raised``), and a hint for the common causes (a device
the model hard-codes, a mesh its heads do not divide, a layer fake tensors cannot run)."""
from __future__ import annotations

import os
import traceback

from .spec import AuditError

__all__ = ["USER_ERRORS", "where", "raised", "step_error", "device_hint", "message_of", "text_of"]


#: What the model file's code may raise that the audit reports as one line (not
#: KeyboardInterrupt: Ctrl-C stops the audit). GeneratorExit too: a BaseException, not an Exception.
USER_ERRORS = (Exception, SystemExit, GeneratorExit)


def device_hint(e: Exception, device: str, world=None) -> str:
    """What to try when a build or step failed because of the device it ran on (``world``: the
    simulated world the step ran in, where only fake tensors run)."""
    name, text = type(e).__name__, text_of(e)
    if device in ("fake", "meta") and "Expected inputs of BF16" in text:
        return (f"; torch's grouped_mm (mixture-of-experts layers) checks for bf16 inputs on {device} "
                f"tensors (only its CPU kernel takes float32): build the model in bf16 "
                f"(torch.set_default_dtype(torch.bfloat16) at the top of audit_spec(), or "
                f"dtype=torch.bfloat16 in its constructor), or use --device cpu; a Hugging Face MoE "
                f"decoder (Mixtral, Qwen2/3-MoE, GPT-OSS, DeepSeek-V2/V3) also runs under the standard "
                f"plan (--precision fp32 or --mesh), which computes its experts with batched matmuls "
                f"under balanced routing")
    if device == "fake" and "Couldn't swap" in text and _memory_format_call(e):
        return ("; fake tensors cannot change a model's memory format in place "
                "(model.to(memory_format=...)): leave the model as built and pass channels_last "
                "inputs (x.to(memory_format=torch.channels_last)): the convolutions then run "
                "channels_last with the numbers of --device cpu; or use --device cpu")
    if device == "fake" and "Couldn't swap" in text:
        return ("; fake tensors cannot convert parameters in place (model.to(dtype)): build the "
                "model in its dtype (torch.set_default_dtype, or dtype= in its constructor) or use "
                "--device meta")
    if device == "fake" and ("Fake" in name or "DataDependent" in name or "DynamicOutputShape" in name):
        return _no_values(world)
    if device == "meta" and ("meta tensor" in text or "DataDependent" in name):
        return "; meta tensors have no values and this reads one: try --device cpu (or --device fake)"
    return ""


def _no_values(world) -> str:
    """What to try when a fake step read a value: another device, except in a simulated world
    (``--world-size``/``--mesh``), which runs on fake tensors only (--device cpu is refused)."""
    if world is None:
        return "; fake tensors have no values: try --device cpu (or --device meta)"
    return ("; fake tensors have no values, and a simulated world (--world-size/--mesh) runs on them "
            "only: keep the value-reading call out of the step, or run real ranks with torchrun and "
            "merge them with `torchledger report rank*.json`")


def _ddp_hint(e: BaseException, device: str, model) -> str:
    """What to do when DistributedDataParallel's unused-parameter search fails on fake tensors:
    its reducer reads, in backward, which parameters the ranks used (the all-reduced
    used-parameter map), a value fake tensors do not have."""
    from torch.nn.parallel import DistributedDataParallel
    if device != "fake" or not isinstance(model, DistributedDataParallel) or "DataDependent" not in type(e).__name__:
        return ""
    flags = [f for f in ("find_unused_parameters", "static_graph") if getattr(model, f, False)]
    if not flags:
        return ""
    return (f"; DistributedDataParallel({', '.join(f + '=True' for f in flags)}) reads in backward which "
            f"parameters the ranks used (its reducer's all-reduced used-parameter map), a value fake tensors "
            f"do not have: audit the step without {' and '.join(flags)} (the same FLOPs and bytes but for "
            f"that map's all-reduce, 4 B a parameter), or run real ranks with torchrun and merge them with "
            f"`torchledger report rank*.json`")


def _memory_format_call(e: BaseException) -> bool:
    """True when a frame of the user's code (not torch's) asked for a memory format conversion."""
    import torch

    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    for frame in traceback.extract_tb(e.__traceback__):
        if os.path.abspath(frame.filename).startswith(torch_dir + os.sep):
            continue
        if "memory_format" in (frame.line or "") or "channels_last" in (frame.line or ""):
            return True
    return False


def _layout_hint(e: BaseException, device: str) -> str:
    """What to do when PyTorch's own pipeline schedules or context parallelism fail on fake
    tensors: torchledger simulates both itself (``--mesh ...,pp=N`` / ``cp=N``)."""
    text = str(e)
    frames = traceback.extract_tb(e.__traceback__)
    if device == "fake" and any("distributed" + os.sep + "pipelining" in fr.filename for fr in frames):
        return ("; PyTorch's pipelining schedules cannot run on fake tensors (their p2p reads values): "
                "drop the schedule from the step and give --mesh with pp=N (e.g. --mesh dp=2,pp=4 "
                "--micro-batches 8): torchledger cuts the blocks into stages and composes the schedule")
    if "does not have a sharding strategy registered" in text:
        if "scaled_dot_product" in text:
            return ("; PyTorch's context_parallel has no sharding rule for the CPU attention kernel fake "
                    "tensors run: drop context_parallel from the step and give --mesh with cp=N and no "
                    "AuditSpec.parallelize (the standard plan all-gathers K/V over cp)")
        return ("; DTensor has no sharding rule for this op: keep it out of DTensor regions (to_local() "
                "around it) or run the plan without that parallel dimension")
    return ""


def step_error(e: BaseException, path: str, device: str, world=None, model=None) -> AuditError:
    name = type(e).__name__
    if isinstance(e, SystemExit):
        return AuditError(f"{where(e, path)}: the training step {raised(e)}; the model, loss_fn and "
                          f"step must return (or raise), not exit")
    split = _mesh_split_hint(e, world, model)
    if split:
        return AuditError(f"{where(e, path)}: {split} (the step raised {name}: {message_of(e)})")
    layout = _layout_hint(e, device) or _ddp_hint(e, device, model)
    if layout:
        return AuditError(f"{where(e, path)}: the step cannot run on {device} tensors ({name}: "
                          f"{message_of(e)}){layout}")
    hint = device_hint(e, device, world)
    if not hint and device == "fake" and "fake" in text_of(e).lower()[:200]:
        hint = "; try --device cpu (or --device meta)" if world is None else _no_values(world)
    if hint:
        return AuditError(f"{where(e, path)}: the step cannot run on {device} tensors ({name}: "
                          f"{message_of(e)}){hint}")
    return AuditError(f"{where(e, path)}: the training step raised {name}: {message_of(e)}; check the "
                      f"inputs your audit_spec() returns against what the model expects")


#: Config fields that tensor parallelism splits: (name, what it is). Ours, then Hugging Face's.
_SPLIT_FIELDS = (("n_heads", "attention heads"), ("n_kv_heads", "key/value heads"),
                 ("num_attention_heads", "attention heads"), ("num_key_value_heads", "key/value heads"),
                 ("d_model", "hidden size"), ("hidden_size", "hidden size"), ("d_ff", "MLP width"),
                 ("intermediate_size", "MLP width"))


def _mesh_split_hint(e: BaseException, world, model) -> str:
    """A shape error under tensor parallelism: which model dimension does not divide which mesh
    dimension (one line), or "" when that is not what happened."""
    text = str(e)
    if world is None or model is None or not (
            ("shape '[" in text and "is invalid for input of size" in text) or "view size is not compatible" in text
            or "does not divide" in text):
        return ""
    try:
        names = tuple(world[1].mesh_dim_names or ())
        shape = tuple(world[0][1])
    except Exception:  # noqa: BLE001
        return ""
    splits = [(n, d) for n, d in zip(names, shape) if n in ("tp", "cp", "ep") and d > 1]
    if not splits:
        return ""
    inner = getattr(model, "module", model)          # DDP's wrapped module
    cfg = getattr(inner, "config", None)
    for dim_name, size in splits:
        for field, what in _SPLIT_FIELDS:
            value = getattr(cfg, field, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0 and value % size:
                ok = [k for k in range(1, value + 1) if value % k == 0 and k <= size * 4][:6]
                return (f"the model's {value} {what} (config.{field}) do not divide by the {dim_name} mesh "
                        f"dimension ({size}): each {dim_name} rank must hold a whole share ({value} % {size} = "
                        f"{value % size}); use a {dim_name} size that divides {value} "
                        f"({', '.join(map(str, ok))}) or a model whose {what} divide by {size}")
    dim_name, size = splits[0]
    return (f"a reshape failed on a rank of the {dim_name} mesh dimension ({size}): a head count or width "
            f"that does not divide by {size}, or a parallelize plan that leaves the modules' head counts "
            f"at the whole model's (divide them by the {dim_name} size, as torchtitan does)")


def where(e: BaseException, path: str) -> str:
    """``file:line`` of the deepest frame in the user's model file (else the deepest user frame)."""
    tb = traceback.extract_tb(e.__traceback__)
    if isinstance(e, SyntaxError) and e.filename:
        return f"{os.path.relpath(e.filename)}:{e.lineno}"
    target = os.path.abspath(path)
    best = None
    for fr in tb:
        if os.path.abspath(fr.filename) == target:
            best = fr
    if best is None:
        import torch
        package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))     # torchledger/, every room
        skip = (os.path.dirname(torch.__file__), package)
        for fr in tb:
            if not fr.filename.startswith(skip):
                best = fr
    return f"{os.path.relpath(best.filename)}:{best.lineno}" if best else path


def raised(e: BaseException) -> str:
    """``raised ValueError: text``, or ``called sys.exit(3)`` for a SystemExit."""
    if isinstance(e, SystemExit):
        code = e.code
        return f"called sys.exit({'' if code is None else _msg_text(repr(code))})"
    return f"raised {type(e).__name__}: {message_of(e)}"


def _msg_text(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= 300 else text[:297] + "..."


def message_of(e: BaseException) -> str:
    text = " ".join(text_of(e).split())
    return text if len(text) <= 300 else text[:297] + "..."


def text_of(e: BaseException) -> str:
    """``str(e)``, or a note when the exception's own ``__str__`` raises."""
    try:
        return str(e)
    except USER_ERRORS as inner:
        return f"<its str() raised {type(inner).__name__}>"
