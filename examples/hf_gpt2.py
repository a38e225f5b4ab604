"""Hugging Face GPT-2 small built from its config (no download): 124,439,808 parameters.

Needs `pip install transformers` (the `examples` extra). Batch 1 x 1024 tokens, AdamW:
training FLOPs per token = 6N + 12*L*T*d (PaLM's count), N including the tied LM head.
"""
import torch

import torchledger


def audit_spec():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_positions=1024, n_embd=768, n_layer=12, n_head=12, vocab_size=50257,
                        attn_implementation="sdpa",
                        use_cache=False)    # training: no K/V cache in the output (TL-MEM-001)
    model = GPT2LMHeadModel(config)
    ids = torch.randint(0, config.vocab_size, (1, 1024))
    return torchledger.AuditSpec(model, {"input_ids": ids, "labels": ids})
