"""
The optimizer, chosen apart from how it is sharded: which parameters form which group, and the
factory that builds the optimizer over what a sharding mode updates.

train_gpt2.py takes the groups from the model (param_groups) and hands them, with make_optimizer,
to its sharding mode (sharding.py). The mode calls make_optimizer on its view of the groups: the
whole parameters (ddp), this rank's flat slices of them (zero2) or DTensors (fsdp), with the
mode's `matrices`, which lets Muon's owner of a matrix reach all of it. AdamW is element-wise, so
every view computes the same update; Muon orthogonalizes whole matrices, each on one rank.
"""

import math

import torch
from torch.profiler import record_function

# Newton-Schulz's quintic coefficients, five steps and momentum 0.95 with Nesterov: Keller Jordan's
# Muon (github.com/KellerJordan/Muon), modded-nanogpt's records, nanochat, torch.optim.Muon
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
MUON_MOMENTUM = 0.95


def param_groups(model, config):
    """The parameter groups of `model` (a GPT), each a dict: params, weight_decay, and lr_scale,
    the factor set_lr applies to the schedule's learning rate for that group.

    adamw: as GPT-2 and nanoGPT's configure_optimizers, weight decay on the matmul and embedding
    weights (2-D), none on biases and LayerNorm gains. muon: the transformer blocks' matmul
    weights go to Muon (groups marked "muon", at lr muon_lr, their last), c_attn's as three
    matrices (q, k, v: "splits" 3), as modded-nanogpt and nanochat split them; the tied
    wte/lm_head, wpe, biases and gains stay with AdamW.
    """
    blocks = model.transformer.h
    matrices = [p for p in blocks.parameters() if p.dim() == 2] if config.optimizer == "muon" else []
    to_muon = set(map(id, matrices))
    adamw = [p for p in model.parameters() if p.requires_grad and id(p) not in to_muon]
    qkv = {id(block.attn.c_attn.weight) for block in blocks}
    groups = [
        {"params": [p for p in adamw if p.dim() >= 2], "weight_decay": config.weight_decay,
         "lr_scale": 1.0},
        {"params": [p for p in adamw if p.dim() < 2], "weight_decay": 0.0, "lr_scale": 1.0},
    ]
    for splits in (1, 3):
        params = [p for p in matrices if (id(p) in qkv) == (splits == 3)]
        if params:
            groups.append({"params": params, "muon": True, "splits": splits, "weight_decay": 0.0,
                           "lr_scale": config.muon_lr / config.max_lr if config.max_lr else 0.0})
    return groups


def make_optimizer(groups, matrices, config, device):
    """torch.optim.AdamW (Loshchilov & Hutter 2019) over `groups`, with config's lr and betas,
    eps 1e-8 as GPT-3, and the fused CUDA kernel on GPUs; with Muon groups (which come last),
    AdamW and Muon over `matrices` (a sharding mode's, see Muon) stepped as one (Chain)."""
    adamw = torch.optim.AdamW([g for g in groups if not g.get("muon")], lr=config.max_lr,
                              betas=(config.beta1, config.beta2), eps=1e-8,
                              fused=device.type == "cuda")
    muon = [g for g in groups if g.get("muon")]
    return Chain(adamw, Muon(muon, matrices, lr=config.muon_lr)) if muon else adamw


def orthogonalize(G, steps=NS_STEPS, eps=1e-7):
    """The nearest semi-orthogonal matrix to each of G's (S, m, n) matrices, approximately: the
    quintic Newton-Schulz iteration of Muon (Jordan et al. 2024), in bfloat16, as torch.optim.Muon's
    _zeropower_via_newtonschulz but over a batch. Its singular values come out in about
    [0.7, 1.2], not exactly 1, which does not hurt training (ibid.). Returns (S, m, n) bfloat16."""
    a, b, c = NS_COEFFICIENTS
    X = G.bfloat16()
    tall = X.size(-2) > X.size(-1)
    if tall:  # iterate on the wide side: X @ X^T is then the smaller Gram matrix
        X = X.mT
    X = X / torch.linalg.matrix_norm(X, keepdim=True).clamp(min=eps)  # spectral norm <= 1
    for _ in range(steps):
        A = X @ X.mT
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)  # b A + c A^2
        X = torch.baddbmm(X, B, X, beta=a)  # a X + B X
    return (X.mT if tall else X).contiguous()


