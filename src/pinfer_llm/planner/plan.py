"""A placement plan: where each layer's attention, predictor and hottest neurons live, and where the output head is.

Device codes are those of the plan keys in the GGUF: 0 is the CPU, k is GPU k (1-based, in the order the GPUs were
given). GPU neurons are always the hottest ones: layer l keeps its `n_gpu[l]` most frequently active neurons on GPU
`ffn_gpu[l]` and the rest on the CPU. The frequency-sorted order itself lives in the Problem (`order`), so a plan
turns into PowerInfer's gpu_idx/gpu_bucket only together with the statistics it was made for.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

CPU = 0


@dataclass
class Plan:
    name: str
    attn: np.ndarray  # uint8 [n_layer]: device of attention (and its KV cache)
    pred: np.ndarray  # uint8 [n_layer]: device of the predictor (0 where there is none)
    ffn_gpu: np.ndarray  # uint8 [n_layer]: GPU holding the layer's GPU neurons, 0 when it holds none
    n_gpu: np.ndarray  # int64 [n_layer]: neurons on that GPU, the hottest first
    output: int = CPU
    note: str = ""

    def __post_init__(self):
        self.attn = np.asarray(self.attn, dtype=np.uint8)
        self.pred = np.asarray(self.pred, dtype=np.uint8)
        self.ffn_gpu = np.asarray(self.ffn_gpu, dtype=np.uint8)
        self.n_gpu = np.asarray(self.n_gpu, dtype=np.int64)
        self.ffn_gpu[self.n_gpu == 0] = CPU
        self.output = int(self.output)

    @classmethod
    def on_cpu(cls, n_layer: int, name: str = "cpu", note: str = "") -> Plan:
        zeros = np.zeros(n_layer, dtype=np.int64)
        return cls(name, zeros, zeros, zeros, zeros, CPU, note)

    @property
    def n_layer(self) -> int:
        return len(self.attn)

    def gpu_masks(self, order: list[np.ndarray]) -> list[np.ndarray]:
        """Per layer, I32 [n_ff] in the model's neuron order: 1 where the neuron lives on a GPU (PowerInfer gpu_idx)."""
        masks = []
        for k, idx in zip(self.n_gpu, order, strict=True):
            m = np.zeros(len(idx), dtype=np.int32)
            m[idx[:k]] = 1
            masks.append(m)
        return masks

    def gpu_buckets(self, order: list[np.ndarray]) -> list[np.ndarray]:
        """Per layer, sorted I32 indices of the GPU neurons (PowerInfer gpu_bucket)."""
        return [np.sort(idx[:k]).astype(np.int32) for k, idx in zip(self.n_gpu, order, strict=True)]
