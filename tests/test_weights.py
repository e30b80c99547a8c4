"""GPT-2 weights in and out, against Hugging Face `transformers` (an independent implementation):
init_from a transformers checkpoint, the tiny finetune config, and export to a directory that
transformers loads with no network, tokenizer included."""

import errno
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn import functional as F
from transformers import GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast

import train_gpt2
from conftest import (ROOT, TINY, make_shards, read_log, run_training, tied_names, train_here,
                      write_hellaswag)
from gpt2_ddp import checkpoints
from gpt2_ddp.gpt2_weights import check_gpt2, save_hf
from gpt2_ddp.tokenizer import ASSETS_DIR, GPT2_MERGES_PATH, GPT2_VOCAB_PATH, gpt2_encoding
from scripts import export_hf
from train_gpt2 import GPT, Config, DataLoader, UserError, build_model, init_from, load_config

TOLERANCE = 1e-5  # float32 logits of two implementations that sum in other orders

# tiny_shakespeare's finetune recipe, scaled down to the hf_tiny model and seconds on a CPU
FINETUNE_TINY = ["configs/finetune_shakespeare.toml", "--seq_len=32", "--micro_batch_size=2",
                 "--total_batch_size=64", "--max_steps=4", "--val_batches=4", "--eval_interval=3",
                 "--sample_interval=0", "--compile=false", "--device=cpu"]


def hf_logits(model, idx):
    with torch.no_grad():
        return model(idx).logits