class Muon(torch.optim.Optimizer):
    """Muon, MomentUm Orthogonalized by Newton-Schulz (Jordan et al. 2024): SGD with Nesterov
    momentum whose update is orthogonalize() of each matrix, scaled by sqrt(max(1, rows / cols)),
    with decoupled weight decay: torch.optim.Muon's step (adjust_lr_fn "original"), for
    matrices that a sharding mode may split over ranks.

    Each param in `params` is this rank's view of a matrix (or of `splits` matrices stacked by
    rows, as c_attn's q, k and v). Momentum is element-wise, so every rank updates the momentum
    buffer (shaped as its view: sharded where the view is) and the Nesterov update of its view.
    Each matrix has one owner rank, chosen so that the ranks' Newton-Schulz work is balanced;
    `matrices` (sharding.py: Replicas for ddp, Pieces for zero2 and fsdp) moves the views'
    updates to the owner, which orthogonalizes the whole matrix once, and hands each rank its
    view of the result. Every rank must call step(): it is a collective.
    """

    def __init__(self, params, matrices, lr, momentum=MUON_MOMENTUM, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                                      splits=1))
        self.matrices = matrices
        cost, self.owner = [0.0] * matrices.world_size, {}  # greedy: the least loaded rank next
        by_cost = sorted(((group["splits"], p) for group in self.param_groups for p in group["params"]),
                         key=lambda item: -self.flops(item[0], matrices.shape(item[1])))
        for splits, p in by_cost:
            rank = cost.index(min(cost))
            self.owner[p] = rank
            cost[rank] += self.flops(splits, matrices.shape(p))

    @staticmethod
    def flops(splits, shape):
        """Newton-Schulz's matmul work, up to a constant: m * n * min(m, n) per matrix."""
        m, n = shape[0] // splits, shape[1]
        return splits * m * n * min(m, n)

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every matrix. `closure` is torch.optim's argument, which
        torch.distributed.checkpoint passes (as None) and Muon does not use."""
        sent = []
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                grad, buf = local(p.grad), local(state["momentum_buffer"])
                buf.lerp_(grad, 1 - group["momentum"])
                update = grad.lerp(buf, group["momentum"])  # Nesterov
                sent.append((p, group, self.matrices.to_owner(update.bfloat16(), p, self.owner[p])))
        returned = []
        for p, group, gathered in sent:  # the owner orthogonalizes each as it arrives
            whole = gathered()
            if whole is not None:
                with record_function("newton_schulz"):
                    splits = group["splits"]
                    whole = orthogonalize(whole.view(splits, -1, whole.size(-1))).view_as(whole)
            returned.append(self.matrices.from_owner(whole, p, self.owner[p]))
        for (p, group, _), received in zip(sent, returned):
            rows, cols = self.matrices.shape(p)
            scale = math.sqrt(max(1.0, rows / group["splits"] / cols))
            param = local(p)
            param.mul_(1 - group["lr"] * group["weight_decay"])
            param.add_(received(), alpha=-group["lr"] * scale)


def local(t):
    """A DTensor's local shard (fsdp); any other tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


class Chain:
    """Several optimizers stepped as one, over disjoint parameters (AdamW and Muon, as nanochat
    pairs them). param_groups, state and state_dict() number parameters as one torch optimizer
    over all their groups in order would; iterating gives the optimizers
    (torch.distributed.checkpoint takes a list of them)."""

    def __init__(self, *optimizers):
        self.optimizers = optimizers

    def __iter__(self):
        return iter(self.optimizers)

    @property
    def param_groups(self):
        return [group for opt in self.optimizers for group in opt.param_groups]

    @property
    def state(self):
        return {p: s for opt in self.optimizers for p, s in opt.state.items()}

    def zero_grad(self):
        for opt in self.optimizers:
            opt.zero_grad()

    def step(self):
        for opt in self.optimizers:
            opt.step()

    def state_dict(self):
        state, groups, offset = {}, [], 0
        for opt in self.optimizers:
            inner = opt.state_dict()
            state.update({i + offset: s for i, s in inner["state"].items()})
            groups += [{**g, "params": [i + offset for i in g["params"]]} for g in inner["param_groups"]]
            offset += sum(len(g["params"]) for g in opt.param_groups)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict):
        offset, first = 0, 0
        for opt in self.optimizers:
            n = sum(len(g["params"]) for g in opt.param_groups)
            groups = state_dict["param_groups"][first:first + len(opt.param_groups)]
            opt.load_state_dict({
                "state": {i - offset: s for i, s in state_dict["state"].items() if offset <= i < offset + n},
                "param_groups": [{**g, "params": [i - offset for i in g["params"]]} for g in groups]})
            offset, first = offset + n, first + len(opt.param_groups)


def set_lr(optimizer, lr):
    """Sets each group's learning rate to lr times its lr_scale."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)  # checkpoints of before 2026-11-23 lack it


def state_bytes(optimizer):
    """Bytes of optimizer state this rank holds (of a DTensor, its local shard)."""
    tensors = [local(t) for state in optimizer.state.values() for t in state.values()
               if torch.is_tensor(t)]
    return sum(t.numel() * t.element_size() for t in tensors)
