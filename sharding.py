"""
Sharding modes: everything that differs between ddp, zero2 and fsdp, behind one interface, so that
train_gpt2.py's loop has no branch on the mode. Each mode wraps the model for the forward and
backward, receives the optimizer's parameter groups and factory (optimizers.py) and decides what
each rank updates, syncs gradients, clips them and saves the full state:

    ddp    every rank holds the whole model, gradients and optimizer state; DDP all-reduces the
           gradients in buckets, overlapped with the backward
    zero2  whole weights and gradients, optimizer state and update sharded by flat slices
           (ZeRO-2, written out below)
    fsdp   parameters sharded too (torch's FSDP2)

A new mode is a subclass of DDPMode that overrides what differs, entered in SHARDING_MODES.
"""

import math

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from collectives import all_gather_single, reduce_scatter_single
from configurator import UserError


def clip_grad_norm(grads, max_norm, sharded):
    """Scales grads in place so that their total 2-norm is at most max_norm, as
    torch.nn.utils.clip_grad_norm_ does (coefficient max_norm / (norm + 1e-6), capped at 1);
    returns the norm before clipping, a float32 scalar tensor.

    The squares are summed in float64, and `sharded` grads (this rank's slices of the gradient)
    over ranks too, so the norm comes out the same however the gradient is split into tensors,
    slices and ranks: the sharding modes and world sizes clip alike.
    """
    dtype = torch.float32 if grads[0].device.type == "mps" else torch.float64  # MPS has no float64
    norms = [torch.linalg.vector_norm(g, dtype=dtype) for g in grads]
    norm_sq = torch.stack(norms).pow(2).sum()
    if sharded:
        dist.all_reduce(norm_sq)
    norm = norm_sq.sqrt().float()
    torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return norm


# -----------------------------------------------------------------------------
# Whole matrices for Muon: each has an owner rank that orthogonalizes it (optimizers.Muon)


class Replicas:
    """ddp's matrices for Muon: every rank holds each whole matrix, so the owner has its update at
    hand; the owner's result is broadcast (bfloat16, as Newton-Schulz computes it)."""

    def __init__(self, rank, world_size):
        self.rank, self.world_size = rank, world_size

    def shape(self, p):
        """The whole matrix's shape."""
        return p.shape

    def to_owner(self, t, p, owner):
        """Starts moving `t`, this rank's view of an update of p's matrix, to its owner; returns a
        function that waits and gives the whole update on the owner, None elsewhere."""
        return lambda: t if self.rank == owner else None

    def from_owner(self, whole, p, owner):
        """Starts handing the owner's `whole` result to every rank; returns a function that waits
        and gives this rank's view of it, shaped as its view of p."""
        if self.world_size == 1:
            return lambda: whole
        buf = whole if self.rank == owner else torch.empty(p.shape, dtype=torch.bfloat16,
                                                           device=p.device)
        return when_done(dist.broadcast(buf, src=owner, async_op=True), lambda: buf)


class Pieces(Replicas):
    """zero2's and fsdp's matrices for Muon: rank r holds piece r of each matrix, and the pieces in
    rank order, each zero-padded to one size, tile the flattened matrix (zero2's flat slices, and
    FSDP's dim-0 shards, whose pieces are whole rows). The owner gathers the pieces of the update
    and scatters those of the result: each rank sends one bfloat16 piece and receives one.

    `layout` maps each view of a matrix to (the matrix's shape, the padded piece's numel, the
    view's own shape)."""

    def __init__(self, rank, world_size, layout):
        super().__init__(rank, world_size)
        self.layout = layout

    def shape(self, p):
        return self.layout[p][0]

    def to_owner(self, t, p, owner):
        shape, n, _ = self.layout[p]
        piece = F.pad(t.reshape(-1), (0, n - t.numel()))
        pieces = [torch.empty_like(piece) for _ in range(self.world_size)] if self.rank == owner else None
        work = dist.gather(piece, pieces, dst=owner, async_op=True)
        return when_done(work, lambda: None if pieces is None
                         else torch.cat(pieces)[:math.prod(shape)].view(shape))

    def from_owner(self, whole, p, owner):
        _, n, view_shape = self.layout[p]
        pieces = None
        if whole is not None:
            pieces = list(F.pad(whole.reshape(-1), (0, n * self.world_size - whole.numel())).split(n))
        piece = torch.empty(n, dtype=torch.bfloat16, device=p.device)
        work = dist.scatter(piece, pieces, src=owner, async_op=True)
        return when_done(work, lambda: piece[:math.prod(view_shape)].view(view_shape))


