"""Sparse decode of pinfer vs PowerInfer's own C++ engine (CPU build), same file, same predictors, side by side.

    python benchmarks/vs_powerinfer.py --powerinfer /path/to/PowerInfer/build/bin/main            # makes the models
    python benchmarks/vs_powerinfer.py --powerinfer MAIN --model m.gguf --threads 2 --rounds 5 --json

The models (unless --model): a ~1B ReLU llama in PowerInfer's layout (synth.fast shape 1b: 22 x 2048 x 5632, F16,
ffn_down_t, predictors that mark ~10% of neurons active, powerinfer.sparse_threshold 0), and the same file quantised to
Q4_0 by PowerInfer's own `quantize` (passed with --quantize; the script never builds PowerInfer). Both engines read
the file's predictors and threshold, so they compute the same neurons.

Every round runs both engines once, each in a fresh process, in alternating order; THE result is the median over
rounds of the per-round ratio pinfer / PowerInfer (decode tokens per second). PowerInfer's speed is read from its own
timing line ("eval time = ... ms per token"); pinfer's from pi-run --json (decode tokens/s, the first token excluded in
both). Peak RSS of each process is reported too (pinfer's target: file + KV cache + 300 MB).

Beside each figure, the bytes bound: the weight bytes a token touches (every tensor but the embedding in full, and of
the FFN's neuron rows, ffn_gate/ffn_up/ffn_down_t, the share pinfer computed), read at the streaming bandwidth of
--threads threads; the figure's share of it says how far from memory speed the engine is. The bandwidth is measured
right before each pinfer run, and the share is the median of per-round shares (each run against its own probe): on a
VM the bandwidth drifts between runs (23.6-27.0 GB/s on one Xeon in a day), and one probe at the start made the
share move with it. The probe at the start and the share against it are reported too.
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]  # the checkout, without an install
PROMPT = "Once upon a time, in a land far away, there lived a"


def child_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


def run_pinfer(model: Path, threads: int, tokens: int) -> dict:
    cmd = [sys.executable, "-m", "pinfer_llm.cli.run", str(model), "-p", PROMPT, "-n", str(tokens), "-t", str(threads),
           "--temp", "0", "--sparse", "--gpu", "none", "-c", "256", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, errors="replace", cwd=ROOT)
    if out.returncode != 0:
        raise SystemExit(f"pi-run failed:\n{out.stderr[-2000:]}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    t = r["timings"]
    return {"decode_tps": t["decode_tokens_per_s"], "load_s": t["load_s"], "tokens": r["tokens"],
            "active": r.get("ffn_active_fraction")}


_EVAL = re.compile(r"eval time =\s*([\d.]+) ms /\s*(\d+) runs")
_LOAD = re.compile(r"load time =\s*([\d.]+) ms")


def run_powerinfer(main: str, model: Path, threads: int, tokens: int) -> dict:
    cmd = [main, "-m", str(model), "-p", PROMPT, "-n", str(tokens), "-t", str(threads), "--temp", "0", "-c", "256",
           "--ignore-eos", "--seed", "1"]
    # cwd: it writes main.log there. errors="replace": its output is not always UTF-8 (a 0xa0 byte ended a run)
    out = subprocess.run(cmd, capture_output=True, text=True, errors="replace", cwd=model.parent)
    if out.returncode != 0:
        raise SystemExit(f"PowerInfer failed ({' '.join(cmd)}):\n{out.stderr[-2000:]}")
    evals = [m for m in _EVAL.finditer(out.stderr) if "prompt eval" not in out.stderr[max(0, m.start() - 8):m.start()]]
    if not evals:
        raise SystemExit(f"no eval timing in PowerInfer's output:\n{out.stderr[-2000:]}")
    ms, runs = float(evals[-1].group(1)), int(evals[-1].group(2))
    load = _LOAD.search(out.stderr)
    return {"decode_tps": runs / (ms / 1000), "load_s": float(load.group(1)) / 1000 if load else None,
            "text": out.stdout[-200:]}


NEURON_ROWS = ("ffn_gate.weight", "ffn_up.weight", "ffn_down_t.weight")


def touched_bytes(model: Path, active: float) -> int:
    """Weight bytes one decode token reads at this active share of the FFN's neurons (the embedding: one row)."""
    from pinfer_llm.formats.reader import open_gguf  # PowerInfer's PWRI files too

    total = 0
    for t in open_gguf(model).tensors.values():
        if t.name == "token_embd.weight":
            total += t.nbytes // t.ne[-1]
        elif t.name.endswith(NEURON_ROWS):
            total += int(t.nbytes * active)
        elif not t.name.endswith("ffn_down.weight"):  # a dense ffn_down beside ffn_down_t is not read in sparse mode
            total += t.nbytes
    return total


def med(rows: list[dict], key: str) -> float:
    return round(statistics.median(x[key] for x in rows), 2)


