"""What sampling needs beyond GPT's forward: a KVCache, so that each new token runs through the
model alone (GPT.generate), and the weight layout that CPU decoding reads faster."""

import torch
from torch import nn


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
