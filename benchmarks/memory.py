"""Resident memory and load time of pi-run on models of real size, weights read in place from the file.

    python benchmarks/memory.py            # 1B F16 and Q4_0, 7B and 13B Q4_0 (synth.fast), dense and sparse
    python benchmarks/memory.py --shape llama2-7b --type q4_0 --mode sparse --json

For each model and FFN mode, pi-run runs in a fresh process (a prompt, then --tokens tokens) and the process's peak
resident set (getrusage of the child) is compared with the target file size + KV cache + 300 MB. The KV cache is
pi-run's (f16 keys and values for -c positions, its default). Load time is pi-run's own (mapping and metadata, no
copy), read from --json; the first run after making a model also pays for reading it from disk, so each case runs
twice and the second (warm page cache) is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]  # the checkout, without an install
SLACK_MB = 300
CASES = [("1b", "f16"), ("1b", "q4_0"), ("llama2-7b", "q4_0"), ("llama2-13b", "q4_0")]


def kv_bytes(shape: str, ctx: int) -> int:
    from pinfer_llm.synth.fast import SHAPES

    L, d, _, nh, nkv, _ = SHAPES[shape]
    return L * 2 * nkv * ctx * (d // nh) * 2  # f16, pi-run's default


def run(model: Path, mode: str, threads: int, tokens: int, ctx: int) -> dict:
    """One pi-run in a child process that only this call waits for: its peak RSS is RUSAGE_CHILDREN's maximum
    only if it exceeds every earlier child's, so each run is wrapped in its own interpreter that reports it."""
    code = ("import resource, subprocess, sys, json; "
            "r = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
            "print(json.dumps({'rc': r.returncode, 'out': r.stdout, 'err': r.stderr[-1500:], "
            "'rss_kb': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))")
    cmd = [sys.executable, "-c", code, sys.executable, "-m", "pinfer_llm.cli.run", str(model), "-p", "Once upon a time",
           "-n", str(tokens), "-t", str(threads), "--temp", "0", f"--{mode}", "--gpu", "none", "-c", str(ctx),
           "--json"]
    t0 = time.perf_counter()
    res = json.loads(subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=True).stdout)
    if res["rc"] != 0:
        raise SystemExit(f"pi-run failed on {model} ({mode}):\n{res['err']}")
    r = json.loads(res["out"].strip().splitlines()[-1])
    return {"peak_rss_mb": res["rss_kb"] / 1024, "load_s": r["timings"]["load_s"],
            "decode_tps": r["timings"]["decode_tokens_per_s"], "wall_s": time.perf_counter() - t0,
            "active": r.get("ffn_active_fraction"), "notices": r.get("notices")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", help="one shape of synth.fast (default: the four cases)")
    ap.add_argument("--type", default="q4_0")
    ap.add_argument("--mode", action="append", help="dense and/or sparse (default both)")
    ap.add_argument("--dir", default="/tmp/pinfer-bench")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from pinfer_llm.synth.fast import generate_fast

    cases = [(args.shape, args.type)] if args.shape else CASES
    modes = args.mode or ["dense", "sparse"]
    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    rows = []
    for shape, qtype in cases:
        model = d / f"mem-{shape}-{qtype}.gguf"
        if not model.exists():
            generate_fast(model, shape, qtype, stats=False, say=lambda m: print(m, file=sys.stderr))
        size = model.stat().st_size
        for mode in modes:
            run(model, mode, args.threads, 2, args.ctx)  # warms the page cache (and the kernel build)
            r = run(model, mode, args.threads, args.tokens, args.ctx)
            target_mb = (size + kv_bytes(shape, args.ctx)) / 2**20 + SLACK_MB
            rows.append({"model": model.name, "file_mb": round(size / 2**20), "mode": mode,
                         "kv_mb": round(kv_bytes(shape, args.ctx) / 2**20), "peak_rss_mb": round(r["peak_rss_mb"]),
                         "target_mb": round(target_mb), "within": r["peak_rss_mb"] <= target_mb,
                         "load_s": round(r["load_s"], 3), "decode_tps": round(r["decode_tps"], 2),
                         "active": r["active"], "notices": r["notices"]})
            if not args.json:
                x = rows[-1]
                print(f"{x['model']} {mode}: peak RSS {x['peak_rss_mb']} MB (file {x['file_mb']} + KV {x['kv_mb']} + "
                      f"{SLACK_MB} = {x['target_mb']}: {'within' if x['within'] else 'OVER'}), load {x['load_s']} s, "
                      f"{x['decode_tps']} tok/s", flush=True)
    if args.json:
        print(json.dumps({"cpu": os.uname().machine, "threads": args.threads, "ctx": args.ctx, "rows": rows},
                         indent=1))


if __name__ == "__main__":
    main()