def when_done(work, result):
    """A function that waits for the asynchronous collective `work`, then returns result()."""
    def wait():
        work.wait()
        return result()
    return wait


# -----------------------------------------------------------------------------
# Sharded optimizer: an element-wise optimizer with state and update split over ranks (ZeRO-2)


class ZeRO2Optimizer:
    """An element-wise optimizer (AdamW) whose state and update are sharded over ranks: ZeRO stage
    2 (Rajbhandari et al. 2020), in the design of the blog "A Thousand Ways to Write ZeRO-2"
    (modded-nanogpt's DistAdam).

    Each parameter is flattened and zero-padded to a multiple of world_size; rank r owns slice r of
    it and keeps optimizer state for that slice only (for AdamW, 1/world_size of DDP's 8 bytes per
    parameter): make_optimizer(groups) builds the inner optimizer over the slices.
    No DDP wrapper: micro-steps that do not sync accumulate p.grad locally. On the syncing one,
    a post-accumulate-grad hook launches an asynchronous reduce-scatter of each gradient as soon
    as autograd has finished it, so communication overlaps the rest of the backward.
    clip_grad_norm() waits on them in the order the backward made them and clips by the norm of
    the full gradient (summed over ranks); step() updates the slices with the inner optimizer
    (element-wise, so the arithmetic of ddp mode) and all-gathers the new slices into every
    rank's full parameters. With `exact`, the micro-steps' gradients are summed in float64 and
    reduce-scattered as float64 sums (see DDPMode), then cast to float32 once.

    state_dict()/load_state_dict() use the full, unsharded state in the inner optimizer's format
    (each state tensor shaped as its parameter), so a checkpoint resumes at any world size and in
    ddp mode. Both are collectives: every rank calls them.
    """

    def __init__(self, param_groups, make_optimizer, rank, world_size, exact):
        self.rank, self.world_size, self.exact = rank, world_size, exact
        self.require_backward_grad_sync = True  # as DDP's flag: set before each forward
        self.shards = {}  # parameter -> this rank's slice of it, which the inner optimizer updates
        shard_groups = []
        for group in param_groups:
            for p in group["params"]:
                self.shards[p] = self.shard_of(p.detach()).clone()
                p.register_post_accumulate_grad_hook(self.reduce_scatter_grad)
            shard_groups.append({**group, "params": [self.shards[p] for p in group["params"]]})
        self.optimizer = make_optimizer(shard_groups, Pieces(rank, world_size, {
            shard: (p.shape, shard.numel(), shard.shape) for p, shard in self.shards.items()}))
        self.grads64 = {}  # exact: parameter -> float64 sum of this step's earlier micro-steps
        self.pending = []  # (parameter, reduced slice, work), in the order the backward ran

    @property
    def param_groups(self):
        """Where the schedule sets lr; a property, as load_state_dict replaces the list."""
        return self.optimizer.param_groups

    @property
    def state(self):
        """This rank's state: that of its slices."""
        return self.optimizer.state

    def padded(self, t):
        """t flattened and zero-padded to a multiple of world_size elements."""
        flat = t.reshape(-1)
        return F.pad(flat, (0, -flat.numel() % self.world_size))

    def shard_of(self, t):
        flat = self.padded(t)
        n = flat.numel() // self.world_size
        return flat[self.rank * n:(self.rank + 1) * n]

    def gather(self, shard, like):
        """Launches the all-gather of every rank's `shard` of a tensor shaped as `like`; returns
        the work and the full tensor, which holds the result once the work is waited on."""
        full = torch.empty(shard.numel() * self.world_size, dtype=shard.dtype, device=shard.device)
        work = all_gather_single(full, shard, async_op=True)
        return work, full[:like.numel()].view_as(like)

    def reduce_scatter_grad(self, p):
        if self.exact:
            grad = self.grads64.pop(p, 0) + p.grad.double()
            if not self.require_backward_grad_sync:
                self.grads64[p], p.grad = grad, None
                return
        elif not self.require_backward_grad_sync:
            return
        else:
            grad = p.grad / self.world_size  # divide before summing, as DDP does, to round alike
        reduced = torch.empty(self.shards[p].shape, dtype=grad.dtype, device=grad.device)
        work = reduce_scatter_single(reduced, self.padded(grad), async_op=True)
        self.pending.append((p, reduced, work))

    def zero_grad(self):
        for p in self.shards:
            p.grad = None
        self.optimizer.zero_grad()

    def clip_grad_norm(self, max_norm):
        """Waits for the gradients' reduce-scatters and clips them to max_norm; returns the full
        gradient's norm before clipping."""
        for p, reduced, work in self.pending:  # in backward order: the earliest launched finish first
            work.wait()
            self.shards[p].grad = reduced.float()
            p.grad = None  # the full gradient is no longer needed: ZeRO-2's memory saving
        self.pending = []
        return clip_grad_norm([s.grad for s in self.shards.values()], max_norm, sharded=True)

    def step(self):
        """Updates this rank's slices and all-gathers them into every rank's full parameters."""
        self.optimizer.step()
        gathers = [(p, *self.gather(shard, p)) for p, shard in self.shards.items()]
        with torch.no_grad():
            for p, work, full in gathers:
                work.wait()
                p.copy_(full)

    def state_dict(self):
        inner = self.optimizer.state_dict()
        state = {}
        for i, p in enumerate(self.shards):  # in param_groups order, as torch.optim numbers them
            if i in inner["state"]:
                state[i] = {key: self.gather_whole(value, p)
                            for key, value in inner["state"][i].items()}
        return {"state": state, "param_groups": inner["param_groups"]}

    def gather_whole(self, value, p):
        """A state entry of p's slice, all-gathered into p's shape if it is per-element (a tensor
        of the slice's size); a scalar (AdamW's step) as it is."""
        if not torch.is_tensor(value) or value.dim() == 0:
            return value
        work, full = self.gather(value, p)
        work.wait()
        return full.clone()  # without the padding

    def load_state_dict(self, full_state):
        """Call it after loading the model's weights: the slices are taken from them."""
        with torch.no_grad():
            for p, shard in self.shards.items():
                shard.copy_(self.shard_of(p))
        state = {i: {key: self.shard_of(value).clone() if torch.is_tensor(value) and value.dim() > 0
                     else value for key, value in s.items()}
                 for i, s in full_state["state"].items()}
        self.optimizer.load_state_dict({"state": state, "param_groups": full_state["param_groups"]})


