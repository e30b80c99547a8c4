"""Muon (Jordan et al. 2024) for matrices that data parallelism may split over ranks, and Chain, which steps
AdamW and Muon as one optimizer, as nanochat pairs them. Each parameter is this rank's view of a matrix: the
whole matrix (ddp), a DTensor's dim-0 shard (fsdp), or a flat slice with the matrix's shape as `whole_shape`
(zero2); the rank keeps its view's element-wise momentum. Newton-Schulz needs the whole matrix, so its owner
rank (load-balanced) gathers the views' updates, orthogonalizes and hands each rank its view of the result."""

import math

import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.profiler import record_function

# as in Keller Jordan's Muon (github.com/KellerJordan/Muon), modded-nanogpt, nanochat, torch.optim.Muon
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
MUON_MOMENTUM = 0.95


def orthogonalize(G, steps=NS_STEPS, eps=1e-7):
    """About the nearest semi-orthogonal matrix to each of G's (S, m, n) matrices, as (S, m, n)
    bfloat16 (singular values in about [0.7, 1.2]): torch.optim.Muon's quintic Newton-Schulz, batched."""
    a, b, c = NS_COEFFICIENTS
    X = G.bfloat16()
    tall = X.size(-2) > X.size(-1)
    if tall:  # X @ X^T is then the smaller Gram matrix
        X = X.mT
    X = X / torch.linalg.matrix_norm(X, keepdim=True).clamp(min=eps)  # spectral norm <= 1
    for _ in range(steps):
        A = X @ X.mT
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)  # b A + c A^2
        X = torch.baddbmm(X, B, X, beta=a)  # a X + B X
    return (X.mT if tall else X).contiguous()


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def unless(skip, old, new):
    """Copies new into old, but where the device scalar skip (found_inf) is 1; without a skip, always."""
    old.copy_(new if skip is None else torch.where(skip > 0, old, new))


def when_done(work, result):
    def wait():
        work.wait()
        return result()
    return wait


class Muon(torch.optim.Optimizer):
    """SGD with Nesterov momentum whose update of each matrix is orthogonalize()d and scaled by
    sqrt(max(1, rows / cols)), with decoupled weight decay: torch.optim.Muon's step (adjust_lr_fn
    "original") for views of matrices. A group's `splits` stacks that many matrices by rows in each
    parameter (c_attn's q, k, v), each orthogonalized alone. step() is a collective."""

    def __init__(self, params, lr, momentum=MUON_MOMENTUM, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, splits=1))
        self.owner = None  # parameter -> its owner rank, chosen at the first step

    @staticmethod
    def flops(splits, shape):
        """Newton-Schulz's matmul work, up to a constant: m * n * min(m, n) per matrix."""
        m, n = shape[0] // splits, shape[1]
        return splits * m * n * min(m, n)

    def choose_owners(self, world_size):
        """Greedy: the costliest matrix first, each to the least loaded rank."""
        flops = {p: self.flops(group["splits"], self.whole_shape(p))
                 for group in self.param_groups for p in group["params"]}
        cost, self.owner = [0.0] * world_size, {}
        for p in sorted(flops, key=flops.get, reverse=True):  # a stable sort: ties in parameter order
            rank = cost.index(min(cost))
            self.owner[p] = rank
            cost[rank] += flops[p]

    def whole_shape(self, p):
        return getattr(p, "whole_shape", p.shape)  # a DTensor's shape is the whole one

    def piece_numel(self, p):
        """The zero-padded numel of each rank's piece of p's matrix; None where p is whole."""
        if hasattr(p, "whole_shape"):
            return p.numel()
        if hasattr(p, "to_local"):  # FSDP's torch.chunk of dim 0: ceil(rows / world_size) rows each
            return math.ceil(p.shape[0] / self.world_size) * math.prod(p.shape[1:])
        return None

    def to_owner(self, update, p):
        """Starts gathering p's update on its owner; returns a function giving it there, None elsewhere."""
        owner, n = self.owner[p], self.piece_numel(p)
        if n is None:
            return lambda: update if self.rank == owner else None
        shape = self.whole_shape(p)
        piece = F.pad(update.reshape(-1), (0, n - update.numel()))
        pieces = [torch.empty_like(piece) for _ in range(self.world_size)] if self.rank == owner else None
        work = dist.gather(piece, pieces, dst=owner, async_op=True)
        return when_done(work, lambda: None if pieces is None
                         else torch.cat(pieces)[:math.prod(shape)].view(shape))

    def from_owner(self, whole, p):
        """Starts handing the owner's bfloat16 `whole` out; returns a function giving this rank's view."""
        owner, n = self.owner[p], self.piece_numel(p)
        if n is None:
            if self.world_size == 1:
                return lambda: whole
            buf = whole if self.rank == owner else torch.empty(p.shape, dtype=torch.bfloat16, device=p.device)
            return when_done(dist.broadcast(buf, src=owner, async_op=True), lambda: buf)
        view_shape = local(p).shape
        pieces = (None if whole is None
                  else list(F.pad(whole.reshape(-1), (0, n * self.world_size - whole.numel())).split(n)))
        piece = torch.empty(n, dtype=torch.bfloat16, device=p.device)
        work = dist.scatter(piece, pieces, src=owner, async_op=True)
        return when_done(work, lambda: piece[:math.prod(view_shape)].view(view_shape))

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every matrix, none where the found_inf attribute (a device scalar, GradScaler's
        contract with torch's fused optimizers) is 1. `closure` is torch.optim's argument, unused."""
        skip = getattr(self, "found_inf", None)
        if self.owner is None:
            # a model on the meta device (the memory plan's) is no rank's: it steps alone
            distributed = dist.is_initialized() and not self.param_groups[0]["params"][0].is_meta
            self.rank, self.world_size = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
            self.choose_owners(self.world_size)
        sent = []
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                grad, buf = local(p.grad), local(state["momentum_buffer"])
                unless(skip, buf, buf.lerp(grad, 1 - group["momentum"]))
                update = grad.lerp(buf, group["momentum"])  # Nesterov
                sent.append((p, group, self.to_owner(update.bfloat16(), p)))
        returned = []
        for p, group, gathered in sent:  # the owner orthogonalizes each as it arrives
            whole = gathered()
            if whole is not None:
                with record_function("newton_schulz"):
                    whole = orthogonalize(whole.view(group["splits"], -1, whole.size(-1))).view_as(whole)
            returned.append(self.from_owner(whole, p))
        for (p, group, _), received in zip(sent, returned):
            rows, cols = self.whole_shape(p)
            scale = math.sqrt(max(1.0, rows / group["splits"] / cols))
            param = local(p)
            unless(skip, param, param.mul(1 - group["lr"] * group["weight_decay"]).add_(
                received(), alpha=-group["lr"] * scale))


class Chain:
    """Optimizers over disjoint parameters (AdamW and Muon) stepped as one, numbering parameters in
    param_groups, state and state_dict() as one torch optimizer over all their groups would."""

    def __init__(self, *optimizers):
        self.optimizers = optimizers

    @property
    def param_groups(self):
        return [group for opt in self.optimizers for group in opt.param_groups]

    @property
    def state(self):
        return {p: s for opt in self.optimizers for p, s in opt.state.items()}

    def zero_grad(self, set_to_none=True):
        for opt in self.optimizers:
            opt.zero_grad(set_to_none)

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
