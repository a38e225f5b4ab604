"""The rule catalogue: every TL-* id a finding can carry, with its title, default severity,
one-paragraph doc and where the docs explain it.

Read by lint (its ``TL-LINT-*`` part), the analyzers (whose findings carry these ids), the
settings (``ignore = [...]`` accepts exactly these ids) and the SARIF writer (rule metadata that
never changes from run to run). Ids are stable: never reuse one.

    >>> from torchledger.rules import RULES
    >>> RULES["TL-LEAK-003"].title
    'Gradients not cleared after the optimizer step'

Pure data: imports nothing from torchledger and nothing heavy.
"""
from __future__ import annotations

from typing import NamedTuple

__all__ = ["Rule", "RULES", "rules_in", "title"]


class Rule(NamedTuple):
    """One rule. Indexing keeps lint's old ``(severity, title, doc)`` order."""

    severity: str
    """Default severity: error, warning or info (some rules lower or raise it per finding)."""
    title: str
    """A fixed one-line title (SARIF ``shortDescription``); never a run's numbers."""
    doc: str
    """What the rule means and what to do, one paragraph."""
    anchor: str
    """Where the docs explain it: a path in the repository with its heading's anchor."""


_FINDINGS = "docs/findings.md#findings-stable-rule-ids"
_LINT_DOCS = "docs/lint-rules.md#"

