"""The small decoder the pipeline tests audit, shared by their files.

llama-tiny with 4 blocks and 4 KV heads, one micro-batch of 2 x 32 tokens, fp32: a block's
forward is 2 x 64 tokens x 50,176 matmul weights = 6,422,528 + attention 4 x 2 x 4 x 32 x 32
x 16 = 524,288: 6,946,816 FLOPs; an activation between stages 2 x 32 x 64 x 4 B = 16,384 B."""
import textwrap

TINY4 = """
    import torch, torchledger
    from torchledger.models import build_model, get_config

    def audit_spec():
        cfg = get_config("llama-tiny").replace(n_kv_heads=4, n_layers=4)
        model = build_model(cfg)
        idx = torch.randint(0, cfg.vocab_size, (2, 32))
        return torchledger.AuditSpec(model, {"idx": idx, "targets": idx})
"""


def write_model(folder, text: str = TINY4, name: str = "tiny4.py") -> str:
    """``text`` (an indented model file) written as ``folder/name``; its path."""
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return str(path)
