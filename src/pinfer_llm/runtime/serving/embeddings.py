"""Embeddings for /v1/embeddings: the last layer's hidden states (after the output norm, the vectors the output
head reads), pooled over the input's tokens and scaled to unit length, as OpenAI's embeddings are.

Poolings: "mean" (the default: every token's state counts), "last" (the final token's, which alone has seen the
whole input in a causal model), "cls" (the first token's). The pass runs on the model's thread like a generation
and writes the KV cache, so the cache's record of what it holds is cleared first: the next generation then starts
from a fresh prefill instead of reusing keys computed for another purpose.

    vecs = embed(m, [ids1, ids2], pooling="mean")    # float32 [2, n_embd], each of norm 1
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

POOLINGS = ("mean", "last", "cls")
CHUNK = 256  # prompt rows per forward pass, as a prefill's chunks


@torch.inference_mode()
def hidden_states(m, ids: Sequence[int]) -> torch.Tensor:
    """The output-normed hidden states of a causal pass over ids from position 0: float32 [len(ids), n_embd]."""
    t = m.transformer
    m.cached_ids = []  # from here on the cache holds this pass's keys, which no generation may take as its own
    tokens = torch.tensor(list(ids), dtype=torch.long)
    outs = []
    for s in range(0, tokens.numel(), CHUNK):
        x = t.embed(tokens[s:s + CHUNK], s)
        for li, b in enumerate(t.blocks):
            xf, resid, x = t.attend(li, b, x, s)
            x = x + t.ffn(b, xf, resid)
        outs.append(t.norm(x, t.output_norm).float())
    return torch.cat(outs)


def pool(h: torch.Tensor, pooling: str) -> np.ndarray:
    if pooling == "mean":
        v = h.double().mean(0)
    elif pooling == "last":
        v = h[-1].double()
    elif pooling == "cls":
        v = h[0].double()
    else:
        raise ValueError(f"unknown pooling {pooling!r}")
    n = torch.linalg.vector_norm(v)
    return (v / n if n > 0 else v).float().numpy()


def embed(m, inputs: Sequence[Sequence[int]], pooling: str = "mean") -> np.ndarray:
    return np.stack([pool(hidden_states(m, ids), pooling) for ids in inputs])
