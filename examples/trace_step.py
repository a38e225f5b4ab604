"""Trace one training step of a tiny GPT on the CPU and print the per-layer report.

The Python API (`python examples/trace_step.py`), not a file for `torchledger audit`.
"""
import torch

import torchledger
from torchledger.models import build_model, example_inputs


def main():
    torch.manual_seed(0)
    B, T = 4, 64
    model = build_model("gpt2-tiny")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = example_inputs("gpt2-tiny", batch=B, seq_len=T)

    with torchledger.trace(model, optimizer=opt, tokens=B * T) as t:
        loss = model(**batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    print(t.report())


if __name__ == "__main__":
    main()