@pytest.mark.compat
def test_init_from_a_transformers_checkpoint_gives_its_logits(hf_tiny):
    reference = GPT2LMHeadModel.from_pretrained(hf_tiny).eval()
    model = GPT.from_pretrained(hf_tiny)
    config = model.config
    assert (config.n_layer, config.n_embd, config.block_size, config.vocab_size) == (2, 32, 64, 50257)
    idx = torch.randint(0, 50257, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, _ = model(idx)
    torch.testing.assert_close(logits, hf_logits(reference, idx), rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("source", ["hf_tiny", "gpt_tiny"])
def test_from_pretrained_draws_no_random_weights_and_ties_what_gpt_ties(source, request):
    """GPT.from_pretrained of a transformers directory or of our checkpoint builds no random weights to
    overwrite (an init would draw from the global RNG) and ties the parameters that GPT(config) ties,
    wte and lm_head; the weights it holds are the file's."""
    path = request.getfixturevalue(source)
    rng = torch.get_rng_state()
    model = GPT.from_pretrained(path)
    assert torch.equal(torch.get_rng_state(), rng)
    assert tied_names(model) == tied_names(GPT(model.config))
    if source == "gpt_tiny":
        saved = checkpoints.load(checkpoints.resolve(path))["model"]
        assert all(torch.equal(value, saved[key]) for key, value in model.state_dict().items())


def test_from_pretrained_in_a_new_process_leaves_torch_dynamo_unimported(hf_tiny):
    """Building the model on the meta device skips nn.Embedding's init, whose normal_ would import
    torch._dynamo there: sample.py, export and HellaSwag load without that import."""
    code = ("import sys; from train_gpt2 import GPT; GPT.from_pretrained(sys.argv[1]); "
            "print('torch._dynamo' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code, str(hf_tiny)], cwd=ROOT, capture_output=True,
                          text=True, check=True)
    assert done.stdout == "False\n"


def test_init_from_trains_contiguous_copies_of_the_weights_drawing_none_at_random(hf_tiny):
    """build_model with init_from's state makes no random weights (the RNG is where config.seed put it)
    and gives training contiguous parameters of its own, not views of the memory-mapped file whose
    matmul weights are stored transposed, equal to the file's, tied as GPT(config) ties them."""
    config, state = init_from(load_config([*FINETUNE_TINY, f"--init_from={hf_tiny}"]))
    model = build_model(config, torch.device("cpu"), state)
    rng = torch.get_rng_state()
    torch.manual_seed(config.seed)
    assert torch.equal(torch.get_rng_state(), rng)
    assert tied_names(model) == tied_names(GPT(config))
    assert not state["transformer.h.0.attn.c_attn.weight"].is_contiguous()  # the file's (in, out) layout
    file_storage = {tensor.untyped_storage().data_ptr() for tensor in state.values()}
    for name, param in model.named_parameters():
        assert param.is_contiguous() and param.untyped_storage().data_ptr() not in file_storage, name
        assert torch.equal(param, state[name]), name


@pytest.mark.parametrize("override, message", [
    ("--n_layer=3", "sets n_layer=3 \\(the checkpoint has 2\\): drop those keys"),
    ("--vocab_size=1000", "sets vocab_size=1000"),
    ("--seq_len=128", "seq_len=128 exceeds init_from=.*block_size=64: pass --seq_len=64"),
])
def test_init_from_refuses_a_conflicting_model_config(hf_tiny, override, message):
    with pytest.raises(UserError, match=message):
        init_from(load_config([*FINETUNE_TINY, f"--init_from={hf_tiny}", override]))


def test_init_from_takes_a_seq_len_of_the_checkpoints_whole_block_size(hf_tiny):
    """seq_len may reach block_size, as the finetune config's 1024 does on GPT-2's; only above is refused."""
    config, state = init_from(load_config([*FINETUNE_TINY, f"--init_from={hf_tiny}", "--seq_len=64"]))
    assert (config.seq_len, config.block_size) == (64, 64) and state is not None


def test_init_from_a_missing_directory_says_what_it_needs(tmp_path):
    with pytest.raises(UserError, match="neither gpt2, .* nor a Hugging Face GPT-2 directory "
                                        "\\(config.json and model.safetensors missing\\)"):
        GPT.from_pretrained(tmp_path / "nowhere")


@pytest.mark.compat
def test_a_run_with_init_from_and_hellaswag_loads_train_gpt2_once(gpt_tiny, tmp_path):
    """No module that train_gpt2.py imports imports it back: run as a script, it is the module
    __main__ alone, never also a second copy named train_gpt2 (two Config classes in a process).
    python -X importtime lists every module a process imports, on stderr. The run starts from a
    checkpoint of ours (init_from reads it through gpt2_weights as it reads GPT-2's)."""
    data_dir = tmp_path / "data"
    make_shards(data_dir)
    write_hellaswag(tmp_path / "hellaswag.jsonl", 2)
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "train_gpt2.py", *TINY, "--total_batch_size=32", "--max_steps=1",
         f"--init_from={gpt_tiny}", f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'out'}",
         "--hellaswag_interval=1", f"--hellaswag_path={tmp_path / 'hellaswag.jsonl'}"],
        capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "hellaswag acc_norm" in proc.stdout and "init_from" in proc.stdout
    imported = [line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines()
                if line.startswith("import time:")]
    assert {"gpt2_ddp.gpt2_weights", "gpt2_ddp.hellaswag", "gpt2_ddp.memory_plan"} <= set(imported)
    assert "train_gpt2" not in imported


