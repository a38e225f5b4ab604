"""Hugging Face Llama-2-7B built from its config (no download), batch 1 x 2048, fp32 AdamW.

Needs `pip install transformers`. Audit it on fake tensors (the default): no memory is
touched, so it runs on a laptop: `torchledger audit examples/hf_llama2_7b.py --steps 1`.
"""
import torch

import torchledger


def audit_spec():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                         max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
                         attn_implementation="sdpa",
                         use_cache=False)   # training: no K/V cache (2 GiB here) in the output (TL-MEM-001)
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, config.vocab_size, (1, 2048))
    return torchledger.AuditSpec(model, {"input_ids": ids, "labels": ids})
