"""Swap-ins for DDP(model) and its optimizer, made by wrap(): ZeRO-2 (sharding=zero2), FSDP2
(sharding=fsdp), and DDP with float64 gradient sums (exact_reduction), as picotron's data_parallel
wrappers. Each keeps torch.optim's element-wise arithmetic and presents what the loop uses:

    model      forward; require_backward_grad_sync, DDP's flag, set before each micro-step's forward;
               no_sync(); clip_grad_norm_(parameters, max_norm) with torch.nn.utils' signature,
               which clips the synced gradient and returns its norm; .module
    optimizer  param_groups, zero_grad(), step(), and state_dict() / load_state_dict() of the whole,
               unsharded state in torch.optim's format, resumable in any mode at any world size"""

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from gpt2_ddp.precision import DTYPES

# the new names where torch has them, else the old ones, which newer torch deprecates
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def wrap(model, optimizer, config, device):
    """(model, optimizer), config's swap-in for the GPT `model` and an `optimizer` over its parameters:
    ZeRO2, FSDP or ExactDDP. zero2 and fsdp need a process group, even of one process."""
    if config.sharding == "zero2":
        zero2 = ZeRO2(model, config)
        return zero2, ZeRO2Optimizer(optimizer, zero2)
    if config.sharding == "fsdp":
        names = {p: name for name, p in model.named_parameters()}  # fully_shard replaces them
        fsdp = FSDP(model, config, device)
        return fsdp, FSDPOptimizer(optimizer, names, fsdp.sharded)
    return ExactDDP(model, config, device), optimizer


def clip_grad_norm(grads, max_norm, sharded):
    """Scales grads in place to a total 2-norm of at most max_norm, as torch.nn.utils.clip_grad_norm_;
    returns the norm before clipping, a float32 scalar tensor. Squares are summed in float64, over
    ranks too (a collective) for `sharded` grads."""
    dtype = torch.float32 if grads[0].device.type == "mps" else torch.float64  # MPS lacks float64
    norm_sq = torch.stack([torch.linalg.vector_norm(g, dtype=dtype) for g in grads]).pow(2).sum()
    if sharded:
        dist.all_reduce(norm_sq)
    norm = norm_sq.sqrt().float()
    torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return norm


class DataParallel(nn.Module):
    """DDP's interface for a swap-in (see the module docstring); forward runs `module`."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.require_backward_grad_sync = True

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """The backwards inside leave their gradients to accumulate, as DDP's no_sync()."""
        sync, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = sync


class ExactDDP(DataParallel):
    """DDP (or one process without it) that sums gradients over micro-steps and ranks in float64,
    exact or rounding to the same float32 in any order, so every world size gets the same bits. The
    sum is cast to float32 once and not averaged: divide the loss by all the step's micro-batches."""

    def __init__(self, model, config, device):
        super().__init__(torch.compile(model) if config.compile and not config.compile_ddp else model)
        self.grads64 = {}  # parameter -> float64 sum of this step's earlier micro-steps
        self.ddp = None
        if dist.is_initialized():
            self.ddp = DDP(self.module, device_ids=[device] if device.type == "cuda" else None,
                           bucket_cap_mb=config.bucket_cap_mb,
                           gradient_as_bucket_view=config.gradient_as_bucket_view)
            self.ddp.register_comm_hook(None, self.all_reduce_float64)
            self.module = self.ddp
        if config.compile and config.compile_ddp:
            self.module = torch.compile(self.module)
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(self.accumulate_float64)

    def forward(self, *args, **kwargs):
        if self.ddp is not None:  # DDP reads its flag in the forward as well as the backward
            self.ddp.require_backward_grad_sync = self.require_backward_grad_sync
        return self.module(*args, **kwargs)

    def accumulate_float64(self, p):
        """Adds p.grad to the step's float64 sum; without DDP, the syncing micro-step casts it to p.grad."""
        sync = self.require_backward_grad_sync
        if sync and self.ddp is not None:
            return
        grad = self.grads64.pop(p, 0) + p.grad.double()
        if sync:
            p.grad = grad.float()
        else:
            self.grads64[p], p.grad = grad, None

    def all_reduce_float64(self, _, bucket):
        """DDP's comm hook: the bucket's gradients plus their earlier float64 sums, all-reduced in float64."""
        flat = torch.cat([(self.grads64.pop(p, 0) + g.double()).view(-1)
                          for p, g in zip(bucket.parameters(), bucket.gradients())])
        return dist.all_reduce(flat, async_op=True).get_future().then(lambda fut: fut.value()[0].float())

    def clip_grad_norm_(self, parameters, max_norm):
        """torch.nn.utils.clip_grad_norm_, with the squares summed in float64 (clip_grad_norm)."""
        return clip_grad_norm([p.grad for p in parameters if p.grad is not None], max_norm, sharded=False)