def test_finetune_then_export_round_trips_through_transformers(hf_tiny, tmp_path):
    """The tiny finetune starts from hf_tiny: its step-0 val loss is transformers' loss on the
    same val batches. Its checkpoint, exported, loads in transformers with our logits, and the
    exported tokenizer encodes as tiktoken does."""
    data_dir, out_dir, hf_dir = tmp_path / "data", tmp_path / "out", tmp_path / "hf"
    make_shards(data_dir)
    run_training([*FINETUNE_TINY, f"--init_from={hf_tiny}", f"--data_dir={data_dir}",
                  f"--out_dir={out_dir}"])
    steps, evals = read_log(out_dir)
    assert len(steps) == 4 and [e["step"] for e in evals] == [0, 3, 4]

    reference = GPT2LMHeadModel.from_pretrained(hf_tiny).eval()
    val = DataLoader(data_dir, "val", 2, 32, 0, 1, torch.device("cpu"))
    losses = []
    for g in range(4):
        x, y = val.get_batch(g)
        losses.append(F.cross_entropy(hf_logits(reference, x).flatten(0, 1), y.flatten()))
    assert evals[0]["val_loss"] == pytest.approx(torch.stack(losses).mean().item(), rel=TOLERANCE)

    # resuming takes the weights from the run's checkpoint and reads only GPT-2's config.json:
    # a cut-short model.safetensors beside it does not matter
    cut = tmp_path / "hf_cut"
    cut.mkdir()
    (cut / "config.json").write_bytes((hf_tiny / "config.json").read_bytes())
    (cut / "model.safetensors").write_bytes((hf_tiny / "model.safetensors").read_bytes()[:100])
    out = run_training([*FINETUNE_TINY, f"--init_from={cut}", f"--data_dir={data_dir}",
                        f"--out_dir={out_dir}", "--max_steps=5"]).stdout
    assert "resumed from" in out and [s["step"] for s in read_log(out_dir)[0]] == list(range(1, 6))

    proc = subprocess.run([sys.executable, "-m", "scripts.export_hf", str(out_dir), str(hf_dir)],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    ours = GPT.from_pretrained(out_dir)
    exported = GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    released = GPT2Config()  # transformers' defaults are GPT-2's released config
    for key in ("activation_function", "n_inner", "layer_norm_epsilon", "initializer_range", "bos_token_id",
                "eos_token_id", "tie_word_embeddings"):
        assert getattr(exported.config, key) == getattr(released, key), key
    idx = torch.randint(0, 50257, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, _ = ours(idx)
    torch.testing.assert_close(hf_logits(exported, idx), logits, rtol=0, atol=TOLERANCE)

    tokenizer = GPT2TokenizerFast.from_pretrained(hf_dir)
    enc = gpt2_encoding()
    text = ("Hello, world! It's 2026; we'll see.\n\n  Ça coûte 12,50 €. Привет, мир! 你好，世界。"
            "こんにちは。 مرحبا بالعالم 🤖🎉\tnaïve café ½ ∑x²\r\n")
    assert tokenizer.encode(text) == enc.encode_ordinary(text)
    assert tokenizer.decode(enc.encode_ordinary(text)) == text
    assert tokenizer.eos_token_id == enc.eot_token == 50256


def test_export_keeps_padded_vocab_and_zero_biases_exact(hf_tiny, tmp_path):
    """A model trained from scratch: vocab_size 50304 (47 padding rows) and bias=false. The
    exported directory carries the padding rows and zero biases, so transformers' logits are ours
    over all 50304 ids."""
    config = Config(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=50304, bias=False)
    torch.manual_seed(0)
    model = GPT(config).eval()
    assert [name for name, _ in model.named_parameters() if name.endswith("bias")] == []
    save_hf(check_gpt2(model, "the model").state_dict(), config, tmp_path / "hf")  # GPT-2 without biases
    exported = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    idx = torch.randint(0, 50257, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits, _ = model(idx)
    assert logits.shape[-1] == 50304
    torch.testing.assert_close(hf_logits(exported, idx), logits, rtol=0, atol=TOLERANCE)
    metadata = [safe_open(path / "model.safetensors", "pt").metadata() for path in (tmp_path / "hf", hf_tiny)]
    assert metadata[0] == metadata[1]  # what transformers' save_pretrained writes
    with pytest.raises(UserError, match="exists and is not an empty directory"):
        save_hf(model.state_dict(), config, tmp_path / "hf")


def test_exported_files_get_the_mode_of_new_files(tmp_path):
    """safetensors' save_file (>= 0.8) writes through a temp file of mode 0o600; the export gives
    every file 0o666 less the umask, as open() does, so others can read the model where the umask
    lets them."""
    config = Config(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=512)
    old = os.umask(0o027)
    try:
        save_hf(GPT(config).state_dict(), config, tmp_path / "hf")
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "hf").iterdir()}
    assert modes == dict.fromkeys(["config.json", "model.safetensors", "vocab.json", "merges.txt",
                                   "tokenizer_config.json"], 0o640)
    assert (tmp_path / "hf").stat().st_mode & 0o777 == 0o750


def test_export_where_it_cannot_write_is_one_line_and_leaves_no_temp_dir(gpt_tiny, tmp_path,
                                                                           monkeypatch):
    """A failed export removes the temp directory it made, and only that: a user's hf.tmp stays."""
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    (tmp_path / "hf.tmp").mkdir()
    (tmp_path / "hf.tmp" / "keep.txt").write_text("mine")
    with pytest.raises(UserError, match=f"{a_file} exists and is not an empty directory"):
        export_hf.main([str(gpt_tiny), str(a_file)])
    with pytest.raises(UserError, match=f"cannot write {a_file}/hf: Not a directory"):
        export_hf.main([str(gpt_tiny), str(a_file / "hf")])

    def refused(src, dst):  # as a read-only parent would: under root, chmod cannot make one
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(dst))

    monkeypatch.setattr(os, "replace", refused)
    with pytest.raises(UserError, match=f"cannot write {tmp_path / 'hf'}: Permission denied; pick "
                                        f"a directory you can write"):
        export_hf.main([str(gpt_tiny), str(tmp_path / "hf")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "hf.tmp"]
    assert (tmp_path / "hf.tmp" / "keep.txt").read_text() == "mine"


def test_export_into_an_empty_current_directory_or_through_a_dangling_symlink(gpt_tiny, tmp_path,
                                                                               monkeypatch):
    """An empty current directory stays and the files go into it (a shell in it sees them); a
    dangling symlink's target is made; a directory the user filled is refused, untouched."""
    files = ["config.json", "merges.txt", "model.safetensors", "tokenizer_config.json", "vocab.json"]
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    export_hf.main([str(gpt_tiny), "."])
    assert sorted(os.listdir(".")) == files
    with pytest.raises(UserError, match="^\\. exists and is not an empty directory: pick a directory "
                                        "that does not exist yet$"):
        export_hf.main([str(gpt_tiny), "."])
    (tmp_path / "link").symlink_to(tmp_path / "there")
    export_hf.main([str(gpt_tiny), str(tmp_path / "link")])
    assert sorted(os.listdir(tmp_path / "there")) == files
    assert sorted(p.name for p in tmp_path.iterdir()) == ["here", "link", "there"]


SOURCES = ("a ckpt_NNNNNNN.pt or out_dir of train_gpt2.py, a Hugging Face GPT-2 directory, or gpt2, "
           "gpt2-medium, gpt2-large, gpt2-xl")


def test_export_of_a_file_that_is_not_a_checkpoint_says_so(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("not a checkpoint\n")
    proc = subprocess.run([sys.executable, "-m", "scripts.export_hf", str(notes), str(tmp_path / "hf")],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 1
    assert proc.stderr == (f"export_hf.py: error: {notes} is not a train_gpt2.py checkpoint (it is not "
                           f"the zip archive that torch.save writes); pass {SOURCES}\n")
    assert not (tmp_path / "hf").exists()


class UntiedGPT(train_gpt2.GPT):
    """A fork with an lm_head of its own, apart from wte: GPT-2's keys and shapes, other logits."""

    def __init__(self, config):
        super().__init__(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)


class RMSNormGPT(train_gpt2.GPT):
    """A fork with RMSNorm in place of every LayerNorm: with bias=false, GPT-2's keys and shapes."""

    def __init__(self, config):
        super().__init__(config)
        for block in self.transformer.h:
            block.ln_1, block.ln_2 = nn.RMSNorm(config.n_embd), nn.RMSNorm(config.n_embd)
        self.transformer.ln_f = nn.RMSNorm(config.n_embd)


@pytest.mark.parametrize("fork, bias, refused", [
    (UntiedGPT, "true", "lm_head.weight is not tied to transformer.wte.weight"),
    (RMSNormGPT, "false", "transformer.h.0.ln_1 is RMSNorm("),
    (RMSNormGPT, "true", "missing ['transformer.h.0.ln_1.bias', 'transformer.h.0.ln_2.bias', "
                         "'transformer.h.1.ln_1.bias']"),
])
def test_export_of_a_fork_that_is_not_gpt2_is_one_line_and_writes_nothing(fork, bias, refused,
                                                                         tiny_data, tmp_path, monkeypatch):
    """A fork's checkpoint, exported by the fork's own code (a sitecustomize puts the fork in
    train_gpt2.GPT's place, as a fork's train_gpt2.py has it), is refused in one line naming what is
    not GPT-2, before anything is written: transformers' GPT2LMHeadModel would compute other logits
    from it, or refuse it."""
    out, site = tmp_path / "out", tmp_path / "site"
    monkeypatch.setattr(train_gpt2, "GPT", fork)
    train_here([*TINY, f"--bias={bias}", f"--data_dir={tiny_data}", f"--out_dir={out}",
                "--total_batch_size=32", "--max_steps=1", "--eval_interval=0", "--hellaswag_interval=0"])
    site.mkdir()
    (site / "sitecustomize.py").write_text(f"import train_gpt2\nfrom torch import nn\n\n\n"
                                           f"{inspect.getsource(fork)}\n\ntrain_gpt2.GPT = {fork.__name__}\n")
    proc = subprocess.run([sys.executable, "-m", "scripts.export_hf", str(out), str(tmp_path / "hf")],
                          cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(ROOT)])))
    assert proc.returncode == 1
    assert proc.stderr.startswith(f"export_hf.py: error: {out} is not GPT-2 ({refused}")
    assert proc.stderr.endswith("): GPT-2 export needs GPT-2's architecture\n")
    assert proc.stderr.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "out", "site"]