def bound(model: Path, active: float, bandwidth: float, runs: list[dict]) -> dict:
    """The bytes bound of pinfer's runs: against the run's first probe (`bandwidth`, GB/s) for their median speed, and
    paired (each run's speed against the probe taken just before it; the median of those shares)."""
    nbytes = touched_bytes(model, active)
    tokens_per_s = bandwidth * 1e9 / nbytes
    shares = [r["decode_tps"] / (r["bandwidth_gbs"] * 1e9 / nbytes) for r in runs]
    return {"bytes_per_token": nbytes, "bandwidth_gbs": round(bandwidth, 2), "tokens_per_s": round(tokens_per_s, 1),
            "pinfer_share": round(statistics.median(r["decode_tps"] for r in runs) / tokens_per_s, 3),
            "round_bandwidth_gbs": [round(r["bandwidth_gbs"], 2) for r in runs],
            "pinfer_share_paired": round(statistics.median(shares), 3),
            "pinfer_shares": [round(x, 3) for x in shares]}


def make_models(args) -> list[Path]:
    from pinfer_llm.synth.fast import generate_fast

    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    tag = "" if args.sparsity == 0.9 else f"-s{args.sparsity:g}"
    f16 = d / f"pi-1b{tag}-f16.gguf"
    if not f16.exists():  # stats=False: PowerInfer loads no tensor it does not know
        generate_fast(f16, "1b", "f16", sparsity=args.sparsity, stats=False,
                      say=lambda msg: print(msg, file=sys.stderr))  # stdout is the --json output
    models = [f16]
    if args.quantize:
        q4 = d / f"pi-1b{tag}-q4_0.gguf"
        if not q4.exists():
            subprocess.run([args.quantize, str(f16), str(q4), "q4_0"], check=True, capture_output=True)
        models.append(q4)
    return models


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--powerinfer", required=True, help="PowerInfer's main (CPU build), never built by this script")
    ap.add_argument("--quantize", help="PowerInfer's quantize, to make the Q4_0 file")
    ap.add_argument("--model", action="append", help="use these files instead of making them (repeatable)")
    ap.add_argument("--dir", default="/tmp/pinfer-bench")
    ap.add_argument("--sparsity", type=float, default=0.9, help="planted sparsity of the made models (their "
                    "predictors select somewhat more: pi-run reports the fraction it computed)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    models = [Path(m) for m in args.model] if args.model else make_models(args)
    from pinfer_llm.planner.hardware import measure_cpu_bandwidth

    bandwidth = measure_cpu_bandwidth(args.threads)  # GB/s
    summary = []
    for model in models:
        rows = {"pinfer": [], "powerinfer": []}
        for r in range(args.rounds):
            order = ["pinfer", "powerinfer"] if r % 2 == 0 else ["powerinfer", "pinfer"]
            for e in order:
                bw = measure_cpu_bandwidth(args.threads) if e == "pinfer" else None  # this run's probe
                before = child_rss_mb()
                t0 = time.perf_counter()
                res = (run_pinfer(model, args.threads, args.tokens) if e == "pinfer"
                       else run_powerinfer(args.powerinfer, model, args.threads, args.tokens))
                res["wall_s"] = time.perf_counter() - t0
                if bw is not None:
                    res["bandwidth_gbs"] = bw
                res["peak_rss_mb_at_least"] = max(child_rss_mb(), before)
                rows[e].append(res)
            if not args.json:
                print(f"{model.name} round {r + 1}: pinfer {rows['pinfer'][-1]['decode_tps']:.2f} tok/s, PowerInfer "
                      f"{rows['powerinfer'][-1]['decode_tps']:.2f} tok/s", file=sys.stderr)
        ratios = [p["decode_tps"] / q["decode_tps"] for p, q in zip(rows["pinfer"], rows["powerinfer"], strict=True)]
        summary.append({"model": str(model), "bytes": model.stat().st_size, "threads": args.threads,
                        "tokens": args.tokens, "paired_ratio_median": round(statistics.median(ratios), 3),
                        "paired_ratios": [round(x, 3) for x in ratios],
                        "pinfer_decode_tps_median": med(rows["pinfer"], "decode_tps"),
                        "powerinfer_decode_tps_median": med(rows["powerinfer"], "decode_tps"),
                        "pinfer_active_fraction": rows["pinfer"][0]["active"],
                        "bound": bound(model, rows["pinfer"][0]["active"], bandwidth, rows["pinfer"]),
                        "pinfer_load_s": round(statistics.median(x["load_s"] for x in rows["pinfer"]), 3)})
    if args.json:
        print(json.dumps(summary, indent=1))
        return
    for s in summary:
        print(f"RESULT {Path(s['model']).name}: pinfer / PowerInfer sparse decode = {s['paired_ratio_median']:.2f}x "
              f"(median of per-round ratios {s['paired_ratios']}; pinfer {s['pinfer_decode_tps_median']} tok/s, "
              f"PowerInfer {s['powerinfer_decode_tps_median']} tok/s, {s['threads']} threads; pinfer computed "
              f"{s['pinfer_active_fraction']:.1%} of neurons)")
        b = s["bound"]
        lo, hi = min(b["round_bandwidth_gbs"]), max(b["round_bandwidth_gbs"])
        print(f"  bound: {b['bytes_per_token'] / 1e6:.1f} MB touched per token; each pinfer run against the "
              f"bandwidth probed just before it ({lo:.1f}-{hi:.1f} GB/s, {s['threads']} threads): pinfer at "
              f"{b['pinfer_share_paired']:.0%} of it (median of per-round "
              f"shares {b['pinfer_shares']}); against the first probe ({b['bandwidth_gbs']:.1f} GB/s = "
              f"{b['tokens_per_s']:.1f} tok/s) {b['pinfer_share']:.0%}")


if __name__ == "__main__":
    main()
