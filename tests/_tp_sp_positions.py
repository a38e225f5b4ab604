"""The standard plan's tensor + sequence parallelism (``--sequence-parallel on``) on a GPT with learned positions, on two
real gloo ranks, against the same model whole on each rank: equal loss, equal gradients of the
position table, the token table and a block's weights. For tests/test_plan_sp_positions.py.

    torchrun --nproc_per_node 2 tests/_tp_sp_positions.py OUT

Rank 0 writes OUT/result.json: {"loss": [whole, parallel], "grad_err": {name: max |diff|},
"notes": [the plan's notes]}."""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist


def main(out: str) -> None:
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh
    from torchledger.models.config import TransformerConfig
    from torchledger.models.transformer import Transformer
    from torchledger.parallel.layout import Layout
    from torchledger.parallel.plan import apply_standard_plan

    cfg = TransformerConfig(vocab_size=96, d_model=32, n_layers=2, n_heads=4, n_positions=16, max_seq_len=16,
                            tie_embeddings=False)
    torch.manual_seed(0)
    whole = Transformer(cfg)
    model = Transformer(cfg)
    model.load_state_dict(whole.state_dict())
    idx = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))

    loss_whole = whole(idx, idx)
    loss_whole.backward()

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    model, notes = apply_standard_plan(model, mesh, Layout(dims=(("tp", 2),), sequence_parallel=True), seq_len=16)
    loss = model(idx, idx)
    loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
    loss.backward()

    errs = {}
    for name in ("pos_emb.weight", "tok_emb.weight", "blocks.0.attn.q_proj.weight", "blocks.1.mlp.up_proj.weight",
                 "blocks.0.attn_norm.weight"):
        g = model.get_parameter(name).grad
        g = g.full_tensor() if hasattr(g, "full_tensor") else g
        errs[name] = float((g - whole.get_parameter(name).grad).abs().max())
    if dist.get_rank() == 0:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump({"loss": [float(loss_whole), float(loss)], "grad_err": errs, "notes": notes}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