# -----------------------------------------------------------------------------
# The modes


class DDPMode:
    """sharding=ddp: every rank holds the whole model, gradients and optimizer state; DDP
    all-reduces the gradients in buckets, overlapped with the backward (one process without
    torchrun: no DDP).

    Every mode gives the loop `model` (to run), shard_optimizer(groups, make_optimizer), which
    builds `optimizer` (whose lr the schedule sets), set_grad_sync(sync) before each micro-step's
    forward, clip_grad_norm(max_norm) after the last backward, then step() unless the loop skips
    the update, and state_dict()/load_state_dict() of the full, unsharded model and optimizer.

    exact_reduction: a post-accumulate-grad hook adds each micro-step's gradient into a float64
    sum; on the syncing micro-step a comm hook sums those over ranks in float64 and casts to
    float32 once. Float32 values summed in float64 are exact, or round to the same float32 in any
    order, so every world size gets the same bits.
    """

    # what train_gpt2.py and memory_plan.py ask of a mode
    needs_process_group = False  # in one process without torchrun: no collectives, no group
    # torch.optim's state_dict, keyed by parameter index: a checkpoint resumes in the modes of its
    # format only
    optimizer_state_format = "index"
    shards_parameters = False  # parameters and gradients whole on every rank
    shards_optimizer_state = False  # optimizer state whole on every rank

    def __init__(self, raw_model, config, rank, world_size, device):
        self.raw_model, self.config, self.sync = raw_model, config, True
        self.rank, self.world_size = rank, world_size
        self.ddp_model = None
        self.grads64 = {}  # exact: parameter -> float64 sum of this step's earlier micro-steps
        self.model = self.wrap(raw_model, device)
        self.optimizer = None  # set by shard_optimizer, once the wrap has made the parameters

    @staticmethod
    def extra_copies(config, world_size):
        """Float32 copies of (the parameters, the gradients) the mode keeps besides them, in units
        of the whole model's size, for memory_plan.py: DDP's buckets hold a copy of the
        gradients unless gradient_as_bucket_view makes them the gradients' storage."""
        return 0, int(world_size > 1 and not config.gradient_as_bucket_view)

    def wrap(self, model, device):
        config = self.config
        # DDP(compile(model)) compiles one graph for forward and backward; compile(DDP(model)) lets
        # DDPOptimizer split it at bucket boundaries so all-reduces can start during the backward
        if config.compile and not config.compile_ddp:
            model = torch.compile(model)
        if dist.is_initialized():  # launched by torchrun
            model = self.ddp_model = DDP(model, device_ids=[device] if device.type == "cuda" else None,
                                         bucket_cap_mb=config.bucket_cap_mb,
                                         gradient_as_bucket_view=config.gradient_as_bucket_view)
            if config.grad_compression == "bf16":
                if device.type != "cuda":
                    raise UserError("grad_compression=bf16 needs NCCL (CUDA devices); gloo cannot "
                                    "reduce bf16: use grad_compression=none on CPU")
                self.ddp_model.register_comm_hook(dist.group.WORLD, default_hooks.bf16_compress_hook)
            elif config.exact_reduction:
                self.ddp_model.register_comm_hook(None, self.all_reduce_float64)
        if config.exact_reduction:
            for p in self.raw_model.parameters():
                p.register_post_accumulate_grad_hook(self.accumulate_float64)
        if config.compile and config.compile_ddp:
            model = torch.compile(model)
        return model

    def shard_optimizer(self, groups, make_optimizer):
        """Builds and returns the optimizer this mode steps: make_optimizer(groups, matrices) over
        the parameter groups (optimizers.param_groups) of the whole parameters."""
        self.optimizer = make_optimizer(groups, Replicas(self.rank, self.world_size))
        return self.optimizer

    def set_grad_sync(self, sync):
        self.sync = sync
        if self.ddp_model is not None:
            self.ddp_model.require_backward_grad_sync = sync

    def accumulate_float64(self, p):
        """exact_reduction: adds p.grad to the step's float64 sum. On the syncing micro-step DDP's
        comm hook takes the sum over; one process without DDP casts it to p.grad here."""
        if self.sync and self.ddp_model is not None:
            return
        grad = self.grads64.pop(p, 0) + p.grad.double()
        if self.sync:
            p.grad = grad.float()
        else:
            self.grads64[p], p.grad = grad, None

    def all_reduce_float64(self, _, bucket):
        """DDP comm hook of exact_reduction: the bucket's gradients plus their float64 sums of the
        earlier micro-steps, summed over ranks in float64, cast to float32 once."""
        flat = torch.cat([(self.grads64.pop(p, 0) + g.double()).view(-1)
                          for p, g in zip(bucket.parameters(), bucket.gradients())])
        work = dist.all_reduce(flat, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0].float())

    def clip_grad_norm(self, max_norm):
        """Clips the gradient to max_norm; returns its norm before clipping (a device scalar)."""
        grads = [p.grad for p in self.raw_model.parameters() if p.grad is not None]
        return clip_grad_norm(grads, max_norm, sharded=False)

    def step(self):
        self.optimizer.step()

    def state_dict(self):
        return self.raw_model.state_dict(), self.optimizer.state_dict()

    def load_state_dict(self, model_state, optimizer_state):
        self.raw_model.load_state_dict(model_state)
        self.optimizer.load_state_dict(optimizer_state)  # after the weights: zero2 slices them


