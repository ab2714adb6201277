"""Weight types, their exact dequantisation, and the device layout the GPU kernels read (kernels/quant.cuh).

Types are ggml's ids. A matrix is [rows, cols], each row stored contiguously in the file; cols % 32 == 0.
  F32, F16, BF16   plain rows (BF16: the upper 16 bits of an f32)
  Q4_0  blocks of 32 in 18 bytes {f16 d; u8 qs[16]}: value j = d * ((qs[j] & 15) - 8),
        value j+16 = d * ((qs[j] >> 4) - 8)
  Q4_1  20 bytes {f16 d; f16 m; u8 qs[16]}: value = d * q + m, q the nibble as above
  Q8_0  34 bytes {f16 d; i8 qs[32]}: value j = d * qs[j]

`to_device` reorders each row into the layout of quant.cuh (1024-value tiles arranged for a warp's coalesced 16-byte
loads, then the odd blocks in the file's order, padded to 16 bytes). No value changes: a tile is a permutation of
its row's quants and scales. `dequantize` decodes the FILE layout (the reference never sees the device layout, so
a layout bug and a kernel bug cannot cancel).
"""

from __future__ import annotations

from functools import cache

import numpy as np

F32, F16, Q4_0, Q4_1, Q8_0, BF16 = 0, 1, 2, 3, 8, 30
NAMES = {F32: "f32", F16: "f16", BF16: "bf16", Q4_0: "q4_0", Q4_1: "q4_1", Q8_0: "q8_0"}  # kernel name suffixes
TYPES = tuple(NAMES)
_BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}
_ELEM_BYTES = {F32: 4, F16: 2, BF16: 2}
TILE = 1024  # values per tile


def type_id(t: int | str) -> int:
    if isinstance(t, str):
        by_name = {v: k for k, v in NAMES.items()}
        if t.lower() not in by_name:
            raise ValueError(f"unsupported weight type {t!r}: one of {', '.join(NAMES.values())}")
        return by_name[t.lower()]
    if t not in NAMES:
        raise ValueError(f"unsupported weight type {t}: one of {', '.join(f'{k} ({v})' for k, v in NAMES.items())}")
    return int(t)


def row_bytes(ty: int, cols: int) -> int:
    """Bytes of one row in the file."""
    _check_cols(cols)
    return cols // 32 * _BLOCK_BYTES[ty] if ty in _BLOCK_BYTES else cols * _ELEM_BYTES[ty]


