"""Random weights in ggml's encodings for the kernel benchmarks (kernels.py, qtiles.py): no pinfer import, so a
benchmark that loads pinfer from another tree (qtiles.py --src) can use it."""

from __future__ import annotations

import numpy as np
import torch

BLOCK = {2: 18, 3: 20, 6: 22, 7: 24, 8: 34, 20: 18}  # bytes per 32-value block: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL


# bytes per 256-value super-block of Q4_K, Q5_K, Q6_K and IQ4_XS, and the byte range of its f16 scales
KQUANT = {12: (144, 0, 4), 13: (176, 0, 4), 14: (210, 208, 210), 23: (136, 0, 2)}


def weights(rows: int, cols: int, t: int, seed: int) -> torch.Tensor:
    """Random weights in type t as uint8 [rows, row_bytes], scales 0.01 (no subnormal or nan arithmetic); for the
    K-quants Q4_K (12), Q5_K (13) and Q6_K (14), random sub-block scales under super-block scales 0.001."""
    rng = np.random.default_rng(seed)
    if t in KQUANT:
        bb, s0, s1 = KQUANT[t]
        raw = rng.integers(0, 256, (rows, cols // 256, bb), dtype=np.uint8)
        raw[..., s0:s1] = np.frombuffer(np.float16(0.001).tobytes() * ((s1 - s0) // 2), np.uint8)
        return torch.from_numpy(raw.reshape(rows, -1))
    if t not in BLOCK:
        w = rng.standard_normal((rows, cols), dtype=np.float32) * 0.02
        if t == 1:
            return torch.from_numpy(w.astype(np.float16).view(np.uint8))
        if t == 30:
            return torch.from_numpy((w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8))
        return torch.from_numpy(w.view(np.uint8))
    nb, bb = cols // 32, BLOCK[t]
    raw = rng.integers(0, 256, (rows, nb, bb), dtype=np.uint8)
    raw[:, :, 0:2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    if t in (3, 7):
        raw[:, :, 2:4] = np.frombuffer(np.float16(-0.05).tobytes(), np.uint8)
    return torch.from_numpy(raw.reshape(rows, nb * bb))