@pytest.mark.parametrize("module, other", [
    ("transformer.h.1.ln_2", nn.RMSNorm(32)), ("transformer.ln_f", nn.LayerNorm(32, eps=1e-6, bias=False)),
    ("transformer.h.0.mlp.gelu", nn.GELU()),
])
def test_every_norm_and_gelu_of_a_fork_is_checked_before_export(module, other):
    """One module of GPT-2's keys but another computation, anywhere in the model, is named."""
    model = GPT(Config(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=64, bias=False))
    parent, _, leaf = module.rpartition(".")
    setattr(model.get_submodule(parent), leaf, other)
    with pytest.raises(UserError, match=f"^the fork is not GPT-2 \\({module} is {type(other).__name__}\\("):
        check_gpt2(model, "the fork")


def write_damaged(path, kind):
    """A file at `path` of `kind`: empty, foreign (a torch.save of other contents), cut (a zip cut
    short) or tampered (our keys, with a checksum that does not match)."""
    state = {key: {} for key in checkpoints.KEYS} | {"sha256": "0" * 64}
    if kind == "empty":
        path.write_bytes(b"")
    elif kind == "foreign":
        torch.save({"model": {}}, path)
    else:
        torch.save(state, path)
    if kind == "cut":
        path.write_bytes(path.read_bytes()[:200])


