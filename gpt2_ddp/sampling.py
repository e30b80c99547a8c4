"""What sampling needs beyond GPT's forward: a KVCache, so that each new token runs through the
model alone (GPT.generate), the weight layout that CPU decoding reads faster, and the samples a
training run prints."""

import torch
from torch import nn

from gpt2_ddp.tokenizer import gpt2_encoding


class KVCache:
    """Every layer's attention keys and values while sampling, as transformers' past_key_values. k, v:
    (n_layer, B, nh, length, hs), allocated by the first store() as its keys; pos: the positions
    filled. Not a dataclass: FSDP2 rebuilds those when casting inputs, so the blocks would fill a copy."""

    def __init__(self, n_layer, length):
        self.n_layer, self.length = n_layer, length
        self.k = self.v = None
        self.pos = 0

    def store(self, layer, k, v):
        """Writes k, v (B, nh, T, hs) of `layer` at positions pos..pos+T-1; returns views of that layer's
        keys and values of positions 0..pos+T-1, (B, nh, pos+T, hs). GPT.forward advances pos."""
        if self.k is None:
            B, nh, _, hs = k.shape
            self.k = k.new_empty(self.n_layer, B, nh, self.length, hs)
            self.v = torch.empty_like(self.k)
        end = self.pos + k.size(2)
        self.k[layer, :, :, self.pos:end] = k
        self.v[layer, :, :, self.pos:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]


@torch.no_grad()
def decoding_layout(model):
    """`model` with every nn.Linear weight stored transposed on CPU, (in, out) as transformers'
    Conv1D, same shape and values: decoding's x (1, in) @ W.T reads it faster in MKL (docs/perf.md,
    "Sampling"); unmeasured, so untouched, off CPU. For sampling only: training wants contiguous."""
    if next(model.parameters()).device.type == "cpu":
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.weight.data = module.weight.t().contiguous().t()
    return model


def training_sample(model, prompt, length, seed, device, autocast, check_stop):
    """The model's continuation of `prompt` (GPT-2 token ids), `length` tokens drawn from a generator
    seeded by `seed` under `autocast`, as text. Every rank calls it (FSDP's all-gathers). check_stop()
    runs before each token (StopSignals.check raises Stopped)."""
    model.eval()
    tokens = [torch.tensor([prompt], device=device)]
    generator = torch.Generator(device=device).manual_seed(seed)
    with autocast:
        for token in model.generate(tokens[0], length, generator):
            check_stop()
            tokens.append(token)
    model.train()
    return gpt2_encoding().decode(torch.cat(tokens, dim=1)[0].tolist())
