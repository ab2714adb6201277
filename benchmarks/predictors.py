"""Predictor quality and pi-profile speed (issue targets), side by side in one run.

    python benchmarks/predictors.py                      # planted model + demo model, 1 run each (~5-10 min)
    python benchmarks/predictors.py --repeats 3 --json   # medians over 3 runs of each pi-profile command
    python benchmarks/predictors.py --skip-demo          # planted model only

1. Planted model (synth, ReluLLaMA-shaped, ~90% sparse, F16 weights): `pi-profile --train-predictors` on the
   built-in corpus. Per layer: measured sparsity, chosen hidden size, predictor bytes as % of the layer's FFN bytes,
   recall / precision / predicted density on the profiler's held-out test tokens, and recall again through the
   runtime's load_predictors on runtime/profiling/corpus/heldout.txt (text the profiler never saw). Also the bytes a
   sparse FFN would read per token relative to dense: (predictor + predicted rows) / FFN.
   Targets: recall >= 0.95 in every layer, predictor bytes <= 10% of the FFN's.
2. Demo model: wall time of `pi-profile smollm2 --sparsity 0.3 --train-predictors -o OUT` (target: < 300 s on 2
   cores), with the CATS thresholds' achieved sparsity and the predictors' recall/precision.
Timings are medians over --repeats runs; the machine's load average is printed because other work slows them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_TREE = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(_TREE), str(_TREE / "src")]  # the checkout, without an install

import torch  # noqa: E402

from pinfer_llm import synth  # noqa: E402
from pinfer_llm.formats.reader import open_gguf  # noqa: E402
from pinfer_llm.runtime.engine import load_model  # noqa: E402
from pinfer_llm.runtime.ffn.predictor import load_predictors  # noqa: E402
from pinfer_llm.runtime.profiling.corpus import HELDOUT  # noqa: E402

PLANTED = dict(n_layer=4, n_embd=1024, n_ff=2816, n_head=16, n_head_kv=4, dtype="f16", sparsity=0.9, skew=1.0)


def pi_profile(args: list[str], threads: int) -> tuple[float, dict]:
    """Run the real CLI in a fresh process; (wall seconds, its --json summary)."""
    cmd = [sys.executable, "-m", "pinfer_llm.cli.profile", *args, "-t", str(threads), "--json"]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent)
    wall = time.perf_counter() - t0
    if res.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stderr.strip()}")
    return wall, json.loads(res.stdout)


def heldout_recall(path: Path, ctx: int = 512) -> list[dict]:
    """Per layer recall/precision of the stored predictors (runtime loader) against exact masks on heldout.txt."""
    m = load_model(path, ctx_size=ctx, ffn_mode="dense")
    preds = load_predictors(m.file, m.cfg.n_layer)
    ids = m.tokenizer.encode(HELDOUT.read_text(encoding="utf-8"))
    tp = [0] * m.cfg.n_layer
    pos = [0] * m.cfg.n_layer
    pred_n = [0] * m.cfg.n_layer
    blocks = m.transformer.blocks
    saved = [b.ffn for b in blocks]

    class Spy:
        def __init__(self, ffn, i):
            self.ffn, self.i = ffn, i

        def __call__(self, x, residual):
            gate = self.ffn.pre_activations(x)[0]
            truth, guess = gate > 0, preds[self.i].mask(residual)
            tp[self.i] += int((truth & guess).sum())
            pos[self.i] += int(truth.sum())
            pred_n[self.i] += int(guess.sum())
            return self.ffn(x, residual)

    try:
        for i, b in enumerate(blocks):
            b.ffn = Spy(b.ffn, i)
        with torch.inference_mode():
            for s in range(0, len(ids), ctx):
                m.transformer.forward(torch.tensor(ids[s:s + ctx]), 0)
    finally:
        for b, f in zip(blocks, saved, strict=True):
            b.ffn = f
    return [{"recall": tp[i] / max(pos[i], 1), "precision": tp[i] / max(pred_n[i], 1)} for i in range(len(tp))]


def planted_benchmark(tmp: Path, repeats: int, threads: int, model: Path | None) -> dict:
    if model is None:
        model = tmp / "planted.gguf"
        t0 = time.perf_counter()
        synth.generate(model, synth.SynthSpec(**PLANTED))
        gen_s = time.perf_counter() - t0
    else:
        gen_s = None
    out = tmp / "planted-pred.gguf"
    walls, summary = [], None
    for _ in range(repeats):
        wall, summary = pi_profile([str(model), "--train-predictors", "-o", str(out)], threads)
        walls.append(wall)
    held = heldout_recall(out)
    f = open_gguf(out)
    ffn_bytes = summary["ffn_bytes_per_layer"]
    layers = []
    for row, h, fb in zip(summary["layers"], held, ffn_bytes, strict=True):
        layers.append({**{k: row[k] for k in ("layer", "sparsity", "hidden", "bytes_pct", "recall", "precision",
                                               "predicted_density")},
                       "heldout_recall": h["recall"], "heldout_precision": h["precision"],
                       "read_vs_dense": (row["predictor_bytes"] + row["predicted_density"] * fb) / fb})
    total_pred = sum(r["predictor_bytes"] for r in summary["layers"])
    return {"model": str(model), "shape": PLANTED, "generate_s": gen_s, "tokens": summary["tokens"],
            "pi_profile_wall_s": walls, "pi_profile_wall_median_s": statistics.median(walls),
            "stage_seconds": summary["seconds"], "layers": layers,
            "predictor_bytes_pct_total": 100 * total_pred / sum(ffn_bytes),
            "sparse_threshold": summary.get("sparse_threshold"),
            "per_layer_thresholds": f.get("pinfer.predictor.threshold") is not None,
            "targets": {"recall>=0.95 every layer (test)": all(r["recall"] >= 0.95 for r in layers),
                        "recall>=0.95 every layer (heldout.txt)": all(r["heldout_recall"] >= 0.95 for r in layers),
                        "predictor bytes <= 10% of FFN": all(r["bytes_pct"] <= 10.0 for r in layers)}}


def demo_benchmark(tmp: Path, repeats: int, threads: int) -> dict:
    out = tmp / "smollm2-cats.gguf"
    walls, summary = [], None
    for _ in range(repeats):
        wall, summary = pi_profile(["smollm2", "--sparsity", "0.3", "--train-predictors", "-o", str(out)], threads)
        walls.append(wall)
    rows = summary["layers"]
    med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
    return {"command": "pi-profile smollm2 --sparsity 0.3 --train-predictors -o OUT", "tokens": summary["tokens"],
            "wall_s": walls, "wall_median_s": statistics.median(walls), "stage_seconds": summary["seconds"],
            "cats_sparsity_min": min(r["sparsity"] for r in rows),
            "cats_sparsity_max": max(r["sparsity"] for r in rows),
            "hidden": sorted({r["hidden"] for r in rows}), "bytes_pct_median": med("bytes_pct"),
            "recall_median": med("recall"), "recall_min": min(r["recall"] for r in rows),
            "precision_median": med("precision"), "predicted_density_median": med("predicted_density"),
            "true_density_median": statistics.median(1 - r["sparsity"] for r in rows),  # active share, exact masks
            "targets": {"wall < 300 s": statistics.median(walls) < 300}}


def print_report(res: dict) -> None:
    print(f"load average {res['loadavg']}, {res['threads']} threads, torch {torch.__version__}")
    if "planted" in res:
        p = res["planted"]
        s = p["shape"]
        print(f"\nplanted model {s['n_layer']}x{s['n_embd']}x{s['n_ff']} {s['dtype']}, planted sparsity "
              f"{s['sparsity']}, skew {s['skew']}; {p['tokens']} profiled tokens; pi-profile --train-predictors "
              f"{p['pi_profile_wall_median_s']:.1f} s median of {len(p['pi_profile_wall_s'])} ({p['stage_seconds']})")
        print(f"{'layer':>5} {'sparsity':>8} {'hidden':>6} {'bytes%':>6} {'recall':>6} {'prec':>6} {'pred.dens':>9} "
              f"{'heldout rec':>11} {'heldout prec':>12} {'read/dense':>10}")
        for r in p["layers"]:
            print(f"{r['layer']:>5} {r['sparsity']:>8.3f} {r['hidden']:>6} {r['bytes_pct']:>6.1f} {r['recall']:>6.3f} "
                  f"{r['precision']:>6.3f} {r['predicted_density']:>9.3f} {r['heldout_recall']:>11.3f} "
                  f"{r['heldout_precision']:>12.3f} {r['read_vs_dense']:>10.3f}")
        med = lambda k: statistics.median(r[k] for r in p["layers"])  # noqa: E731
        print(f"{'med':>5} {med('sparsity'):>8.3f} {'':>6} {med('bytes_pct'):>6.1f} {med('recall'):>6.3f} "
              f"{med('precision'):>6.3f} {med('predicted_density'):>9.3f} {med('heldout_recall'):>11.3f} "
              f"{med('heldout_precision'):>12.3f} {med('read_vs_dense'):>10.3f}")
        print(f"predictors {p['predictor_bytes_pct_total']:.1f}% of FFN bytes; threshold {p['sparse_threshold']} "
              f"(per-layer thresholds: {p['per_layer_thresholds']})")
        for k, v in p["targets"].items():
            print(f"  target {k}: {'PASS' if v else 'FAIL'}")
    if "demo" in res:
        d = res["demo"]
        print(f"\ndemo: {d['command']}: {d['wall_median_s']:.1f} s median of {len(d['wall_s'])} "
              f"({', '.join(f'{w:.1f}' for w in d['wall_s'])}); stages {d['stage_seconds']}")
        print(f"  CATS achieved sparsity {d['cats_sparsity_min']:.4f}..{d['cats_sparsity_max']:.4f} (target 0.3); "
              f"{d['tokens']} tokens")
        print(f"  predictors: hidden {d['hidden']}, {d['bytes_pct_median']:.1f}% of FFN bytes; recall median "
              f"{d['recall_median']:.3f} (min {d['recall_min']:.3f}), precision {d['precision_median']:.3f}, "
              f"predicted density {d['predicted_density_median']:.3f} (true {d['true_density_median']:.3f}, "
              f"from the achieved CATS sparsity)")
        for k, v in d["targets"].items():
            print(f"  target {k}: {'PASS' if v else 'FAIL'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=1, help="runs of each pi-profile command (median reported)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--planted-model", type=Path, help="reuse a planted model instead of generating one")
    ap.add_argument("--skip-demo", action="store_true")
    ap.add_argument("--skip-planted", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    res: dict = {"threads": args.threads, "loadavg": [round(x, 2) for x in os.getloadavg()]}
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_planted:
            res["planted"] = planted_benchmark(Path(tmp), args.repeats, args.threads, args.planted_model)
        if not args.skip_demo:
            res["demo"] = demo_benchmark(Path(tmp), args.repeats, args.threads)
    res["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        print_report(res)


if __name__ == "__main__":
    main()
