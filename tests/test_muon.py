"""optimizer=muon: the update against torch.optim.Muon, the split of parameters between Muon and
AdamW, and, with real processes, bitwise the same run at world sizes 1, 2 and 4 in every sharding
mode (exact_reduction, dropout on, as test_equivalence.py and test_sharding.py check AdamW), resume
at another world size and mode, and a checkpoint of the other optimizer refused in one line."""

import shutil

import numpy as np
import pytest
import torch

from conftest import (EQUIV, assert_bitwise_same_run, compare, compare_together, hellaswag_args, read_log,
                      run_training)
from gpt2_ddp.configurator import UserError
from gpt2_ddp.muon import Chain, Muon, orthogonalize
from train_gpt2 import GPT, load_config, meta_model

STEPS, CHECKPOINT_STEP = 12, 8
MUON = [*EQUIV, "--optimizer=muon", "--muon_lr=0.05", f"--max_steps={STEPS}", "--eval_interval=4",
        f"--checkpoint_interval={CHECKPOINT_STEP}"]


def muon_args(data_dir):
    return [*MUON, f"--data_dir={data_dir}", *hellaswag_args(data_dir), "--hellaswag_interval=6"]


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon is in torch 2.9+")
@pytest.mark.parametrize("shape, splits", [((48, 32), 1), ((32, 48), 1), ((96, 32), 3)])
def test_update_equals_torch_optim_muon(shape, splits):
    """Five steps of ours on one matrix (or c_attn's three stacked) against torch.optim.Muon's on
    the same matrix (or each of the three), with weight decay, adjust_lr_fn "original": equal to
    1e-6 (the same bfloat16 arithmetic; measured bitwise on torch 2.11 and 2.13)."""
    torch.manual_seed(0)
    start = torch.randn(shape)
    ours = torch.nn.Parameter(start.clone())
    optimizer = Muon([{"params": [ours], "splits": splits, "weight_decay": 0.1}], lr=0.02)
    theirs = [torch.nn.Parameter(m.clone()) for m in start.chunk(splits)]
    reference = torch.optim.Muon(theirs, lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True,
                                 adjust_lr_fn="original")
    for _ in range(5):
        grad = torch.randn(shape)
        ours.grad = grad.clone()
        for p, g in zip(theirs, grad.chunk(splits)):
            p.grad = g.clone()
        optimizer.step()
        reference.step()
    torch.testing.assert_close(ours.detach(), torch.cat([p.detach() for p in theirs]), rtol=0, atol=1e-6)
    assert (ours.detach() - start).abs().max() > 0.01  # it moved


def test_found_inf_skips_the_update_on_the_device_and_leaves_the_others_bitwise():
    """GradScaler's found_inf contract, as fused AdamW keeps it: 1 leaves the weights and momentum
    as they were, even under a non-finite gradient; 0 steps bitwise as without it."""
    torch.manual_seed(0)
    start = torch.randn(48, 32)
    params = [torch.nn.Parameter(start.clone()) for _ in range(2)]
    optimizers = [Muon([{"params": [p], "weight_decay": 0.1}], lr=0.02) for p in params]
    for step in range(3):
        grad = torch.randn(48, 32)
        for p in params:
            p.grad = grad.clone()
        optimizers[0].found_inf = torch.zeros(())
        for optimizer in optimizers:
            optimizer.step()
        assert torch.equal(params[0], params[1])
    before = (params[0].detach().clone(), optimizers[0].state[params[0]]["momentum_buffer"].clone())
    params[0].grad = torch.full((48, 32), float("nan"))
    optimizers[0].found_inf = torch.ones(())
    optimizers[0].step()
    assert torch.equal(params[0], before[0])
    assert torch.equal(optimizers[0].state[params[0]]["momentum_buffer"], before[1])