def device_stride(ty: int, cols: int) -> int:
    """Bytes between rows on the device: the file's row, padded to 16 bytes."""
    return -(-row_bytes(ty, cols) // 16) * 16


def _check_cols(cols: int) -> None:
    if cols <= 0 or cols % 32:
        raise ValueError(f"row length {cols} is not a positive multiple of 32")


def as_rows(raw: np.ndarray, ty: int, cols: int) -> np.ndarray:
    """The file's rows as uint8 [rows, row_bytes] (accepts a typed or flat array, without copying when it can)."""
    raw = np.ascontiguousarray(raw)
    b = raw.reshape(-1).view(np.uint8)
    rb = row_bytes(ty, cols)
    if b.size % rb:
        raise ValueError(f"{b.size} bytes is not a whole number of {NAMES[ty]} rows of {cols} values ({rb} bytes)")
    return b.reshape(-1, rb)


def _blocks(rows: np.ndarray, ty: int, cols: int):
    """Split block-type rows into (scales u16 [..., nb], mins u16 or None, quants u8 [..., nb, 32] as unsigned q)."""
    nb = cols // 32
    blk = rows.reshape(rows.shape[0], nb, _BLOCK_BYTES[ty])
    d = blk[..., 0:2].copy().view(np.uint16)[..., 0]
    if ty == Q8_0:
        return d, None, blk[..., 2:]
    m = blk[..., 2:4].copy().view(np.uint16)[..., 0] if ty == Q4_1 else None
    qs = blk[..., 4:] if ty == Q4_1 else blk[..., 2:]
    return d, m, np.concatenate([qs & 15, qs >> 4], axis=-1)  # value j: low nibble of byte j, j+16: high nibble


def dequantize(raw: np.ndarray, ty: int, cols: int) -> np.ndarray:
    """float32 [rows, cols] from the file's rows. Exact: every value is representable (Q4_1's d*q + m rounds once)."""
    rows = as_rows(raw, ty, cols)
    n = rows.shape[0]
    if ty == F32:
        return rows.copy().view(np.float32).reshape(n, cols)
    if ty == F16:
        return rows.copy().view(np.float16).astype(np.float32).reshape(n, cols)
    if ty == BF16:
        return (rows.copy().view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(n, cols)
    d, m, q = _blocks(rows, ty, cols)
    d = d.view(np.float16).astype(np.float32)[..., None]
    if ty == Q8_0:
        v = d * q.view(np.int8).astype(np.float32)
    elif ty == Q4_0:
        v = d * (q.astype(np.float32) - 8)
    else:
        v = d * q.astype(np.float32) + m.view(np.float16).astype(np.float32)[..., None]
    return v.reshape(n, cols).astype(np.float32)


@cache
def _tile_order(ty: int) -> tuple[np.ndarray, ...]:
    """Index arrays mapping a tile's device order to positions 0..1023 in the file's order (quant.cuh's layout)."""
    def pos(c, lane, e):  # lane's chunk c, value e
        return c * 128 + 4 * lane + e

    k = np.arange(TILE)
    if ty in (F16, BF16):  # half k: slot s = k // 256, lane, 8 halves = chunk 2s (4) then chunk 2s+1 (4)
        s, lane, w = k // 256, (k % 256) // 8, k % 8
        return (pos(2 * s + w // 4, lane, w % 4),)
    if ty == Q8_0:  # byte k: slot s = k // 512, lane, 16 bytes = chunks 4s .. 4s+3
        s, lane, w = k // 512, (k % 512) // 16, k % 16
        quants = (pos(4 * s + w // 4, lane, w % 4),)
    else:  # Q4: byte k (of 512): lane, word w, byte e; low nibble chunk w, high nibble chunk w + 4
        k = np.arange(512)
        lane, w, e = k // 16, (k % 16) // 4, k % 4
        quants = (pos(w, lane, e), pos(w + 4, lane, e))
    j = np.arange(32)  # scale j of a tile: [g][c] = block 4c + g
    return (*quants, 4 * (j % 8) + j // 8)


def to_device(raw: np.ndarray, ty: int, cols: int) -> np.ndarray:
    """uint8 [rows, device_stride] in quant.cuh's layout, from the file's rows: by the C++ op (runtime/cpu/csrc/
    device_layout.cpp, multithreaded, at memory speed) when the CPU kernels are built, else by to_device_numpy (the
    reference, 0.05-0.25 GB/s on one core: ~50 s, by that speed, for a plan that puts 12 GB on the GPU)."""
    rows = as_rows(raw, ty, cols)
    op = _layout_op()
    if op is None:
        return to_device_numpy(rows, ty, cols)
    from pinfer_llm.runtime.weights import as_tensor

    q0, q1, so = _tables(ty)
    return op(as_tensor(rows), ty, cols, q0, q1, so, device_stride(ty, cols)).numpy()


def _layout_op():
    from pinfer_llm.runtime.cpu import qops

    if not qops.available():
        return None
    import torch

    try:
        return torch.ops.pinfer.device_layout
    except (AttributeError, RuntimeError):
        return None


@cache
def _tables(ty: int) -> tuple:
    """_tile_order's tables as the C++ op takes them: (q0, q1, so), int32 tensors or None."""
    import torch

    if ty == F32:
        return None, None, None
    t = [torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32)) for a in _tile_order(ty)]
    if ty in (F16, BF16):
        return t[0], None, None
    if ty == Q8_0:
        return t[0], None, t[1]
    return t[0], t[1], t[2]


def to_device_numpy(raw: np.ndarray, ty: int, cols: int) -> np.ndarray:
    """to_device in numpy: the definition of the layout (device_layout.cpp must equal it byte for byte)."""
    rows = as_rows(raw, ty, cols)
    n, nb = rows.shape[0], cols // 32
    ntile = nb // 32
    out = np.zeros((n, device_stride(ty, cols)), np.uint8)
    if ty == F32:
        out[:, :rows.shape[1]] = rows  # quant.cuh's F32 tile is the file's order
        return out
    parts = []
    if ty in (F16, BF16):
        v = np.ascontiguousarray(rows).view(np.uint16)
        (order,) = _tile_order(ty)
        tiles = v[:, :ntile * TILE].reshape(n, ntile, TILE)[:, :, order]
        parts = [np.ascontiguousarray(tiles).reshape(n, -1).view(np.uint8),
                 np.ascontiguousarray(v[:, ntile * TILE:]).view(np.uint8)]
    else:
        d, m, q = _blocks(rows, ty, cols)
        *qorder, sorder = _tile_order(ty)
        qt = q[:, :ntile * 32].reshape(n, ntile, TILE)
        if ty == Q8_0:
            tq = qt[:, :, qorder[0]]
        else:
            tq = qt[:, :, qorder[0]] | (qt[:, :, qorder[1]] << 4)
        ts = [np.ascontiguousarray(s[:, :ntile * 32].reshape(n, ntile, 32)[:, :, sorder]).view(np.uint8)
              .reshape(n, ntile, 64) for s in (d, m) if s is not None]
        parts.append(np.concatenate([tq, *ts], axis=2).reshape(n, -1))
        # tail: the file's quants of each block, then the tail's d, then its m
        tail_q = rows.reshape(n, nb, _BLOCK_BYTES[ty])[:, ntile * 32:, 4 if ty == Q4_1 else 2:]
        parts.append(tail_q.reshape(n, -1))
        parts += [np.ascontiguousarray(s[:, ntile * 32:]).view(np.uint8) for s in (d, m) if s is not None]
    body = np.concatenate([np.ascontiguousarray(p).reshape(n, -1) for p in parts], axis=1)
    out[:, :body.shape[1]] = body
    return out


def random_rows(rng: np.random.Generator, ty: int, rows: int, cols: int, scale: float = 1.0) -> np.ndarray:
    """Random valid rows in the file's encoding (uint8 [rows, row_bytes]), values of magnitude ~scale."""
    n = rows * cols
    if ty == F32:
        return (rng.standard_normal(n).astype(np.float32) * scale).view(np.uint8).reshape(rows, -1)
    if ty == F16:
        return (rng.standard_normal(n) * scale).astype(np.float16).view(np.uint8).reshape(rows, -1)
    if ty == BF16:
        f = (rng.standard_normal(n) * scale).astype(np.float32)
        return (f.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(rows, -1)
    nb = n // 32
    blk = np.empty((nb, _BLOCK_BYTES[ty]), np.uint8)
    d = (rng.uniform(0.5, 1.5, nb) * scale / (8 if ty != Q8_0 else 64)).astype(np.float16)
    blk[:, 0:2] = d.view(np.uint8).reshape(nb, 2)
    if ty == Q4_1:
        blk[:, 2:4] = (rng.standard_normal(nb) * scale).astype(np.float16).view(np.uint8).reshape(nb, 2)
    start = 4 if ty == Q4_1 else 2
    blk[:, start:] = rng.integers(0, 256, (nb, _BLOCK_BYTES[ty] - start), dtype=np.uint8)
    return blk.reshape(rows, -1)
