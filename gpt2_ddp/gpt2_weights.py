"""GPT-2 weights in and out as state dicts: Hugging Face GPT-2 checkpoints (OpenAI's on the hub, or a
local directory) and ours into train_gpt2.py's GPT layout (--init_from), and its state dicts out as
Hugging Face directories that `transformers` loads offline, with assets/' tokenizer (export_hf.py).
Hugging Face's GPT-2 differs only in keeping matmul weights in Conv1D modules, (in_features,
out_features), the transpose of nn.Linear's, and holding the tied wte/lm_head matrix once."""

import json
import os
import shutil
from pathlib import Path

import torch

from gpt2_ddp import checkpoints
from gpt2_ddp.atomic import new_file_mode
from gpt2_ddp.configurator import UserError
from gpt2_ddp.tokenizer import (GPT2_MERGES_PATH, GPT2_MERGES_SHA256, GPT2_VOCAB_PATH,
                                GPT2_VOCAB_SHA256, checked)

HUB_NAMES = {name: f"openai-community/{name}" for name in ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")}
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# Hugging Face config field -> train_gpt2.Config field, for the model's shape
SHAPE_KEYS = {"n_layer": "n_layer", "n_head": "n_head", "n_embd": "n_embd",
              "n_positions": "block_size", "vocab_size": "vocab_size"}
MODEL_KEYS = (*SHAPE_KEYS.values(), "bias")  # the Config keys that fix the model's shape
SOURCES = (f"a ckpt_NNNNNNN.pt or out_dir of train_gpt2.py, a Hugging Face GPT-2 directory, or "
           f"{', '.join(HUB_NAMES)}")
ZIP_MAGIC = b"PK\x03\x04"  # how every file torch.save writes begins
JSON_KINDS = {str: "a string", int: "an integer", float: "a float", bool: "a boolean", type(None): "null",
              list: "an array", dict: "an object"}


def load_weights(source):
    """(shape: MODEL_KEYS -> values, model state dict) of any source in
    SOURCES. Raises UserError for any other source, or a damaged one."""
    if (path := checkpoints.resolve(source)) is None:
        return load_hf(source)
    try:
        with open(path, "rb") as f:
            head = f.read(len(ZIP_MAGIC))
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}") from None
    if head != ZIP_MAGIC:  # a damaged checkpoint of ours still starts as the zip torch.save wrote
        what = "it is empty" if not head else "it is not the zip archive that torch.save writes"
        raise UserError(f"{path} is not a train_gpt2.py checkpoint ({what}); pass {SOURCES}")
    try:
        ckpt = checkpoints.load(path)
    except checkpoints.NotOurs as e:
        raise UserError(f"{path} is not a train_gpt2.py checkpoint (it holds no "
                        f"{', '.join(e.missing)}); pass {SOURCES}") from None
    except checkpoints.Unloadable as e:
        raise UserError(f"cannot load checkpoint {path} ({str(e)[:150]}); pass an older "
                        f"ckpt_*.pt of its out_dir") from None
    return {k: ckpt["config"][k] for k in MODEL_KEYS}, ckpt["model"]


def hf_dir(source):
    """The local directory of a Hugging Face GPT-2 checkpoint: `source`, or a hub name's cached snapshot.
    Raises UserError when it lacks config.json or model.safetensors, or the download fails."""
    if source in HUB_NAMES:
        from huggingface_hub import snapshot_download
        try:
            return Path(snapshot_download(HUB_NAMES[source],
                                          allow_patterns=["config.json", "model.safetensors"]))
        except Exception as e:
            raise UserError(f"cannot download {source} from the Hugging Face hub ({e.__class__.__name__}: "
                            f"{str(e).splitlines()[0][:150] if str(e) else 'no detail'}); run once where the "
                            f"hub is reachable (huggingface_hub keeps it in its cache), or pass a directory "
                            f"holding config.json and model.safetensors") from e
    path = Path(source)
    if missing := [f for f in ("config.json", "model.safetensors") if not (path / f).is_file()]:
        raise UserError(f"{source} is neither {', '.join(HUB_NAMES)}, a checkpoint (ckpt_*.pt) or "
                        f"out_dir of train_gpt2.py, nor a Hugging Face GPT-2 directory "
                        f"({' and '.join(missing)} missing)")
    return path