def test_newton_schulz_keeps_the_singular_vectors_and_flattens_the_values():
    """For G = U diag(s) V^T with s in [0.1, 1] (from torch.linalg.svd), U^T orthogonalize(G) V is
    diagonal to bfloat16 precision, with values in Muon's band of about [0.7, 1.2]."""
    torch.manual_seed(0)
    for m, n in ((64, 32), (32, 64)):
        U, _, Vh = torch.linalg.svd(torch.randn(m, n), full_matrices=False)
        s = torch.linspace(0.1, 1.0, min(m, n))
        O = orthogonalize(((U * s) @ Vh)[None])[0].float()
        D = U.T @ O @ Vh.T
        diagonal = D.diagonal()
        assert diagonal.min() > 0.6 and diagonal.max() < 1.25, diagonal
        assert (D - torch.diag(diagonal)).abs().max() < 0.03


def check_muon_split(model, config):
    """model.configure_optimizers(config) with optimizer=muon gives Muon the weight of every nn.Linear
    in the blocks, told by module type (c_attn's, q, k and v, with splits 3; the others with 1), at
    muon_lr's scale and no weight decay, and AdamW every other parameter; each parameter to one."""
    optimizer = model.configure_optimizers(config, "cpu")
    assert isinstance(optimizer, Chain) and isinstance(optimizer.optimizers[1], Muon)
    muon = optimizer.optimizers[1].param_groups
    blocks = model.transformer.h
    matrices = [m.weight for m in blocks.modules() if isinstance(m, torch.nn.Linear)]
    qkv = [b.attn.c_attn.weight for b in blocks]
    others = [w for w in matrices if all(w is not q for q in qkv)]
    assert {g["splits"]: [id(p) for p in g["params"]] for g in muon} == {
        3: [id(p) for p in qkv], 1: [id(p) for p in others]}
    for g in muon:
        assert g["lr_scale"] == config.muon_lr / config.max_lr and g["weight_decay"] == 0.0
    adamw = [p for g in optimizer.optimizers[0].param_groups for p in g["params"]]
    assert sorted(map(id, adamw + qkv + others)) == sorted(map(id, model.parameters()))


def test_muon_takes_the_blocks_matrices_and_adamw_the_rest():
    """check_muon_split on GPT (a fork's own model: test_forks.py)."""
    config = load_config([*MUON, "--n_layer=2"])
    check_muon_split(GPT(config), config)


def test_the_chains_zero_grad_frees_every_gradient_as_torchs_optimizers_do():
    """zero_grad() with no argument sets each parameter's grad to None (torch.optim.Optimizer's
    default), for AdamW's parameters and Muon's alike."""
    config = load_config([*MUON, "--n_layer=1"])
    model = GPT(config)
    optimizer = model.configure_optimizers(config, "cpu")
    model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))[1].backward()
    optimizer.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_owners_split_the_newton_schulz_work_evenly():
    """GPT-2 124M's matrices (c_attn's as one, with q, k and v in it) over 8 ranks: each matrix, and
    nothing else, on one rank, the largest rank's share of Newton-Schulz's work within 10% of the
    mean; a set that only the costliest-first order splits evenly."""
    config = load_config(["--optimizer=muon"])
    model = meta_model(config)
    muon = model.configure_optimizers(config, "meta").optimizers[1]
    muon.choose_owners(8)
    load = [0] * 8
    for group in muon.param_groups:
        for p in group["params"]:
            load[muon.owner[p]] += Muon.flops(group["splits"], p.shape)
    matrices = [m.weight for m in model.transformer.h.modules() if isinstance(m, torch.nn.Linear)]
    assert sorted(map(id, muon.owner)) == sorted(map(id, matrices))
    assert max(load) < 1.1 * sum(load) / 8
    # the costliest first: works of 2, 3, 4 and 3 split 6 and 6; the cheapest first splits 5 and 7
    matrices = [torch.nn.Parameter(torch.zeros(rows, 1)) for rows in (2, 3, 4, 3)]
    muon = Muon(matrices, lr=0.02)
    muon.choose_owners(2)
    assert sorted(sum(p.numel() for p in matrices if muon.owner[p] == rank) for rank in (0, 1)) == [6, 6]


