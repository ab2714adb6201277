"""Each op of one decode step, its time against its bytes, at SmolLM2-135M's shapes (576 wide, Q4_1) and a 1B
llama's (2048 wide, Q4_0): which ops are at the memory's speed and which are bound by something else (fork/join of
the thread pool, per-row setup, dispatch).

    python benchmarks/step_ops.py                 # both shapes, 2 threads
    python benchmarks/step_ops.py --threads 1 --shape smollm2 --json

Each op is timed as torch.ops.pinfer.<op> in a loop over copies of its weights that together exceed the last-level
cache (so every call reads its weights from DRAM, as a decode step does), median of --reps loops. The time includes
torch's dispatch of one op (a few us): what the Python forward pays per op, and what the fused step (one call per token,
runtime/cpu/step.py) does not. GB/s = the weight bytes the op reads / its time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

_TREE = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(_TREE), str(_TREE / "src")]

import numpy as np  # noqa: E402
import torch  # noqa: E402

BLOCK = {2: (18, 1), 3: (20, 2), 8: (34, 1)}  # type -> (bytes per 32 values, f16 scales at the block start)
SHAPES = {  # d, n_ff, n_head, n_head_kv, head_dim, weight type
    "smollm2": (576, 1536, 9, 3, 64, 3),
    "1b": (2048, 5632, 32, 4, 64, 2),
}
LLC_BYTES = 256 << 20  # copies of each weight until their sum exceeds this (larger than any LLC here)


def weight(rows: int, cols: int, t: int, rng) -> torch.Tensor:
    nb, head = BLOCK[t]
    raw = rng.integers(0, 256, (rows, cols // 32, nb), dtype=np.uint8)
    raw[:, :, :2 * head] = np.full((rows, cols // 32, head), 0.01, np.float16).view(np.uint8)
    return torch.from_numpy(raw.reshape(rows, -1))


def timed(fn, calls: int, reps: int) -> float:
    """Median seconds per call over reps loops of `calls` calls."""
    fn(0)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for i in range(calls):
            fn(i)
        out.append((time.perf_counter() - t0) / calls)
    return statistics.median(out)


def matmul_row(name: str, rows: int, cols: int, t: int, reps: int, rng, x=None) -> dict:
    nbytes = rows * cols // 32 * BLOCK[t][0]
    copies = max(2, LLC_BYTES // nbytes)
    ws = [weight(rows, cols, t, rng) for _ in range(min(copies, 64))]
    x = torch.randn(1, cols) if x is None else x
    s = timed(lambda i: torch.ops.pinfer.qmatmul(x, [ws[i % len(ws)]], [t]), 4 * len(ws), reps)
    return {"op": name, "shape": f"{rows} x {cols}", "bytes": nbytes, "us": s * 1e6, "gb_s": nbytes / s / 1e9}


def shape_rows(shape: str, reps: int, ctx: int) -> list[dict]:
    d, n_ff, H, Hkv, D, t = SHAPES[shape]
    rng = np.random.default_rng(0)
    out = [matmul_row("qkv (fused)", (H + 2 * Hkv) * D, d, t, reps, rng),
           matmul_row("attn_output", d, H * D, t, reps, rng),
           matmul_row("gate+up (fused)", 2 * n_ff, d, t, reps, rng),
           matmul_row("down", d, n_ff, t, reps, rng)]
    x, w = torch.randn(1, d), torch.ones(d)
    s = timed(lambda i: torch.ops.pinfer.rms_norm(x, w, 1e-5), 2000, reps)
    out.append({"op": "rms_norm", "shape": f"{d}", "bytes": 8 * d, "us": s * 1e6, "gb_s": 8 * d / s / 1e9})
    kc, vc = torch.zeros(Hkv, ctx, D, dtype=torch.float16), torch.zeros(Hkv, ctx, D, dtype=torch.float16)
    qkv, rope = torch.randn(1, (H + 2 * Hkv) * D), torch.tensor([[1.0, 0.0]] * (D // 2))
    pos = ctx - 1
    s = timed(lambda i: torch.ops.pinfer.attend_decode(qkv, rope, kc, vc, pos, H, Hkv, 0.125), 500, reps)
    kv_bytes = 2 * Hkv * ctx * D * 2
    out.append({"op": f"attention (pos {pos}, f16 cache)", "shape": f"{H}/{Hkv} heads", "bytes": kv_bytes,
                "us": s * 1e6, "gb_s": kv_bytes / s / 1e9})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=[*SHAPES, "all"], default="all")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--ctx", type=int, default=128, help="attention's context (positions read)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from pinfer_llm.runtime.cpu import kernels as cpu_kernels

    if not cpu_kernels.available():
        raise SystemExit(f"the C++ kernels are not available: {cpu_kernels.status()}")
    torch.set_num_threads(args.threads)
    res = {s: shape_rows(s, args.reps, args.ctx) for s in (SHAPES if args.shape == "all" else [args.shape])}
    if args.json:
        print(json.dumps({"threads": args.threads, "kernels": cpu_kernels.status(), "shapes": res}, indent=2))
        return
    print(f"{cpu_kernels.status()}, {args.threads} threads")
    for s, rows in res.items():
        print(f"\n{s}:")
        print(f"  {'op':34} {'shape':>14} {'bytes':>10} {'us':>8} {'GB/s':>7}")
        for r in rows:
            print(f"  {r['op']:34} {r['shape']:>14} {r['bytes']:>10} {r['us']:>8.1f} {r['gb_s']:>7.1f}")


if __name__ == "__main__":
    main()
