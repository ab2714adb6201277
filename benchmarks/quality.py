"""What activation sparsity costs a SwiGLU model: SmolLM2 perplexity, dense vs CATS masks, on held-out text.

    python benchmarks/quality.py                       # --sparsity 0.3 (profiles and trains on first use, cached)
    python benchmarks/quality.py --sparsity 0.3 --sparsity 0.5 --json

For each target sparsity S: `pi-profile smollm2 --sparsity S --train-predictors` writes a copy of the demo model with
per-layer CATS thresholds and predictors (benchmarks/results/smollm2-cats-S.gguf). Then perplexity over the package's
held-out text (never profiled), llama.cpp-style windows, for: dense; exact CATS masks (--oracle-masks: every gate
computed, neurons with |silu(gate)| <= threshold dropped); predicted masks (--sparse, what a real run does).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "src")]  # the checkout, without an install


def ensure_profiled(s: float, threads: int) -> Path:
    out = ROOT / f"benchmarks/results/smollm2-cats-{s:g}.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        print(f"pi-profile smollm2 --sparsity {s:g} --train-predictors -o {out.name} ...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pinfer_llm.cli.profile", "smollm2", "--sparsity", str(s),
                        "--train-predictors", "-o", str(out), "-t", str(threads)], check=True, cwd=ROOT)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sparsity", type=float, action="append")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    levels = args.sparsity or [0.3]

    from pinfer_llm.runtime import load_model
    from pinfer_llm.runtime.perplexity import perplexity
    from pinfer_llm.runtime.profiling.corpus import HELDOUT

    text = HELDOUT.read_text(encoding="utf-8")
    rows = []
    dense = perplexity(load_model("smollm2", threads=args.threads, ctx_size=args.ctx, ffn_mode="dense"), text, args.ctx)
    rows.append({"sparsity": 0.0, "mode": "dense", "ppl": dense.ppl, "stderr": dense.stderr, "active": 1.0})
    for s in levels:
        path = ensure_profiled(s, args.threads)
        for mode in ("oracle", "sparse"):
            m = load_model(path, threads=args.threads, ctx_size=args.ctx, ffn_mode=mode)
            r = perplexity(m, text, args.ctx)
            frac = m.sparsity()
            rows.append({"sparsity": s, "mode": mode, "ppl": r.ppl, "stderr": r.stderr,
                         "active": sum(frac) / len(frac)})
    for r in rows:
        r["increase"] = r["ppl"] / dense.ppl - 1
    if args.json:
        print(json.dumps({"text": str(HELDOUT), "tokens_scored": dense.tokens_scored, "ctx": args.ctx,
                          "rows": rows}, indent=2))
        return
    print(f"SmolLM2-135M perplexity on {HELDOUT.name} ({dense.tokens_scored} tokens scored, windows of {args.ctx})")
    print(f"{'target sparsity':>16} {'masks':>10} {'neurons computed':>17} {'perplexity':>12} {'vs dense':>9}")
    for r in rows:
        masks = {"dense": "none", "oracle": "exact CATS", "sparse": "predicted"}[r["mode"]]
        print(f"{r['sparsity']:>16.0%} {masks:>10} {r['active']:>17.1%} {r['ppl']:>8.3f}±{r['stderr']:<5.2f} "
              f"{r['increase']:>+8.1%}")


if __name__ == "__main__":
    main()
