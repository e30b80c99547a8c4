"""Dropout masks per micro-batch: train_gpt2.train() seeds each micro-batch's forward and backward
from (seed, step, m), m the micro-batch's number within the step, counted across ranks.

The equivalence tests cannot see a seed that leaves m out: every micro-batch of a step would then
draw the same masks, at every world size alike, and world sizes 1, 2 and 4 would still train the
same bits. These tests run train() in-process, without a process group (each rank then trains on
its own micro-batches alone, which leaves the masks as they are), as rank 0 of world size 1 with 4
micro-steps and as ranks 0 and 1 of world size 2 with 2 each, and record what each training forward
drew. Micro-step k of rank r reads global micro-batch k * world_size + r; with several micro-steps
per rank, a seed numbered otherwise (rank * grad_accum + k, say) draws another micro-batch's masks.
"""

import signal

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from conftest import TINY, make_shards, one_torch_thread
import train_gpt2
from gpt2_ddp.collectives import STOP_SIGNALS

B, T = 2, 16  # TINY's micro-batch
ARGS = [*TINY, "--dropout=0.1", "--exact_reduction=true", f"--total_batch_size={4 * B * T}",
        "--max_steps=2", "--eval_interval=0", "--device=cpu"]


def train_and_record(data_dir, out_dir, rank, world_size):
    """Runs ARGS' 2 steps as `rank` of `world_size`; returns, per training forward in order, the seed
    the loop gave torch's RNG before it (it decides SDPA's masks too) and the masks of every
    nn.Dropout in it (where the output is 0), concatenated."""
    config = train_gpt2.load_config([*ARGS, f"--data_dir={data_dir}", f"--out_dir={out_dir}"])
    records = []

    # the memory plan's forwards, on FakeTensors before training starts, draw no masks
    def before_forward(module, args):
        if isinstance(module, train_gpt2.GPT) and module.training and not isinstance(args[0], FakeTensor):
            records.append((torch.initial_seed(), []))

    def after_forward(module, args, output):
        if isinstance(module, nn.Dropout) and module.training and not isinstance(output, FakeTensor):
            records[-1][1].append((output == 0).flatten())

    handlers = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    hooks = [nn.modules.module.register_module_forward_pre_hook(before_forward),
             nn.modules.module.register_module_forward_hook(after_forward)]
    try:
        # the loop's RNG forks leave the process's RNG as it was, but build_model's seeding does not
        with one_torch_thread(), torch.random.fork_rng():
            assert train_gpt2.train(config, rank, world_size, torch.device("cpu")) == 0
    finally:
        for hook in hooks:
            hook.remove()
        for signum, handler in handlers.items():  # train() leaves its stop handlers installed
            signal.signal(signum, handler)
    return [(seed, torch.cat(masks)) for seed, masks in records]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """{(world_size, rank): train_and_record's list} for rank 0 of 1 and ranks 0 and 1 of 2."""
    root = tmp_path_factory.mktemp("dropout_masks")
    make_shards(root / "data")
    return {(w, r): train_and_record(root / "data", root / f"out_{w}_{r}", r, w)
            for w, r in [(1, 0), (2, 0), (2, 1)]}


def test_each_micro_batch_of_each_step_draws_its_own_masks(recorded):
    """At world size 1 with 4 micro-steps, the 8 forwards of 2 steps (step 0 micro-batches 0 to 3,
    step 1 micro-batches 0 to 3) run under 8 different seeds and draw 8 different sets of masks."""
    forwards = recorded[1, 0]
    assert len(forwards) == 8
    names = [f"step {step} micro-batch {m}" for step in (0, 1) for m in range(4)]
    for i, (_, mask) in enumerate(forwards):
        assert 0.05 < mask.float().mean() < 0.15  # dropout 0.1 is on
        for j in range(i):
            assert not torch.equal(mask, forwards[j][1]), f"{names[j]} and {names[i]} share their masks"
    assert len({seed for seed, _ in forwards}) == 8


def test_a_micro_batch_draws_the_same_masks_at_any_world_size(recorded):
    """Global micro-batch m of a step draws the same masks and seed at world size 1 (micro-step m of
    4) as at world size 2 (rank m % 2, micro-step m // 2 of 2), in exact mode, at steps 0 and 1."""
    alone = recorded[1, 0]
    for rank in (0, 1):
        split = recorded[2, rank]
        assert len(split) == 4
        for step in (0, 1):
            for micro_step in (0, 1):
                m = micro_step * 2 + rank  # the global micro-batch this rank reads
                where = f"step {step} micro-batch {m} (rank {rank}, micro-step {micro_step})"
                (seed_2, mask_2), (seed_1, mask_1) = split[step * 2 + micro_step], alone[step * 4 + m]
                assert torch.equal(mask_2, mask_1), f"{where}: other masks"
                assert seed_2 == seed_1, f"{where}: other seeds"


def test_every_step_and_micro_batch_of_a_long_run_gets_its_own_seed():
    """Past 10 the digits of a step and a micro-batch run together, as in (1, 11) and (11, 1)."""
    seeds = {train_gpt2.derived_seed(1337, step, m) for step in range(12) for m in range(12)}
    assert len(seeds) == 12 * 12


def test_attention_drops_out_its_weights_in_training_and_not_in_eval():
    """SDPA's attention dropout is no nn.Dropout, so the masks recorded above cannot show that it is on."""
    torch.manual_seed(0)
    attn = train_gpt2.CausalSelfAttention(train_gpt2.load_config([*TINY, "--dropout=0.5"]))
    attn.resid_dropout.p = 0.0  # only the attention weights' dropout is left
    x = torch.randn(2, 16, 32)
    assert not torch.allclose(attn.train()(x), attn.eval()(x), atol=1e-3)
