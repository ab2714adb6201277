"""Falcon and OPT end to end: sparse decode (predictors) vs dense decode on planted ReLU models, and top-1 agreement.

    python benchmarks/archs_sparse.py                  # makes both models, their predictors and dense twins first
    python benchmarks/archs_sparse.py --arch opt --rounds 5 --json

1. The models: synth's "falcon" (ReluFalcon: parallel block, LayerNorm, NeoX rope, fused QKV, grouped KV heads in the
   40B layout, relu(up x)) and "opt" (LayerNorm, learned positions, biases everywhere, MHA, relu(up x + b)) variants,
   n_ff = 4 n_embd as both families have, 90% planted sparsity, F32, synth's byte-level vocabulary padded to 32000
   tokens (as benchmarks/e2e_sparse.py: the built-in corpus then gives ~17k calibration tokens). Defaults: 12 layers of
   width 2048 (Falcon ~0.64B parameters, OPT ~0.74B).
2. Predictors: `pi-profile MODEL --train-predictors --recall 0.99` over the built-in corpus, written into the file.
3. The dense baseline: the same weights in llama.cpp's layout (ffn_down [d, n_ff], no predictors), a twin file made
   once: every weight is read on every token, the work llama.cpp does. pinfer's dense mode over a PowerInfer file
   runs the sparse kernel over every neuron, which for ReLU skips the down rows of inactive neurons (a lossless
   speed-up: the "oracle" row below measures it), so it is not the dense baseline.
4. Speed: the modes decode the held-out text in lockstep in one process (benchmarks/e2e_sparse.lockstep: one step of
   each mode per position, the order rotating, `--rounds` passes), so bursts of other work on this shared machine
   hit every mode of a position. Reported: each mode's median step as tok/s and the median over positions of
   dense step / mode step (the paired speed-up), with per-round ratios.
5. Quality: top-1 agreement with dense over --agree-tokens held-out positions, teacher-forced.
6. With --breakdown: where a decode step's time goes in each mode (attention, FFN including the predictor, output
   head; medians over the decoded positions), which bounds the speed-up any predictor can reach.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "src")]  # the checkout, without an install

from benchmarks.e2e_sparse import PROMPT_TOKENS, add_run_args, agreement, dense_twin, lockstep  # noqa: E402

RESULTS = ROOT / "benchmarks/results"
SHAPES = {"falcon": "12,2048,8192,32,2", "opt": "12,2048,8192,32,32"}  # n_layer,n_embd,n_ff,n_head,n_head_kv


def paths(arch: str, args) -> tuple[Path, Path]:
    """(the PowerInfer file with predictors, its dense llama.cpp-layout twin), named by every shaping argument."""
    shape = args.shape or SHAPES[arch]
    stem = f"planted-{arch}-{shape.replace(',', 'x')}-{args.dtype}-s{args.sparsity:g}-r{args.recall:g}"
    return RESULTS / f"{stem}.gguf", RESULTS / f"{stem}-dense.gguf"


def ensure_models(arch: str, args) -> tuple[Path, Path]:
    from pinfer_llm.formats.reader import open_gguf
    from pinfer_llm.synth import SynthSpec, generate

    path, twin = paths(arch, args)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        n_layer, d, ff, h, hkv = (int(v) for v in (args.shape or SHAPES[arch]).split(","))
        print(f"generating {path} ...", file=sys.stderr)
        t = time.perf_counter()
        res = generate(path, SynthSpec(n_layer=n_layer, n_embd=d, n_ff=ff, n_head=h, n_head_kv=hkv, dtype=args.dtype,
                                       sparsity=args.sparsity, seed=0, vocab="bytes", vocab_size=32000, variant=arch,
                                       name=f"planted-relu{arch}"))
        print(f"  {res.n_params / 1e9:.2f}B parameters in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    if not open_gguf(path).has("blk.0.fc1.weight"):
        print("training predictors (pi-profile --train-predictors) ...", file=sys.stderr)
        cmd = [sys.executable, "-m", "pinfer_llm.cli.profile", str(path), "--train-predictors", "--recall",
               str(args.recall), "-t", str(args.threads)]
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=sys.stderr)  # stdout stays this script's (--json)
    if not twin.exists():
        print(f"writing the dense twin {twin} ...", file=sys.stderr)
        dense_twin(path, twin)
    return path, twin


def measure(arch: str, args) -> dict:
    from pinfer_llm.runtime import load_model
    from pinfer_llm.runtime.cpu import kernels as cpu_kernels
    from pinfer_llm.runtime.profiling.corpus import HELDOUT

    path, twin = ensure_models(arch, args)
    ctx = max(256, args.agree_tokens + 8, PROMPT_TOKENS + args.tokens + 8)
    dense = load_model(twin, threads=args.threads, ffn_mode="dense", ctx_size=ctx)
    assert not dense.cfg.down_transposed and not dense.cfg.has_predictors
    ids = dense.tokenizer.encode(HELDOUT.read_text(encoding="utf-8"))
    models = {"dense": dense}
    for mode in ["sparse"] + ([] if args.no_oracle else ["oracle"]):
        models[mode] = load_model(path, threads=args.threads, ffn_mode=mode, ctx_size=ctx)
    res = lockstep(models, ids[:PROMPT_TOKENS + 1 + args.tokens], args.rounds)
    out = {"arch": arch, "model": str(path), "dense_twin": str(twin), "params": dense.cfg.n_params,
           "threads": args.threads, "rounds": args.rounds, "tokens": args.tokens, "kernels": cpu_kernels.status(),
           "dense_decode_tps": res["dense"]["decode_tps"]}
    for mode in models:
        if mode != "dense":
            out[mode] = res[mode] | {"agreement": agreement(dense, models[mode], ids[:args.agree_tokens])}
    if args.breakdown:
        span = ids[:PROMPT_TOKENS + 1 + args.tokens]
        out["breakdown"] = {mode: breakdown(models[mode], span) for mode in models}
    return out


def breakdown(model, ids: list[int]) -> dict:
    """Median milliseconds per decode step spent in attention, the FFN (predictor included) and the output head:
    Transformer.forward's steps with a timer around each, over ids after a PROMPT_TOKENS prompt."""
    import statistics

    import torch

    tr = model.transformer
    parts: dict[str, list[float]] = {"attention_ms": [], "ffn_ms": [], "head_ms": []}
    with torch.inference_mode():
        tr.forward(torch.tensor(ids[:PROMPT_TOKENS]), 0)
        for p in range(PROMPT_TOKENS, len(ids)):
            t = {k: 0.0 for k in parts}
            x = tr.embed(torch.tensor([ids[p]]), p)
            for li, b in enumerate(tr.blocks):
                t0 = time.perf_counter()
                xf, resid, x = tr.attend(li, b, x, p)
                t1 = time.perf_counter()
                x = x + tr.ffn(b, xf, resid)
                t["attention_ms"] += t1 - t0
                t["ffn_ms"] += time.perf_counter() - t1
            t0 = time.perf_counter()
            tr.output(tr.norm(x, tr.output_norm))
            t["head_ms"] += time.perf_counter() - t0
            for k in parts:
                parts[k].append(1e3 * t[k])
    return {k: round(statistics.median(v), 2) for k, v in parts.items()}


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", action="append", choices=list(SHAPES), help="falcon, opt (default: both)")
    ap.add_argument("--shape", help="n_layer,n_embd,n_ff,n_head,n_head_kv (default per arch: "
                    + "; ".join(f"{a} {s}" for a, s in SHAPES.items()) + ")")
    add_run_args(ap)
    ap.add_argument("--breakdown", action="store_true", help="also time attention / FFN / head per decode step")
    args = ap.parse_args()

    results = [measure(arch, args) for arch in args.arch or list(SHAPES)]
    if args.json:
        print(json.dumps({"cpu": cpu_name(), "results": results}, indent=2))
        return
    print(f"{cpu_name()}, {args.threads} threads")
    for r in results:
        for mode in ("sparse", "oracle"):
            if mode in r:
                m, agree = r[mode], r[mode]["agreement"]
                print(f"{r['arch']} ({r['params'] / 1e9:.2f}B) {mode}: {m['decode_tps']:.2f} vs dense "
                      f"{r['dense_decode_tps']:.2f} tok/s (medians of {m['steps']} steps), speed-up "
                      f"{m['speedup_median_of_pairs']:.2f}x (median of paired steps; per round: "
                      f"{', '.join(f'{x:.2f}' for x in m['speedup_per_round'])}); computes {m['active_fraction']:.1%}"
                      f" of FFN neurons; top-1 agreement with dense {agree['top1_agreement']:.3f} over "
                      f"{agree['positions']} held-out positions")
        for mode, b in r.get("breakdown", {}).items():
            print(f"  {mode} step: attention {b['attention_ms']} ms, FFN {b['ffn_ms']} ms, head {b['head_ms']} ms")


if __name__ == "__main__":
    main()