@pytest.mark.parametrize("kind, message", [
    ("empty", "{path} is not a train_gpt2.py checkpoint \\(it is empty\\); pass a ckpt_NNNNNNN.pt"),
    ("foreign", "{path} is not a train_gpt2.py checkpoint \\(it holds no optimizer, config, step, loader, "
                "sha256\\); pass a ckpt_NNNNNNN.pt"),
    ("cut", "cannot load checkpoint {path} \\(not the zip archive torch.save writes, but 200 bytes of "
            "something else: a save cut short, or another file\\); pass an older ckpt_\\*.pt of its out_dir$"),
    ("tampered", "cannot load checkpoint {path} \\(its contents do not match its checksum: the file is "
                 "corrupt\\); pass an older ckpt_\\*.pt of its out_dir$"),
])
def test_a_damaged_checkpoint_is_told_from_a_file_that_is_none(tmp_path, kind, message):
    """Only a checkpoint of ours, cut short or altered, gets the advice to take an older one."""
    path = tmp_path / "ckpt_0000001.pt"
    write_damaged(path, kind)
    with pytest.raises(UserError, match="^" + message.format(path=path)):
        export_hf.main([str(path), str(tmp_path / "hf")])


def hf_dir_with(tmp_path, hf_tiny, config=None, tensors=None):
    """A Hugging Face directory: hf_tiny's config.json with `config`'s changes (or, as a str, that
    text), and hf_tiny's weights with `tensors`' changes (None: an empty model.safetensors)."""
    path = tmp_path / "hf"
    path.mkdir()
    hf_config = json.loads((hf_tiny / "config.json").read_text())
    text = config if isinstance(config, str) else json.dumps(hf_config | (config or {}))
    (path / "config.json").write_text(text)
    if tensors is None:
        (path / "model.safetensors").write_bytes(b"")
    else:
        weights = {k: v for k, v in load_file(hf_tiny / "model.safetensors").items() if k not in tensors}
        save_file(weights | {k: v for k, v in tensors.items() if v is not None}, path / "model.safetensors")
    return path


