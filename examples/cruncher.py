"""The course's deep linear "Cruncher": 4 x Linear(128, 128) then Linear(128, 1), SGD.

Params = D*D*L + D = 128*128*4 + 128 = 65,664. Forward FLOPs = 2*B*D*(D*L + 1).
"""
import torch

import torchledger
from torchledger.models import build_model, get_config


def audit_spec():
    cfg = get_config("cruncher")
    model = build_model(cfg)
    x = torch.randn(32, cfg.dim)
    return torchledger.AuditSpec(model, x, loss_fn=lambda out, inputs: out.pow(2).mean(),
                                 optimizer=lambda params: torch.optim.SGD(params, lr=0.01))