RULES = {
    'TL-CMP-001': Rule('warning', 'Step FLOPs differ from the 6ND + attention prediction',
                  "The traced step's matmul FLOPs differ from the closed form (6ND plus the attention term; per weight x rows where weights do not all see D tokens; forward plus the gradients made with frozen weights) by more than the tolerance. Not raised for an attention-free (state-space) model: no closed form for its scan.",
                  _FINDINGS),
    'TL-CMP-002': Rule('warning', 'Static memory differs from the optimizer x precision prediction',
                  'Parameters, gradients, optimizer state and master weights measured in the step differ from the optimizer x precision bytes-per-parameter prediction by more than the tolerance.',
                  _FINDINGS),
    'TL-COPY-001': Rule('warning', 'Dtype round trip within one module',
                  'A tensor is cast a -> b -> a inside one module: two copies that change nothing.',
                  _FINDINGS),
    'TL-COPY-002': Rule('warning', 'Same device move repeated within a step',
                  'The same tensor is moved to the same device more than once in a step; move it once and reuse it.',
                  _FINDINGS),
    'TL-COPY-003': Rule('warning', 'Contiguous copy of a permuted tensor that is permuted back',
                  'A .contiguous()/reshape copy of a permuted tensor whose result is permuted back: the copy is needless.',
                  _FINDINGS),
    'TL-COPY-004': Rule('info', "Copies move a large share of the step's bytes",
                  "Copies move more than copy_share of the bytes the step's ops read and write.",
                  _FINDINGS),
    'TL-PREC-001': Rule('warning', 'Matmuls run in fp32 under a 16-bit plan',
                  'More than fp32_matmul_share (1%) of the matmul FLOPs ran in fp32 in a step meant to compute in 16 bits (--precision bf16-mixed/fp16-mixed/bf16, or autocast seen in the step): counted and priced at the fp32 rate.',
                  _FINDINGS),
    'TL-LEAK-001': Rule('warning', 'Live memory grows step after step',
                  'Live bytes at the end of a step grow over three or more traced steps after warm-up.',
                  _FINDINGS),
    'TL-LEAK-002': Rule('warning', 'Tensor kept across steps with its autograd graph',
                  'Tensors of step k are alive at the end of step k+1 together with their autograd graph (a kept loss or output).',
                  _FINDINGS),
    'TL-LEAK-003': Rule('warning', 'Gradients not cleared after the optimizer step',
                  'Gradients are not cleared after optimizer.step() and accumulate into the next step.',
                  _FINDINGS),
    'TL-LEAK-004': Rule('warning', 'Module attribute holding more tensors every step',
                  'A module attribute holds more tensors after every step (a list or dict that grows).',
                  _FINDINGS),
    'TL-MEM-001': Rule('warning', 'Key/value cache returned and kept by a training forward',
                  'A training forward returned a key/value cache (use_cache=True) that stays alive through the optimizer step; a warning when it raises the peak by cache_share (default 1%) or more, else info.',
                  _FINDINGS),
    'TL-MEM-002': Rule('error', "Step peak memory against the GPU's memory",
                  "With --gpu NAME: the step's peak against one GPU's memory: error over it, warning with under 10% to spare (CUDA context, allocator rounding, fragmentation), else info.",
                  _FINDINGS),
    'TL-MFU-001': Rule('warning', 'Model FLOPs utilization below the minimum',
                  'Model FLOPs utilization is below min_mfu (default 0.3).',
                  _FINDINGS),
    'TL-MFU-002': Rule('warning', 'Model FLOPs utilization above 1 (miscount or wrong peak)',
                  'Model FLOPs utilization above 1: a FLOP miscount or a wrong peak FLOP/s.',
                  _FINDINGS),
    'TL-CUDA-001': Rule('warning', 'CUDA allocator fragmentation',
                  'The CUDA caching allocator reserves much more than is allocated and has no large free block.',
                  _FINDINGS),
    'TL-CUDA-002': Rule('warning', 'CUDA allocations never freed across steps',
                  'CUDA allocations made in one step are never freed in the following steps.',
                  _FINDINGS),
    'TL-BUDGET-001': Rule('error', 'Parameters over budget',
                  "The model's parameter count is over max_params.",
                  _FINDINGS),
    'TL-BUDGET-002': Rule('error', 'Peak memory over budget',
                  "The step's peak bytes are over max_peak_bytes.",
                  _FINDINGS),
    'TL-BUDGET-003': Rule('error', 'FLOPs per token over budget',
                  "The step's FLOPs per token are over max_flops_per_token.",
                  _FINDINGS),
    'TL-BASELINE-001': Rule('error', 'Grew over the baseline',
                  'FLOPs, peak, activation bytes or parameters grew over the --baseline record by more than baseline_tolerance.',
                  _FINDINGS),
    'TL-FLOP-001': Rule('info', 'Ops without a FLOP formula',
                  'Ops ran that have no FLOP formula: they are listed as uncounted; when one of them may do matmul-class work (linear algebra, FFT, a custom kernel) the FLOP totals are a lower bound, otherwise only the element-wise figure leaves them out.',
                  _FINDINGS),
    'TL-FAKE-001': Rule('warning', 'Fake kernel drops a workspace kept for backward',
                  'On fake/meta tensors, an op whose fake kernel returns an empty buffer where the real one keeps a workspace for backward (oneDNN/cuDNN/MIOpen RNNs): activation and peak bytes are low.',
                  _FINDINGS),
    'TL-TRACE-001': Rule('warning', 'Part of the step could not be traced',
                  'The tracer could not record part of the step (an op or hook failed); the record covers the rest. Also a warning the record carries: tokens per step (D) guessed from a tensor that is not a token-id sequence (a recommender\'s ids, float rows beside an image).',
                  _FINDINGS),
    'TL-COMM-001': Rule('info', "Communication per step against the closed form",
                  "A distributed step: the bytes this rank sent in collectives against the DDP (one all-reduce of the gradients) or FSDP/ZeRO-3 (all-gather of parameters in forward and backward, reduce-scatter of gradients) closed form, with the gap explained (padding, parameters kept gathered, buckets).",
                  _FINDINGS),
    'TL-COMM-002': Rule('warning', "Communication well over the closed form",
                  "A rank sent more than 1.5x the closed form's bytes: a collective in a loop, an all-reduce of parameters, gathers repeated.",
                  _FINDINGS),
    'TL-NET-001': Rule('info', 'Communication time at the interconnect bandwidth against compute time',
                  "With --gpu NAME in a distributed step: the bytes the step's collectives move (NCCL-tests bus bytes) at the GPU's interconnect bandwidth (NVLink within a node, InfiniBand across nodes), beside compute time at the given MFU; a warning when communication alone takes longer than compute.",
                  _FINDINGS),
    'TL-RANK-001': Rule('warning', "A rank's peak memory stands out from the other ranks'",
                  "torchledger report rank*.json: a rank's peak bytes are more than rank_peak_skew (default 10%) above the median rank's; the job needs memory for its largest rank.",
                  _FINDINGS),
    'TL-RANK-002': Rule('warning', "A rank's step time stands out (a straggler)",
                  "torchledger report rank*.json: a rank's step time is more than rank_time_skew (default 20%) above the median rank's; every collective waits for the slowest rank.",
                  _FINDINGS),
    'TL-RANK-003': Rule('warning', 'FLOPs differ across ranks',
                  'torchledger report rank*.json: FLOPs differ across ranks by more than rank_flops_skew (default 5%) of the smallest (uneven batches or shards).',
                  _FINDINGS),
    'TL-RANK-004': Rule('warning', 'Ranks of the run missing from the merge',
                  "torchledger report rank*.json (or one record of a multi-rank run): ranks of the records' world size have no record (rank 1 of 2 missing), e.g. a rank that failed or was killed before saving; the skew covers the ranks given.",
                  _FINDINGS),
    'TL-LINT-001': Rule('warning', 'Loss tensor kept across iterations',
                  "Appending or summing a tensor that carries an autograd graph (a loss, a model output) in a training loop keeps every step's graph alive: memory grows until OOM. Store loss.item() or loss.detach().",
                  _LINT_DOCS + 'tl-lint-001-loss-tensor-kept-across-iterations-warning'),
    'TL-LINT-002': Rule('error', 'Gradients never cleared',
                  'A loop calls backward() and optimizer.step() but never zero_grad(): gradients add up across steps and the updates grow. Call optimizer.zero_grad(set_to_none=True) every step (or every k steps).',
                  _LINT_DOCS + 'tl-lint-002-gradients-never-cleared-error'),
    'TL-LINT-003': Rule('warning', 'torch.load without weights_only=True',
                  'torch.load(weights_only=False) unpickles arbitrary objects: loading an untrusted checkpoint can run code (warning). Without weights_only it is a portability note (info): torch >= 2.6 defaults to weights_only=True, older versions unpickle; a warning where the file or tree pickles whole modules, which that default fails to load.',
                  _LINT_DOCS + 'tl-lint-003-torchload-without-weights_onlytrue-warning'),
    'TL-LINT-004': Rule('warning', 'Host-device sync in forward',
                  '.item(), .cpu(), .numpy(), .tolist(), print(tensor), branching on a tensor value or torch.cuda.synchronize() inside forward stall the host until the GPU catches up, on every call (host copies are not reported in a file that uses torch.distributed.rpc, which takes CPU tensors).',
                  _LINT_DOCS + 'tl-lint-004-host-device-sync-in-forward-warning'),
    'TL-LINT-005': Rule('info', 'non_blocking copy from pageable memory',
                  'non_blocking=True only overlaps the copy when the source is in pinned memory; from pageable memory it is synchronous. Use DataLoader(pin_memory=True).',
                  _LINT_DOCS + 'tl-lint-005-non_blocking-copy-from-pageable-memory-info'),
    'TL-LINT-006': Rule('info', 'Model moved to a device inside the training loop',
                  'model.to(device) / model.cuda() in the loop walks every parameter each step; move the model once, before building the optimizer.',
                  _LINT_DOCS + 'tl-lint-006-model-moved-to-a-device-inside-the-training-loop-info'),
    'TL-LINT-007': Rule('warning', 'Whole module pickled by torch.save',
                  'torch.save(model) pickles the class by import path: loading needs the same code layout and weights_only=False. Save model.state_dict().',
                  _LINT_DOCS + 'tl-lint-007-whole-module-pickled-by-torchsave-warning'),
    'TL-LINT-008': Rule('warning', 'backward(retain_graph=True) inside a loop',
                  "retain_graph=True keeps the graph's saved tensors alive; in a loop that carries a tensor across steps memory grows each iteration. Detach carried state.",
                  _LINT_DOCS + 'tl-lint-008-backwardretain_graphtrue-inside-a-loop-warning'),
    'TL-LINT-009': Rule('warning', 'Checkpoint without optimizer state',
                  "A checkpoint with the model's state_dict but no optimizer state resumes with fresh optimizer moments, so the resumed run diverges from the original.",
                  _LINT_DOCS + 'tl-lint-009-checkpoint-without-optimizer-state-warning'),
}


def rules_in(prefix: str) -> dict:
    """The rules whose id starts with ``prefix`` (``"TL-LINT-"``), in catalogue order."""
    return {rid: rule for rid, rule in RULES.items() if rid.startswith(prefix)}


def title(rule_id: str) -> str:
    """The rule's fixed title, or the id itself for an id the catalogue does not know."""
    rule = RULES.get(rule_id)
    return rule.title if rule else rule_id