def test_a_config_json_value_of_the_wrong_type_is_one_line(hf_tiny, tmp_path):
    path = hf_dir_with(tmp_path, hf_tiny, {"n_embd": "32"})
    proc = subprocess.run([sys.executable, "-m", "scripts.sample", str(path)], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 1
    assert proc.stderr == (f'sample.py: error: {path}/config.json: n_embd is "32", a string, not a '
                           f'positive integer\n')


@pytest.mark.parametrize("config, message", [
    ('{"n_embd": 32,', "config.json is not valid JSON \\(Expecting property name .*\\): not a GPT-2 config"),
    ("[1, 2]", "config.json holds an array, not a JSON object: not a GPT-2 config"),
    ("5", "config.json holds an integer, not a JSON object: not a GPT-2 config"),
    ('{"model_type": "gpt2"}', "config.json lacks n_layer, n_head, n_embd, n_positions, vocab_size: "
                               "not a GPT-2 config"),
    ({"n_layer": 2.0}, "config.json: n_layer is 2.0, a float, not a positive integer"),
    ({"n_head": True}, "config.json: n_head is true, a boolean, not a positive integer"),
    ({"n_layer": "x" * 80}, f'config.json: n_layer is "{"x" * 49}, a string, not a positive integer'),
    ({"vocab_size": 0}, "config.json: vocab_size is 0, not a positive integer"),
    ({"n_head": 3}, "config.json: n_embd 32 is not a multiple of n_head 3"),
    ({"activation_function": "relu"}, "config.json: activation_function='relu', but train_gpt2.py's "
                                      "GPT-2 needs \\('gelu_new', 'gelu_pytorch_tanh'\\)"),
])
def test_init_from_a_config_json_that_is_not_gpt2s_is_one_line(hf_tiny, tmp_path, config, message):
    path = hf_dir_with(tmp_path, hf_tiny, config)
    with pytest.raises(UserError, match=f"^{path}/{message}$"):
        init_from(load_config([*FINETUNE_TINY, f"--init_from={path}"]))


def one_value_set(shape, index, value):
    """A tensor of `shape` holding 0.5 but for `value` at flat `index`."""
    tensor = torch.full(shape, 0.5)
    tensor.view(-1)[index] = value
    return tensor


@pytest.mark.parametrize("tensors, message", [
    ({"transformer.wte.weight": None}, "{path} does not hold the GPT-2 this run builds: missing "
                                       "\\['transformer.wte.weight', 'lm_head.weight'\\]"),
    ({"transformer.wte.weight": torch.zeros(50257, 32, dtype=torch.int64)},
     "{path}/model.safetensors: wte.weight is torch.int64, not floating point: not GPT-2 weights"),
    ({"transformer.wpe.weight": one_value_set((64, 32), 1000, float("nan"))},
     "{path}/model.safetensors: wpe.weight holds NaN or infinite values: the weights are damaged"),
    ({"transformer.h.1.mlp.c_fc.weight": one_value_set((32, 128), -1, float("-inf"))},
     "{path}/model.safetensors: h.1.mlp.c_fc.weight holds NaN or infinite values: the weights are damaged"),
    ({"transformer.ln_f.bias": one_value_set((32,), 0, float("inf"))},
     "{path}/model.safetensors: ln_f.bias holds NaN or infinite values: the weights are damaged"),
    ({"transformer.h.0.ln_1.weight": torch.zeros(0)}, "{path} does not hold the GPT-2 this run builds: "
     "shapes: \\['transformer.h.0.ln_1.weight \\(0,\\) instead of \\(32,\\)'\\]"),
    (None, "cannot read {path}/model.safetensors \\(SafetensorError: .*\\); download it again"),
    ({"lm_head.weight": torch.zeros(50257, 32)},
     "{path}: lm_head.weight differs from wte.weight; GPT-2 ties them"),
    ({"transformer.h.0.attn.c_attn.weight": torch.zeros(2, 2, 2)},
     "{path} does not hold the GPT-2 this run builds: shapes: "
     "\\['transformer.h.0.attn.c_attn.weight \\(2, 2, 2\\) instead of \\(96, 32\\)'\\]"),
])
def test_a_missing_or_odd_tensor_is_one_line(hf_tiny, tmp_path, tensors, message):
    path = hf_dir_with(tmp_path, hf_tiny, tensors=tensors)
    with pytest.raises(UserError, match=f"^{message.format(path=path)}$"):
        GPT.from_pretrained(path)


def test_a_config_json_that_cannot_be_read_is_one_line(hf_tiny, tmp_path, monkeypatch):
    path = hf_dir_with(tmp_path, hf_tiny)
    read_text = Path.read_text

    def failing_read(self, *args, **kwargs):
        if self.name == "config.json":
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return read_text(self, *args, **kwargs)
    monkeypatch.setattr(Path, "read_text", failing_read)
    with pytest.raises(UserError, match=f"^cannot read {path}/config.json: Input/output error$"):
        GPT.from_pretrained(path)


def test_init_from_openais_layout_and_the_same_model_spelled_otherwise_loads_the_weights(hf_tiny, tmp_path):
    """OpenAI's checkpoints on the hub are GPT2Model files: no "transformer." prefix, no lm_head, the
    causal masks saved as h.N.attn.bias; and a config may name n_inner = 4 * n_embd or
    gelu_pytorch_tanh, GPT-2's MLP all the same. Each loads hf_tiny's weights."""
    expected = GPT.from_pretrained(hf_tiny).state_dict()
    openai = {k.removeprefix("transformer."): v for k, v in load_file(hf_tiny / "model.safetensors").items()}
    openai |= {f"h.{i}.attn.bias": torch.ones(64, 64).tril().view(1, 1, 64, 64) for i in range(2)}
    path = hf_dir_with(tmp_path, hf_tiny, {"n_inner": 4 * 32, "activation_function": "gelu_pytorch_tanh"})
    save_file(openai, path / "model.safetensors")
    loaded = GPT.from_pretrained(path).state_dict()
    assert loaded.keys() == expected.keys() and all(torch.equal(loaded[k], expected[k]) for k in expected)


def test_shipped_tokenizer_files_are_gpt2s():
    """assets/encoder.json and vocab.bpe, which the export copies as vocab.json and merges.txt,
    are GPT-2's vocabulary and merges, and the Encoding built from them is GPT-2's tokenizer."""
    vocab = json.loads(GPT2_VOCAB_PATH.read_text(encoding="utf-8"))
    assert len(vocab) == 50257 and sorted(vocab.values()) == list(range(50257))
    assert vocab["<|endoftext|>"] == 50256 and vocab["Ġthe"] == 262  # GPT-2's " the"
    header, *merges = GPT2_MERGES_PATH.read_text(encoding="utf-8").splitlines()
    assert header == "#version: 0.2" and len(merges) == 50000
    assert all(len(merge.split(" ")) == 2 for merge in merges)
    assert merges[:3] == ["Ġ t", "Ġ a", "h e"]  # GPT-2's first merges
    enc = gpt2_encoding()
    assert enc.encode("Hello, I'm a language model,") == [15496, 11, 314, 1101, 257, 3303, 2746, 11]
    text = (ASSETS_DIR / "tinyshakespeare.txt").read_text(encoding="utf-8")
    tokens = enc.encode_ordinary(text)
    assert len(tokens) == 338_025 and enc.decode(tokens) == text