# n_embd 34: c_attn's 102 rows and c_proj's 34 do not divide over 4 ranks, so fsdp's shards are uneven
UNEVEN = [*MUON, "--sharding=fsdp", "--n_embd=34", "--max_steps=2", "--eval_interval=0"]
# n_embd 33 in 3 heads: zero2 pads the flat slices of most tensors (c_attn's 99 x 33, the 33 biases)
UNEVEN_ZERO2 = [*MUON, "--sharding=zero2", "--n_embd=33", "--n_head=3", "--max_steps=2", "--eval_interval=0"]


@pytest.fixture(scope="module")
def muon_and_uneven_runs(equiv_data_dir, tmp_path_factory):
    """(muon_runs, compare's runs of UNEVEN and of UNEVEN_ZERO2 at world sizes 1 and 4), in the same
    launches."""
    out = tmp_path_factory.mktemp("muon")
    *results, uneven, uneven_zero2 = compare_together(
        [([*muon_args(equiv_data_dir), f"--sharding={mode}"], WORLD_SIZES[mode], out / mode)
         for mode in WORLD_SIZES] + [([*UNEVEN, f"--data_dir={equiv_data_dir}"], [1, 4], out / "uneven"),
                                     ([*UNEVEN_ZERO2, f"--data_dir={equiv_data_dir}"], [1, 4],
                                      out / "uneven_zero2")])
    return {mode: (result, out / mode) for mode, result in zip(WORLD_SIZES, results)}, uneven, uneven_zero2


@pytest.fixture(scope="module")
def muon_runs(muon_and_uneven_runs):
    """The MUON config in ddp at world sizes 1, 2 and 4, in zero2 and fsdp at 2 and 4 (one rank
    owns every matrix there, as in ddp at 1), and the folder of each mode's runs."""
    return muon_and_uneven_runs[0]


WORLD_SIZES = {"ddp": [1, 2, 4], "zero2": [2, 4], "fsdp": [2, 4]}


@pytest.mark.compat
def test_muon_trains_bitwise_the_same_model_at_every_world_size_and_mode(muon_runs):
    reference = muon_runs["ddp"][0][1]
    assert reference["loss"][-1] < reference["loss"][0] and len(reference["val_loss"]) == 4
    for mode, (runs, _) in muon_runs.items():
        for n in WORLD_SIZES[mode]:
            assert_bitwise_same_run(runs[n], reference)
    first = {mode: out / f"world_size_{WORLD_SIZES[mode][0]}" for mode, (_, out) in muon_runs.items()}
    weights = {mode: torch.load(sorted(folder.glob("ckpt_*.pt"))[-1], weights_only=True)["model"]
               for mode, folder in first.items()}
    for mode in ("zero2", "fsdp"):
        assert all(torch.equal(weights[mode][k], weights["ddp"][k]) for k in weights["ddp"]), mode


def test_muon_in_fsdp_with_rows_that_do_not_divide_over_the_ranks(muon_and_uneven_runs):
    """fsdp's last shard of a matrix whose rows do not divide over the ranks is shorter: Muon gathers
    and scatters each matrix's padded pieces whole, and trains the model of one process."""
    runs = muon_and_uneven_runs[1]
    assert len(runs[4]["loss"]) == 2
    # uneven shards are not bitwise the one-process run (AdamW's remainder loop, as in the zero2 test
    # below), so this checks the pieces' sizes to a tolerance
    np.testing.assert_allclose(runs[4]["loss"], runs[1]["loss"], rtol=1e-6)
    assert runs[4]["max_param_diff"] < 1e-5


def test_zero2_with_tensors_that_do_not_divide_over_the_ranks(muon_and_uneven_runs):
    """zero2 pads each flat slice to a multiple of the world size; AdamW's and Muon's padded slices
    must gather back into the weights of one process. To 1e-5: torch's fused AdamW on the CPU rounds
    exp_avg_sq apart in its vectorized loop and its remainder loop, and a slice's remainder is not the
    whole tensor's."""
    runs = muon_and_uneven_runs[2]
    assert len(runs[4]["loss"]) == 2
    np.testing.assert_allclose(runs[4]["loss"], runs[1]["loss"], rtol=1e-6)
    assert runs[4]["max_param_diff"] < 1e-5