# ZeRO-2: whole weights and gradients, optimizer state and update sharded by flat slices
class ZeRO2(DataParallel):
    """ZeRO stage 2 (Rajbhandari et al. 2020), as "A Thousand Ways to Write ZeRO-2" (modded-nanogpt's
    DistAdam): rank r owns slice r, `shards[p]`, of each parameter flattened and zero-padded to a
    multiple of world_size, which ZeRO2Optimizer updates. Synced gradients are reduce-scattered as
    autograd finishes each, waited for as the backward ends; exact_reduction sums as ExactDDP."""

    def __init__(self, model, config):
        super().__init__(torch.compile(model) if config.compile else model)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.exact = config.exact_reduction
        self.shards = {}  # parameter -> this rank's slice of it
        for p in model.parameters():
            # one rank owns each whole parameter: its slice is a view, updated in place, none gathered
            whole = self.world_size == 1
            self.shards[p] = p.detach().view(-1) if whole else self.shard_of(p.detach()).clone()
            self.shards[p].whole_shape = p.shape  # for Muon, which orthogonalizes whole matrices
            p.register_post_accumulate_grad_hook(self.reduce_scatter_grad)
        self.grads64 = {}  # exact: parameter -> float64 sum of this step's earlier micro-steps
        self.pending = []  # (parameter, reduced slice, work), in the order the backward ran

    def padded(self, t):
        """t flattened and zero-padded to a multiple of world_size elements."""
        return F.pad(t.reshape(-1), (0, -t.numel() % self.world_size))

    def shard_of(self, t):
        return self.padded(t).tensor_split(self.world_size)[self.rank]

    def gather(self, shard, like):
        """(work, whole): the all-gather launched of every rank's `shard` of a tensor shaped as `like`."""
        full = shard.new_empty(shard.numel() * self.world_size)
        return all_gather_single(full, shard, async_op=True), full[:like.numel()].view_as(like)

    def reduce_scatter_grad(self, p):
        sync = self.require_backward_grad_sync
        if self.exact:
            grad = self.grads64.pop(p, 0) + p.grad.double()
            if not sync:
                self.grads64[p], p.grad = grad, None
                return
        elif not sync:
            return
        else:  # divided before summing, as DDP does, to round alike; one rank's needs no division
            grad = p.grad / self.world_size if self.world_size > 1 else p.grad
        if self.world_size == 1:  # the sum of one rank's gradient is that gradient
            self.shards[p].grad, p.grad = grad.reshape(-1).float(), None
            return
        reduced = grad.new_empty(self.shards[p].shape)
        work = reduce_scatter_single(reduced, self.padded(grad), async_op=True)
        if not self.pending:  # the backward's first: wait for them all once it ends
            torch.autograd.Variable._execution_engine.queue_callback(self.wait_for_grads)
        self.pending.append((p, reduced, work))

    def wait_for_grads(self):
        """Autograd's callback at a syncing backward's end: each slice's .grad from its reduce-scatter."""
        for p, reduced, work in self.pending:
            work.wait()
            self.shards[p].grad = reduced.float()
            p.grad = None  # dropping the whole gradient is ZeRO-2's memory saving
        self.pending = []

    def clip_grad_norm_(self, parameters, max_norm):
        """Clips the gradient slices of `parameters` by the whole gradient's norm, returned. A collective."""
        return clip_grad_norm([self.shards[p].grad for p in parameters], max_norm, sharded=True)


class OptimizerOfViews:
    """`optimizer` over other views of its `params`, whose state_dict() and load_state_dict() turn the
    views' state into whole tensors (whole()) and back (view()), as over `params`."""

    def __init__(self, optimizer, params):
        self.optimizer, self.params = optimizer, params

    def __getattr__(self, name):  # param_groups, state, zero_grad(), step(): the optimizer's own
        return getattr(self.optimizer, name)

    def state_dict(self):
        inner = self.optimizer.state_dict()
        state = {i: {key: self.whole(value, self.params[i]) if torch.is_tensor(value) and value.dim()
                     else value for key, value in s.items()} for i, s in inner["state"].items()}
        return {"state": state, "param_groups": inner["param_groups"]}

    def load_state_dict(self, full_state):
        state = {i: {key: self.view(value, self.params[i]) if torch.is_tensor(value) and value.dim()
                     else value for key, value in s.items()} for i, s in full_state["state"].items()}
        self.optimizer.load_state_dict({"state": state, "param_groups": full_state["param_groups"]})


