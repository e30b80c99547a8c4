"""
The optimizer, chosen apart from how it is sharded: which parameters form which group, and the
factory that builds the optimizer over what a sharding mode updates.

train_gpt2.py takes the groups from the model (param_groups) and hands them, with make_optimizer,
to its sharding mode (sharding.py). The mode calls make_optimizer on its view of the groups: the
whole parameters (ddp), this rank's flat slices of them (zero2) or DTensors (fsdp). AdamW is
element-wise, so every view computes the same update. docs/architecture.md says how a matrix-wise
optimizer (Muon) joins.
"""

import torch


def param_groups(model, config):
    """The parameter groups of `model`, as GPT-2 and nanoGPT's configure_optimizers make them:
    weight decay on the matmul and embedding weights (2-D), none on biases and LayerNorm gains.

    Each group is a dict: params, weight_decay, and lr_scale, the factor set_lr applies to the
    schedule's learning rate for that group.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": config.weight_decay,
         "lr_scale": 1.0},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "lr_scale": 1.0},
    ]


def make_optimizer(groups, config, device):
    """torch.optim.AdamW (Loshchilov & Hutter 2019) over `groups`, with config's lr and betas,
    eps 1e-8 as GPT-3, and the fused CUDA kernel on GPUs."""
    return torch.optim.AdamW(groups, lr=config.max_lr, betas=(config.beta1, config.beta2),
                             eps=1e-8, fused=device.type == "cuda")


def set_lr(optimizer, lr):
    """Sets each group's learning rate to lr times its lr_scale."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)  # checkpoints of before 2026-11-23 lack it


def state_bytes(optimizer):
    """Bytes of optimizer state this rank holds (of a DTensor, its local shard)."""
    tensors = [t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
    tensors = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in tensors)
