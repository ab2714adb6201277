"""One-token GEMVs from memory, several source trees side by side: which tile streams rows faster.

    python benchmarks/gemv_ab.py OLD/src NEW/src [--type Q4_0] [--rounds 9] [--threads 2]

Each tree's kernels are loaded in a worker process of their own (each tree builds its own library); every worker
makes the same random weights at a 1B llama's shapes (gate+up 11264 x 2048, qkv 2560 x 2048, down 2048 x 5632), as
many copies of each as fill ~400 MB so that every call reads its weights from beyond the caches, and times
torch.ops.pinfer.qmatmul of one token (the streaming tiles, forced). Rounds alternate the trees' order; reported per
shape: each tree's median us per call and its median per-round ratio to the first tree. Sequential runs of one tree
and then another scatter with the machine by more than the differences measured here (5-15%).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

# type id, bytes per block, values per block, where the block's f16 scales sit (set finite: random bytes would make
# infinities and NaNs, and denormal products that take microcode assists)
TYPES = {"Q4_0": (2, 18, 32, 0), "Q4_1": (3, 20, 32, 0, 2), "Q8_0": (8, 34, 32, 0), "Q6_K": (14, 210, 256, 208),
         "Q4_K": (12, 144, 256, 0, 2), "Q5_K": (13, 176, 256, 0, 2), "IQ4_XS": (23, 136, 256, 0)}
SHAPES = [("gate+up", 11264, 2048), ("qkv", 2560, 2048), ("down", 2048, 5632)]

# The worker makes its own weights rather than importing step_ops.weight: step_ops puts this checkout's src/ first on
# sys.path when imported, and the worker must import pinfer_llm from the tree it measures.
WORKER = r'''
import json, sys, time
sys.path.insert(0, sys.argv[1])
import numpy as np, torch
from pinfer_llm.runtime.cpu import kernels
assert kernels.available(), kernels.status()
t, bb, qk, *scales_at = (int(v) for v in sys.argv[2].split(","))
threads, shapes = int(sys.argv[3]), json.loads(sys.argv[4])
kernels.set_threads(threads)  # torch.set_num_threads, the kernels' loops included
rng = np.random.default_rng(0)
def weight(rows, cols):
    raw = rng.integers(0, 256, (rows, cols // qk, bb), dtype=np.uint8)
    for i, at in enumerate(scales_at):  # d, then a min's scale
        raw[:, :, at:at + 2] = np.full((rows, cols // qk, 1), 0.01 if i == 0 else 0.001, np.float16).view(np.uint8)
    return torch.from_numpy(raw.reshape(rows, -1))
sets = []
for _, r, c in shapes:
    copies = max(2, min(64, (400 << 20) // (r * c // qk * bb)))
    sets.append(([weight(r, c) for _ in range(copies)], torch.randn(1, c)))
for _ in sys.stdin:
    out = []
    for ws, x in sets:
        t0 = time.perf_counter()
        for i in range(3 * len(ws)):
            torch.ops.pinfer.qmatmul(x, [ws[i % len(ws)]], [t], 1 << 30)
        out.append((time.perf_counter() - t0) / (3 * len(ws)) * 1e6)
    print(json.dumps(out), flush=True)
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trees", nargs="+", help="src/ directories of checkouts (the first is the baseline)")
    ap.add_argument("--type", choices=list(TYPES), default="Q4_0")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    shapes = SHAPES + ([("head", 32000, 2048)] if args.type == "Q6_K" else [])  # llama.cpp's usual output type
    workers = [subprocess.Popen([sys.executable, "-c", WORKER, tree, ",".join(map(str, TYPES[args.type])),
                                 str(args.threads), json.dumps(shapes)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
               for tree in args.trees]
    res: list[list[list[float]]] = [[] for _ in args.trees]
    for r in range(args.rounds):
        order = range(len(workers)) if r % 2 == 0 else reversed(range(len(workers)))
        for i in order:
            workers[i].stdin.write("go\n")
            workers[i].stdin.flush()
            line = workers[i].stdout.readline()
            if not line:
                raise SystemExit(f"the worker of {args.trees[i]} failed")
            res[i].append(json.loads(line))
    for w in workers:
        w.stdin.close()
        w.wait()
    print(f"one-token {args.type} GEMV from memory, {args.threads} threads, {args.rounds} paired rounds "
          f"(median us per call; ratio: median of per-round ratios to {args.trees[0]})")
    for j, (name, rows, cols) in enumerate(shapes):
        cells = [f"{tree}: {statistics.median(x[j] for x in res[i]):.1f} us, "
                 f"{statistics.median(a[j] / b[j] for a, b in zip(res[i], res[0], strict=True)):.3f}x"
                 for i, tree in enumerate(args.trees)]
        print(f"  {name} {rows} x {cols}: " + "; ".join(cells))


if __name__ == "__main__":
    main()