@pytest.mark.parametrize("mode, world_size, resume_mode, resume_world_size",
                         [("zero2", 2, "ddp", 1), ("fsdp", 4, "fsdp", 2)])
def test_muon_checkpoints_resume_bitwise_at_another_world_size(muon_runs, equiv_data_dir, tmp_path, mode,
                                                              world_size, resume_mode, resume_world_size):
    """Muon's momentum, sharded by zero2 and fsdp, is saved whole: a zero2 checkpoint resumes in
    ddp in one process, an fsdp one at another world size, and the run goes on bitwise."""
    runs, out = muon_runs[mode]
    for name in (f"ckpt_{CHECKPOINT_STEP:07d}.pt", "log.jsonl"):
        shutil.copy(out / f"world_size_{world_size}" / name, tmp_path)
    proc = run_training([*muon_args(equiv_data_dir), f"--out_dir={tmp_path}", f"--sharding={resume_mode}"],
                        nproc=resume_world_size)
    assert "resumed from" in proc.stdout
    steps, evals = read_log(tmp_path)
    assert [s["loss"] for s in steps] == runs[world_size]["loss"]
    assert [e["val_loss"] for e in evals] == runs[world_size]["val_loss"]
    final = f"ckpt_{STEPS:07d}.pt"
    ours = torch.load(tmp_path / final, weights_only=True)["model"]
    reference = torch.load(out / f"world_size_{world_size}" / final, weights_only=True)["model"]
    assert all(torch.equal(ours[k], reference[k]) for k in reference)


def test_activation_checkpointing_changes_no_number_with_muon(muon_runs, equiv_data_dir, tmp_path):
    result = compare([*muon_args(equiv_data_dir), "--activation_checkpointing=true"], [1], tmp_path)[1]
    assert_bitwise_same_run(result, muon_runs["ddp"][0][1])
    final = f"ckpt_{STEPS:07d}.pt"
    ours = torch.load(tmp_path / "world_size_1" / final, weights_only=True)["model"]
    reference = torch.load(muon_runs["ddp"][1] / "world_size_1" / final, weights_only=True)["model"]
    assert all(torch.equal(ours[k], reference[k]) for k in reference)


def test_the_other_optimizer_is_refused_and_init_from_takes_the_weights(muon_runs, equiv_data_dir,
                                                                      tmp_path):
    """Resuming a Muon run with AdamW fails in one line that names --init_from; a new out_dir
    with init_from set to the old one starts from its weights (val loss far below a fresh
    model's ln(512) = 6.24, near the old run's last)."""
    old = muon_runs["ddp"][1] / "world_size_1"
    args = [*muon_args(equiv_data_dir), "--optimizer=adamw", f"--max_steps={STEPS + 2}"]
    with pytest.raises(UserError) as refused:
        run_training([*args, f"--out_dir={old}"])
    message = refused.value.args[0].strip().splitlines()[-1]
    ckpt = sorted(old.glob("ckpt_*.pt"))[-1]
    groups = [len(g["params"]) for g in torch.load(ckpt, weights_only=True)["optimizer"]["param_groups"]]
    assert message == (f"checkpoint {ckpt} was trained with optimizer=muon and parameter groups of {groups} "
                       "tensors, which this run's optimizer cannot continue: keep its optimizer, or start a "
                       f"new run from its weights with --out_dir=NEW_DIR --init_from={old}")
    run_training([*args, f"--out_dir={tmp_path}", f"--init_from={old}", "--max_steps=1"])
    first_val_loss = read_log(tmp_path)[1][0]["val_loss"]
    assert abs(first_val_loss - muon_runs["ddp"][0][1]["val_loss"][-1]) < 0.2 < 6.24 - first_val_loss
