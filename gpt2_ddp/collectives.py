"""
Collectives shared beyond DDP's own: making every rank agree on a user's error, and handing small
values around. Each also works in one process without a process group.
"""

import torch
import torch.distributed as dist

from gpt2_ddp.configurator import UserError


def agreed(fn, master_only=False):
    """Runs fn() on every rank (on rank 0 alone with master_only); returns its result where it ran,
    None elsewhere. If fn raised UserError on any rank, every rank raises it (the lowest such rank's
    message), so the others stop rather than wait for a collective till the timeout. A collective."""
    result, error = None, None
    if not master_only or not dist.is_initialized() or dist.get_rank() == 0:
        try:
            result = fn()
        except UserError as e:
            error = str(e)
    if dist.is_initialized():
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        error = next((e for e in errors if e is not None), None)
    if error is not None:
        raise UserError(error)
    return result


def broadcast_object(obj):
    """Rank 0's obj (picklable), on every rank. A collective."""
    if dist.is_initialized():
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        obj = box[0]
    return obj


def all_reduce_max(values, device):
    """The element-wise maximum of a list of ints over ranks. A collective."""
    if not dist.is_initialized():
        return values
    t = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()