def read_hf_config(path):
    """The config.json of the Hugging Face directory `path`, as a dict whose SHAPE_KEYS are positive
    integers (n_embd a multiple of n_head). Raises UserError, naming the file, for anything else."""
    file = path / "config.json"
    try:
        hf_config = json.loads(file.read_text(encoding="utf-8"))
    except OSError as e:
        raise UserError(f"cannot read {file}: {e.strerror}") from None
    except ValueError as e:  # JSONDecodeError, or UnicodeDecodeError for bytes that are not UTF-8
        raise UserError(f"{file} is not valid JSON ({str(e)[:150]}): not a GPT-2 config") from None
    if not isinstance(hf_config, dict):
        raise UserError(f"{file} holds {JSON_KINDS[type(hf_config)]}, not a JSON object: not a GPT-2 config")
    if missing := [k for k in SHAPE_KEYS if k not in hf_config]:
        raise UserError(f"{file} lacks {', '.join(missing)}: not a GPT-2 config")
    for key in SHAPE_KEYS:
        value = hf_config[key]
        if type(value) is not int or value < 1:  # type(): a JSON true is a bool, which is an int
            kind = f", {JSON_KINDS[type(value)]}" if type(value) is not int else ""
            raise UserError(f"{file}: {key} is {json.dumps(value)[:50]}{kind}, not a positive integer")
    if hf_config["n_embd"] % hf_config["n_head"]:
        raise UserError(f"{file}: n_embd {hf_config['n_embd']} is not a multiple of n_head "
                        f"{hf_config['n_head']}")
    return hf_config


def load_hf(source):
    """(shape, state) of a Hugging Face GPT-2 checkpoint, as load_weights. Raises UserError as hf_dir,
    read_hf_config and hf_state do, or for a config not of GPT-2's architecture."""
    path = hf_dir(source)
    hf_config = read_hf_config(path)
    # the architecture train_gpt2.GPT implements; any other would load and compute something else
    expected = {"model_type": "gpt2", "activation_function": ("gelu_new", "gelu_pytorch_tanh"),
                "n_inner": (None, 4 * hf_config["n_embd"]), "layer_norm_epsilon": 1e-5,
                "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
                "tie_word_embeddings": True}
    for key, allowed in expected.items():
        value = hf_config.get(key, allowed[0] if isinstance(allowed, tuple) else allowed)
        if value not in (allowed if isinstance(allowed, tuple) else (allowed,)):
            raise UserError(f"{path / 'config.json'}: {key}={value!r}, but train_gpt2.py's GPT-2 "
                            f"needs {allowed!r}")
    shape = {ours: hf_config[theirs] for theirs, ours in SHAPE_KEYS.items()} | {"bias": True}
    return shape, hf_state(path / "model.safetensors")


def hf_state(file):
    """A Hugging Face GPT-2 model.safetensors as GPT.state_dict() in float32, its tensors views of
    the memory-mapped file where they are float32 already: a Conv1D weight is the transpose of its
    (in, out) storage, not a copy. Raises UserError for an unreadable file, a tensor not floating
    point or not finite, or an lm_head.weight not wte.weight."""
    from safetensors.torch import load_file
    try:
        tensors = load_file(file)
    except Exception as e:
        raise UserError(f"cannot read {file} ({e.__class__.__name__}: {str(e)[:150]}); download "
                        f"it again") from e
    state = {}
    for key, tensor in tensors.items():
        key = key.removeprefix("transformer.")  # GPT2Model checkpoints (OpenAI's) lack the prefix
        if key.endswith((".attn.bias", ".attn.masked_bias")):
            continue  # the causal-mask buffers older transformers versions saved
        if not tensor.is_floating_point():
            raise UserError(f"{file}: {key} is {tensor.dtype}, not floating point: not GPT-2 weights")
        # min and max, one fused pass over the bytes, are finite iff every value is
        if tensor.numel() and not torch.stack(torch.aminmax(tensor)).isfinite().all():
            raise UserError(f"{file}: {key} holds NaN or infinite values: the weights are damaged")
        if key.endswith(CONV1D) and tensor.dim() == 2:  # other shapes: state_mismatch names them
            tensor = tensor.t()
        state[key if key == "lm_head.weight" else "transformer." + key] = tensor.float()
    wte = state.get("transformer.wte.weight")
    lm_head = state.setdefault("lm_head.weight", wte) if wte is not None else None
    if lm_head is not wte and not torch.equal(lm_head, wte):  # a file that holds both
        raise UserError(f"{file.parent}: lm_head.weight differs from wte.weight; GPT-2 ties them")
    return state


def check_weights(state, expected, source):
    """Raises UserError, naming `source`, unless the state dict `state` loads into a model whose
    state dict is `expected`."""
    if problems := state_mismatch(state, expected):
        raise UserError(f"{source} does not hold the GPT-2 this run builds: {problems}")


def state_mismatch(state, expected):
    """What keeps `state` from loading into a model whose state dict is `expected` (on the meta
    device, say): the first missing and unexpected keys and wrong shapes in one line; "" if none."""
    wrong = [f"{k} {tuple(state[k].shape)} instead of {tuple(v.shape)}" for k, v in expected.items()
             if k in state and state[k].shape != v.shape]
    problems = [("missing", [k for k in expected if k not in state][:3]),
                ("unexpected", [k for k in state if k not in expected][:3]), ("shapes:", wrong[:2])]
    return "; ".join(f"{what} {found}" for what, found in problems if found)


