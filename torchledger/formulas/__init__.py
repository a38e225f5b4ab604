"""Closed forms: pure functions of hyperparameters, no torch. ``torchledger estimate`` prints
them, the analyzers compare traced steps with them, the tests check them by hand.

One topic per module:

* :mod:`.params` - exact parameter counts, the 12*L*d^2 + V*d approximation, matmul N.
* :mod:`.flops` - C = 6ND, the attention term (dense and causal-halved), training time.
* :mod:`.memory` - static training bytes per parameter by optimizer x precision, ZeRO, and
  per rank of a mesh (FSDP shard group, replicate group, tensor parallel).
* :mod:`.activations` - Korthikanti per-layer activation bytes (Table 2's rows: TP, TP+SP,
  selective and full recompute; PyTorch's SP), a layer's saved tensors by name (Korthikanti's
  GPT layer, a Llama block under tp/sp/cp), recomputation.
* :mod:`.inference` - KV cache and the bandwidth-bound decode step.
* :mod:`.hardware` - GPU memory, bandwidth and peak FLOP/s per dtype.

Conventions everywhere: FLOP = 2 x multiply-add; GB = 1e9 bytes, GiB = 2**30 bytes;
counts are exact ints where the inputs are whole numbers.

    >>> from torchledger.formulas import count_params, training_flops
    >>> training_flops(175e9, 300e9)
    315000000000000000000000
"""
from .activations import (ActivationMemory, activation_memory, korthikanti_layer_bytes, korthikanti_layer_terms,
                          korthikanti_table2, llama_block_terms, pytorch_sp_layer_bytes)
from .flops import TrainingTime, attention_flops_per_token, training_flops, training_time
from .hardware import GPUSpec, get_gpu, known_gpus, register_gpu
from .inference import DecodeEstimate, KVCache, decode_step, kv_cache
from .memory import (OPTIMIZERS, PRECISIONS, StaticMemory, bytes_per_param, max_params,
                     static_memory, weight_bytes, mesh_groups, static_per_rank_closed_form)
from .params import ParamCount, count_params, params_12ld2

__all__ = [
    "ParamCount", "count_params", "params_12ld2",
    "training_flops", "attention_flops_per_token", "TrainingTime", "training_time",
    "OPTIMIZERS", "PRECISIONS", "StaticMemory", "bytes_per_param", "static_memory",
    "max_params", "weight_bytes",
    "ActivationMemory", "activation_memory", "korthikanti_layer_bytes", "korthikanti_table2",
    "pytorch_sp_layer_bytes", "korthikanti_layer_terms", "llama_block_terms", "mesh_groups", "static_per_rank_closed_form",
    "KVCache", "kv_cache", "DecodeEstimate", "decode_step",
    "GPUSpec", "get_gpu", "known_gpus", "register_gpu",
]