class ZeRO2Optimizer(OptimizerOfViews):
    """`optimizer` on ZeRO2's slices, its state 1/world_size of ddp's; step() all-gathers the updated
    slices into the whole parameters. Collectives: step(), state_dict(), load_state_dict(), which
    takes the slices from the weights, so load those first."""

    def __init__(self, optimizer, zero2):
        super().__init__(optimizer, [p for group in optimizer.param_groups for p in group["params"]])
        self.zero2 = zero2
        for group in optimizer.param_groups:
            group["params"] = [zero2.shards[p] for p in group["params"]]

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None
        self.optimizer.zero_grad(set_to_none)

    def step(self):
        self.optimizer.step()
        if self.zero2.world_size == 1:  # the slices are views of the weights
            return
        gathers = [(p, *self.zero2.gather(self.zero2.shards[p], p)) for p in self.params]
        with torch.no_grad():
            for p, work, full in gathers:
                work.wait()
                p.copy_(full)

    def whole(self, value, p):
        work, full = self.zero2.gather(value, p)
        work.wait()
        return full.clone()  # without the padding

    def view(self, value, p):
        return self.zero2.shard_of(value).clone()

    def load_state_dict(self, full_state):
        with torch.no_grad():
            for p in self.params:
                self.zero2.shards[p].copy_(self.zero2.shard_of(p))
        super().load_state_dict(full_state)


# FSDP2: parameters, gradients and optimizer state sharded
class FSDP(DataParallel):
    """torch's FSDP2 (fully_shard) on each block and on the root (the tied wte/lm_head, wpe, ln_f), its
    parameters in config.dtype for forward and backward, DTensors of whole dim-0 rows; exact_reduction
    reduces in float64. state_dict() and load_state_dict() give and take whole tensors (hooks below)."""

    def __init__(self, model, config, device):
        # imported here: FSDP2 adds to every process's start-up, and only this mode uses it
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        exact = config.exact_reduction
        mp_policy = MixedPrecisionPolicy(param_dtype=DTYPES[config.dtype],  # float32's is no cast
                                         reduce_dtype=torch.float64 if exact else torch.float32)
        for module in [*model.transformer.h, model]:
            fully_shard(module, mp_policy=mp_policy)
            if exact:
                module.set_gradient_divide_factor(1.0)  # the loss is divided by all micro-batches
            elif device.type == "cpu":
                # some torch versions' gloo sums for ReduceOp.AVG; sum-then-divide is right on all
                module.set_force_sum_reduction_for_comms(True)
        model.register_state_dict_post_hook(gather_whole_tensors)
        model.register_load_state_dict_pre_hook(shard_whole_tensors)
        super().__init__(torch.compile(model) if config.compile else model)
        self.sharded, self.exact = model, exact

    def forward(self, *args, **kwargs):
        self.sharded.set_requires_gradient_sync(self.require_backward_grad_sync)
        return self.module(*args, **kwargs)

    def clip_grad_norm_(self, parameters, max_norm):
        """torch.nn.utils.clip_grad_norm_ of the DTensors; with exact_reduction, clip_grad_norm's."""
        if self.exact:
            grads = [p.grad.to_local() for p in parameters if p.grad is not None]
            return clip_grad_norm(grads, max_norm, sharded=True)
        norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def gather_whole_tensors(module, state_dict, prefix, local_metadata):
    """FSDP's state_dict post-hook, a collective: each DTensor all-gathered, kept on rank 0's CPU alone."""
    for key, value in list(state_dict.items()):
        if hasattr(value, "full_tensor"):
            whole = value.full_tensor()
            if dist.get_rank() == 0:
                state_dict[key] = whole.cpu()
            else:
                del state_dict[key]


def shard_whole_tensors(module, state_dict, prefix, *args):
    """FSDP's load_state_dict pre-hook: each whole tensor cut into this rank's shard of its DTensor."""
    for name, p in module.named_parameters(prefix=prefix.rstrip("."), remove_duplicate=False):
        value = state_dict.get(name)
        if hasattr(p, "device_mesh") and value is not None and not hasattr(value, "device_mesh"):
            state_dict[name] = shard_like(value, p)


def shard_like(value, p):
    """A whole tensor as the DTensor shard of it that this rank holds of p."""
    from torch.distributed.tensor import distribute_tensor
    return distribute_tensor(value.to(p.device, p.dtype), p.device_mesh, p.placements)


class FSDPOptimizer(OptimizerOfViews):
    """`optimizer` moved onto the DTensors that replaced its parameters (`names`: old parameter -> name
    in `sharded`). state_dict() (rank 0's) and load_state_dict() are collectives of whole tensors."""

    def __init__(self, optimizer, names, sharded):
        by_name = dict(sharded.named_parameters())
        for group in optimizer.param_groups:
            group["params"] = [by_name[names[p]] for p in group["params"]]
        super().__init__(optimizer, [p for group in optimizer.param_groups for p in group["params"]])

    def whole(self, value, p):
        """A state DTensor all-gathered, on the CPU on rank 0; None on the others, which save nothing."""
        whole = value.full_tensor()
        return whole.cpu() if dist.get_rank() == 0 else None

    def view(self, value, p):
        return shard_like(value, p)