def check_gpt2(model, source):
    """`model` (train_gpt2's GPT, or a fork's) if it is GPT-2, the one architecture that save_hf
    writes and transformers' GPT2LMHeadModel computes: GPT-2's keys and shapes for model.config
    (biases only where config.bias), then LayerNorm norms of eps 1e-5, the tanh GELU, and an lm_head
    that is wte (or equal to it). Otherwise raises UserError, naming `source` and the first keys or
    modules that differ."""
    config, C = model.config, model.config.n_embd
    block = {"ln_1": (C,), "attn.c_attn": (3 * C, C), "attn.c_proj": (C, C), "ln_2": (C,),
             "mlp.c_fc": (4 * C, C), "mlp.c_proj": (C, 4 * C)}
    layers = {f"h.{i}.{k}": s for i in range(config.n_layer) for k, s in block.items()} | {"ln_f": (C,)}
    shapes = {"wte.weight": (config.vocab_size, C), "wpe.weight": (config.block_size, C)}
    for name, shape in layers.items():
        shapes[f"{name}.weight"] = shape
        if config.bias:
            shapes[f"{name}.bias"] = shape[:1]
    expected = {f"transformer.{k}": torch.empty(s, device="meta") for k, s in shapes.items()}
    expected["lm_head.weight"] = expected["transformer.wte.weight"]
    # a module's repr names its type and settings: a norm's shape and eps, the GELU's approximation
    wanted = {f"transformer.{n}": torch.nn.LayerNorm(C, bias=config.bias) for n in layers if "ln_" in n}
    wanted |= {f"transformer.h.{i}.mlp.gelu": torch.nn.GELU("tanh") for i in range(config.n_layer)}
    modules, state = dict(model.named_modules()), model.state_dict()
    problems = state_mismatch(state, expected) or "; ".join(
        [f"{n} is {modules.get(n)!r}" for n, m in wanted.items() if repr(modules.get(n)) != repr(m)][:2])
    if not problems and not torch.equal(state["lm_head.weight"], state["transformer.wte.weight"]):
        problems = "lm_head.weight is not tied to transformer.wte.weight"
    if problems:
        raise UserError(f"{source} is not GPT-2 ({problems}): GPT-2 export needs GPT-2's architecture")
    return model


def save_hf(model_state, config, out_dir):
    """Writes out_dir, whole or not at all, a Hugging Face GPT-2 directory that transformers loads
    offline, from a GPT's state dict and train_gpt2.Config: all vocab_size rows, so the logits are
    ours; bias=false as zero biases. Raises UserError if out_dir is not absent or empty, cannot be
    written, or an asset's sha256 is not the expected one."""
    from safetensors.torch import save_file
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise UserError(f"{out_dir} exists and is not an empty directory: pick a directory that does "
                        f"not exist yet")
    target = Path(os.path.realpath(out_dir))  # where ".", "x/.." or a symlink leads
    tensors = {}
    for key, tensor in model_state.items():  # bias=false: zero biases for the Linears and norms
        if key.startswith(("transformer.h.", "transformer.ln_f.")) and key.endswith(".weight"):
            tensors.setdefault(key.removesuffix("weight") + "bias", torch.zeros(tensor.shape[0]))
        if key != "lm_head.weight":
            tensor = tensor.detach().float().cpu()
            tensors[key] = (tensor.t() if key.endswith(CONV1D) else tensor).contiguous()
    hf_config = {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": config.vocab_size,
        "n_positions": config.block_size, "n_embd": config.n_embd, "n_layer": config.n_layer,
        "n_head": config.n_head, "n_inner": None, "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5, "initializer_range": 0.02, "tie_word_embeddings": True,
        "resid_pdrop": config.dropout, "embd_pdrop": config.dropout, "attn_pdrop": config.dropout,
        "bos_token_id": 50256, "eos_token_id": 50256, "torch_dtype": "float32"}
    tokenizer_config = {"tokenizer_class": "GPT2Tokenizer", "model_max_length": config.block_size,
                        "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
                        "unk_token": "<|endoftext|>", "add_prefix_space": False}
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")  # this process's own name
    made = False
    try:
        tmp.mkdir(parents=True)
        made = True  # what it made, and nothing else, goes after a failure
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        # safetensors >= 0.8 writes through a tempfile of mode 0o600 (safetensors#782)
        os.chmod(tmp / "model.safetensors", new_file_mode())
        for name, value in (("config.json", hf_config), ("tokenizer_config.json", tokenizer_config)):
            (tmp / name).write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")
        shutil.copyfile(checked(GPT2_VOCAB_PATH, GPT2_VOCAB_SHA256), tmp / "vocab.json")
        shutil.copyfile(checked(GPT2_MERGES_PATH, GPT2_MERGES_SHA256), tmp / "merges.txt")
        if target.is_dir() and not any(target.iterdir()):  # an empty one (".", say) stays
            for file in tmp.iterdir():
                os.replace(file, target / file.name)
        else:
            os.replace(tmp, target)
    except OSError as e:
        raise UserError(f"cannot write {out_dir}: {e.strerror}; pick a directory you can write") from e
    finally:  # after the rename tmp is gone; after any failure, what was written goes with it
        if made:
            shutil.rmtree(tmp, ignore_errors=True)
