"""Storing statistics and a plan into a 45 GB Llama2-70B-shaped Q4_0 PowerInfer file, in place, on a machine with less
RAM than the file: wall time, peak memory, file size and disk use.

    python benchmarks/inplace_update.py [--dir DIR] [--layers 80] [--keep]

Makes DIR/llama2-70b-q4_0.gguf (PWRI; 80 x 8192 x 28672, GQA 64/8, vocab 32000, Q4_0 weights with ffn_down_t, F16
predictors of rank 1024: 44.6 GB; the tensor data is a repeated random block, written for real, not sparse) and a
PowerInfer activation/ directory with power-law counts, then runs, each under /usr/bin/time -v:
  1. pi-plan FILE --gpu rtx4090 --activations DIR     the first write into a file pinfer never wrote
  2. pi-profile FILE --import-activations DIR         statistics into the file (it now has a section)
  3. pi-plan FILE --gpu rtx4090                        a new plan from the stored statistics, in place
and reports for each the wall time, peak RSS, `ls -l` size and `du` disk use before and after, and whether the
model's bytes (header and tensor data, sampled: the header, the first and last 64 MiB of data and 64 random MiB)
are unchanged. Everything it made is deleted unless --keep.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

_TREE = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(_TREE), str(_TREE / "src")]  # the checkout, without an install

from pinfer_llm.formats import constants as C  # noqa: E402
from pinfer_llm.formats.encoder import encode_header, pwrite_all  # noqa: E402

BIN = Path(sys.executable).parent
Q4_0, F32, F16 = 2, 0, 1  # PowerInfer's ids (the same as today's for these)


def q4_bytes(n: int) -> int:
    return n // 32 * 18


def make_model(path: Path, n_layer: int, n_embd=8192, n_ff=28672, n_head=64, n_head_kv=8, vocab=32000,
               rank=1024) -> int:
    kv = n_embd // n_head * n_head_kv
    tensors = [("token_embd.weight", (n_embd, vocab), Q4_0, q4_bytes(n_embd * vocab))]
    for b in range(n_layer):
        for name, ne, t, nb in [
            ("attn_norm.weight", (n_embd,), F32, 4 * n_embd),
            ("attn_q.weight", (n_embd, n_embd), Q4_0, q4_bytes(n_embd * n_embd)),
            ("attn_k.weight", (n_embd, kv), Q4_0, q4_bytes(n_embd * kv)),
            ("attn_v.weight", (n_embd, kv), Q4_0, q4_bytes(n_embd * kv)),
            ("attn_output.weight", (n_embd, n_embd), Q4_0, q4_bytes(n_embd * n_embd)),
            ("ffn_norm.weight", (n_embd,), F32, 4 * n_embd),
            ("ffn_gate.weight", (n_embd, n_ff), Q4_0, q4_bytes(n_embd * n_ff)),
            ("ffn_up.weight", (n_embd, n_ff), Q4_0, q4_bytes(n_embd * n_ff)),
            ("ffn_down_t.weight", (n_embd, n_ff), Q4_0, q4_bytes(n_embd * n_ff)),
            ("fc1.weight", (n_embd, rank), F16, 2 * n_embd * rank),
            ("fc2.weight", (rank, n_ff), F16, 2 * rank * n_ff),
        ]:
            tensors.append((f"blk.{b}.{name}", ne, t, nb))
    tensors += [("output_norm.weight", (n_embd,), F32, 4 * n_embd),
                ("output.weight", (n_embd, vocab), Q4_0, q4_bytes(n_embd * vocab))]
    a = "llama"
    meta = {C.ARCHITECTURE: a, C.NAME: "Llama2-70B-shaped (benchmark)", f"{a}.context_length": 4096,
            f"{a}.embedding_length": n_embd, f"{a}.block_count": n_layer, f"{a}.feed_forward_length": n_ff,
            f"{a}.attention.head_count": n_head, f"{a}.attention.head_count_kv": n_head_kv,
            f"{a}.attention.layer_norm_rms_epsilon": 1e-5, f"{a}.rope.dimension_count": n_embd // n_head,
            f"{a}.vocab_size": vocab, C.FILE_TYPE: 2, C.SPARSE_THRESHOLD: np.float32(0.0)}
    infos, pos = [], 0
    for name, ne, t, nb in tensors:
        infos.append((name, ne, t, pos))
        pos += -(-nb // 32) * 32
    head = encode_header(C.PWRI_MAGIC, meta, {}, infos, 32)
    data_offset = -(-len(head) // 32) * 32
    block = np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        pwrite_all(fd, head.ljust(data_offset, b"\0"), 0)
        end = data_offset + pos
        at = data_offset
        while at < end:
            n = min(block.nbytes, end - at)
            pwrite_all(fd, block[:n], at)
            at += n
        os.fsync(fd)
    finally:
        os.close(fd)
    return data_offset + pos


def make_activations(d: Path, n_layer: int, n_ff: int = 28672, tokens: int = 100_000) -> None:
    import torch

    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    for b in range(n_layer):
        rank = rng.permutation(n_ff) + 1
        freq = np.clip(0.9 * rank ** -0.6, 0, 1)  # power law: a few hot neurons, a long cold tail
        torch.save(torch.from_numpy(np.rint(freq * tokens).astype(np.int64)), d / f"activation_{b}.pt")


def sample_digest(path: Path, end: int) -> str:
    h = hashlib.sha256()
    rng = np.random.default_rng(2)
    spots = [0, max(end - (64 << 20), 0)] + sorted(int(x) for x in rng.integers(0, end - (1 << 20), 64))
    with open(path, "rb") as fh:
        for at, n in [(spots[0], 64 << 20), (spots[1], 64 << 20)] + [(s, 1 << 20) for s in spots[2:]]:
            fh.seek(at)
            h.update(fh.read(min(n, end - at)))
    return h.hexdigest()


def disk(path: Path) -> dict:
    st = os.stat(path)
    return {"size": st.st_size, "disk": st.st_blocks * 512}


def timed(cmd: list) -> dict:
    t0 = time.perf_counter()
    p = subprocess.run(["/usr/bin/time", "-v", *map(str, cmd)], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr)
    return {"cmd": " ".join(map(str, cmd)), "rc": p.returncode, "wall_s": round(wall, 2),
            "peak_rss_mb": round(int(rss.group(1)) / 1024, 1) if rss else None,
            "tail": (p.stderr.strip().splitlines() or [""])[-25:] if p.returncode else []}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/work/tmp-inplace-bench")
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    model, act = d / "llama2-70b-q4_0.gguf", d / "activation"
    results = {}
    try:
        t0 = time.perf_counter()
        end = make_model(model, args.layers)
        make_activations(act, args.layers)
        results["make"] = {"seconds": round(time.perf_counter() - t0, 1), **disk(model)}
        print(json.dumps({"made": results["make"]}), flush=True)
        digest = sample_digest(model, end)
        steps = [("first write (plan into a file pinfer never wrote)",
                  [BIN / "pi-plan", model, "--gpu", "rtx4090", "--activations", act, "--json"]),
                 ("statistics (pi-profile --import-activations)",
                  [BIN / "pi-profile", model, "--import-activations", act, "--tokens", 100_000, "--json"]),
                 ("plan from stored statistics (pi-plan)", [BIN / "pi-plan", model, "--gpu", "rtx4090", "--json"])]
        for label, cmd in steps:
            before = disk(model)
            r = timed(cmd)
            after = disk(model)
            r.update(before=before, after=after, model_bytes_unchanged=sample_digest(model, end) == digest)
            results[label] = r
            print(json.dumps({label: r}), flush=True)
        # the write alone, in process: the stored plan's tensors and keys stored again (what pi-plan's write costs
        # without its interpreter start, torch import and ILP solve)
        from pinfer_llm.formats.reader import open_gguf
        from pinfer_llm.formats.update import update_model

        f = open_gguf(model)
        plan = {n: np.array(f.raw(n)) for n in f.tensors if n.endswith((".gpu_idx", ".gpu_bucket"))}
        keys = {k: v for k, v in f.metadata.items() if k.startswith(C.PLAN_PREFIX)}
        f.close()
        del f
        before = disk(model)
        t0 = time.perf_counter()
        update_model(model, set_metadata=keys, set_tensors=plan)
        results["write alone"] = {"seconds": round(time.perf_counter() - t0, 3), "before": before,
                                  "after": disk(model), "plan_bytes": sum(a.nbytes for a in plan.values()),
                                  "model_bytes_unchanged": sample_digest(model, end) == digest}
        print(json.dumps({"write alone": results["write alone"]}), flush=True)
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        print(f"machine RAM {ram / 2**30:.1f} GiB; model {end / 2**30:.1f} GiB")
    finally:
        if not args.keep:
            shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