class ZeRO2Mode(DDPMode):
    """sharding=zero2: whole weights and gradients on every rank, optimizer state and update
    sharded (ZeRO2Optimizer, which reduce-scatters the gradients itself: no DDP wrapper)."""

    needs_process_group = True
    shards_optimizer_state = True

    @staticmethod
    def extra_copies(config, world_size):
        """This rank's slices of the parameters and of the reduced gradients."""
        return 1 / world_size, 1 / world_size

    def wrap(self, model, device):
        return torch.compile(model) if self.config.compile else model

    def shard_optimizer(self, groups, make_optimizer):
        self.optimizer = ZeRO2Optimizer(groups, make_optimizer, self.rank, self.world_size,
                                        self.config.exact_reduction)
        return self.optimizer

    def set_grad_sync(self, sync):
        self.optimizer.require_backward_grad_sync = sync

    def clip_grad_norm(self, max_norm):
        return self.optimizer.clip_grad_norm(max_norm)


class FSDPMode(DDPMode):
    """sharding=fsdp: FSDP2's fully_shard on each block and on the root (wte/lm_head tied, wpe,
    ln_f), bf16 parameters on CUDA: each group's weights are all-gathered just before its forward
    and backward, its gradients reduce-scattered after. exact_reduction: FSDP accumulates the
    unsynced micro-steps' gradients in its reduce dtype, float64, and reduce-scatters sums.
    The optimizer, element-wise, updates the DTensors' local shards."""

    needs_process_group = True
    optimizer_state_format = "name"  # torch.distributed.checkpoint's, keyed by parameter name
    shards_parameters = True
    shards_optimizer_state = True

    @staticmethod
    def extra_copies(config, world_size):
        return 0, 0

    def wrap(self, model, device):
        # imported here, not at the top: FSDP2 and its checkpoint helpers add ~1.5 s to every
        # process's start-up (measured on 2 CPU cores), and only this mode uses them
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mp_policy = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if device.type == "cuda" else None,
            reduce_dtype=torch.float64 if self.config.exact_reduction else torch.float32)
        for module in [*model.transformer.h, model]:
            fully_shard(module, mp_policy=mp_policy)
            if self.config.exact_reduction:
                module.set_gradient_divide_factor(1.0)  # the loss is divided by all micro-batches
            elif device.type == "cpu":
                # gloo's reduce-scatter returned the sum for ReduceOp.AVG on torch 2.8 (measured,
                # twice the gradient at world size 2); FSDP's sum-then-divide is the mean on all
                module.set_force_sum_reduction_for_comms(True)
        return torch.compile(model) if self.config.compile else model

    def shard_optimizer(self, groups, make_optimizer):
        """Muon's owner of a matrix gathers its dim-0 shards (whole rows, FSDP's torch.chunk
        split: ceil(rows / world_size) each, the last ones shorter or empty)."""
        layout = {p: (p.shape, math.ceil(p.shape[0] / self.world_size) * math.prod(p.shape[1:]),
                      p.to_local().shape) for group in groups for p in group["params"]}
        self.optimizer = make_optimizer(groups, Pieces(self.rank, self.world_size, layout))
        return self.optimizer

    def set_grad_sync(self, sync):
        self.raw_model.set_requires_gradient_sync(sync)

    def clip_grad_norm(self, max_norm):
        grads = [p.grad.to_local() for p in self.raw_model.parameters() if p.grad is not None]
        return clip_grad_norm(grads, max_norm, sharded=True)

    def state_dict(self):
        """Full state dicts keyed by parameter name (torch.distributed.checkpoint)."""
        from torch.distributed.checkpoint import state_dict as dcp
        options = dcp.StateDictOptions(full_state_dict=True, cpu_offload=True)
        return (dcp.get_model_state_dict(self.raw_model, options=options),
                dcp.get_optimizer_state_dict(self.raw_model, self.optimizer, options=options))

    def load_state_dict(self, model_state, optimizer_state):
        from torch.distributed.checkpoint import state_dict as dcp
        options = dcp.StateDictOptions(full_state_dict=True)
        dcp.set_model_state_dict(self.raw_model, model_state, options=options)
        dcp.set_optimizer_state_dict(self.raw_model, self.optimizer, optimizer_state, options=options)


SHARDING_MODES = {"ddp": DDPMode, "zero2": ZeRO2Mode, "fsdp": FSDPMode}


