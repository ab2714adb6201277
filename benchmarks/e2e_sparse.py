"""End to end on a planted ReluLLaMA-shaped model: sparse decode (predictors) vs dense decode, and top-1 agreement.

    python benchmarks/e2e_sparse.py                    # makes the model and its predictors on first use (cached,
                                                       # keyed by --shape, --dtype, --sparsity and --recall)
    python benchmarks/e2e_sparse.py --rounds 5 --tokens 32 --json

1. The model: synth with a TinyLlama-like Llama-2 shape (22 layers, d 2048, n_ff 5632, 32 heads, 4 kv
   heads, Llama-2's 32000-token vocabulary size: ~1.1B parameters), 90% planted sparsity, stored F32 (see --dtype).
   The vocabulary is synth's byte-level one padded to 32000 entries: the output head has ReluLLaMA's shape, and the
   built-in corpus gives ~17k calibration tokens (a 49k BPE vocabulary like SmolLM2's gives ~4k, too few to train
   recall-0.99 predictors: measured precision 0.2 instead of 0.85-0.94, with the trainer's earlier mask regression).
2. Its predictors: `pi-profile MODEL --train-predictors --recall 0.99` over the built-in corpus, written into the
   file. Recall 0.99 rather than pi-profile's default 0.95: the top-1 target (>= 97% agreement with dense) needs it
   (0.95 gave ~0.945 with the earlier trainer), and for ReLU models the extra false positives are cheap: the sparse
   kernel reads a false positive's gate row only (its activation is 0, so its up and down rows are skipped).
3. The dense baseline: the same weights in llama.cpp's layout (ffn_down [d, n_ff], no predictors), a twin file made
   once (dense_twin): every weight is read on every token, the work llama.cpp does. pinfer's dense mode over the
   PowerInfer file itself runs the exact ReLU kernel (every gate row, then the up and down rows of the active
   neurons only): lossless, but no longer the dense baseline (it measured 1.00x of --oracle-masks).
4. Decode speed: one token at a time through the KV cache, as generation does, but fed the held-out text instead of
   the model's own samples: a random planted model samples garbage, while real use decodes text, and the predictors'
   work depends on the input. Both modes are loaded in one process and decode in lockstep, one dense and one sparse
   step per position, so that bursts of other work on this shared machine hit both modes of a pair (earlier, whole
   runs alternated in subprocesses, and 7-round medians of the same setup ranged 2.41-2.71x). Reported: each mode's
   median step time as tok/s, and the median over pairs of dense / sparse step time.
5. Quality: logits over the held-out text, teacher-forced, in each mode; top-1 agreement with dense over positions.
Also measured: --oracle-masks (exact masks; for ReLU the C++ kernel reads every gate row and the up and down rows of
the active neurons only), which must agree with dense everywhere.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "src")]  # the checkout, without an install

RESULTS = ROOT / "benchmarks/results"
PROMPT_TOKENS = 16


def default_path(args) -> Path:
    """The cached model's file name carries every argument that shapes the model or its predictors, so changing one
    makes (and caches) another model instead of silently reusing the old one."""
    shape = "x".join(str(int(v)) for v in args.shape.split(","))
    return RESULTS / f"planted-{shape}-{args.dtype}-s{args.sparsity:g}-r{args.recall:g}.gguf"


def mismatches(path: Path, args) -> list[str]:
    """How an existing model differs from the arguments (what its metadata records), for --model files."""
    from pinfer_llm.formats import constants as C
    from pinfer_llm.formats.reader import open_gguf

    f = open_gguf(path)
    n_layer, d, ff, h, hkv = (int(v) for v in args.shape.split(","))
    have = {"n_layer": f.arch_get(C.BLOCK_COUNT), "n_embd": f.arch_get(C.EMBEDDING_LENGTH),
            "n_ff": f.arch_get(C.FEED_FORWARD_LENGTH), "n_head": f.arch_get(C.HEAD_COUNT),
            "n_head_kv": f.arch_get(C.HEAD_COUNT_KV), "sparsity": f.get(C.SYNTH_SPARSITY),
            "dtype": {0: "f32", 1: "f16"}.get(int(f.tensors[C.tensor(C.FFN_GATE, 0)].ggml_type))
            if f.has(C.tensor(C.FFN_GATE, 0)) else None,
            "recall": f.get(C.PRED_RECALL_TARGET)}
    want = {"n_layer": n_layer, "n_embd": d, "n_ff": ff, "n_head": h, "n_head_kv": hkv, "sparsity": args.sparsity,
            "dtype": args.dtype, "recall": args.recall}
    out = []
    for k, w in want.items():
        v = have[k]
        if v is None:
            continue  # not recorded (the recall before predictors are trained)
        same = abs(float(v) - float(w)) < 1e-4 if isinstance(w, float) else v == w
        if not same:
            out.append(f"{k} {round(float(v), 4) if isinstance(w, float) else v} (asked {w})")
    return out


def ensure_model(path: Path, args) -> None:
    from pinfer_llm.formats.reader import open_gguf

    if path.exists():
        diff = mismatches(path, args)
        if diff:
            raise SystemExit(f"{path} was made with other arguments: {', '.join(diff)}; pass matching --shape, "
                             f"--dtype, --sparsity and --recall, or another --model")
    else:
        from pinfer_llm.synth import SynthSpec, generate

        path.parent.mkdir(parents=True, exist_ok=True)
        n_layer, d, ff, h, hkv = (int(v) for v in args.shape.split(","))
        print(f"generating {path} ...", file=sys.stderr)
        t = time.perf_counter()
        res = generate(path, SynthSpec(n_layer=n_layer, n_embd=d, n_ff=ff, n_head=h, n_head_kv=hkv, dtype=args.dtype,
                                       sparsity=args.sparsity, seed=0, vocab="bytes", vocab_size=32000,
                                       name="planted-relullama-1b"))
        print(f"  {res.n_params / 1e9:.2f}B parameters in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    if not open_gguf(path).has("blk.0.fc1.weight"):
        print("training predictors (pi-profile --train-predictors) ...", file=sys.stderr)
        cmd = [sys.executable, "-m", "pinfer_llm.cli.profile", str(path), "--train-predictors", "--recall",
               str(args.recall), "-t", str(args.threads)]
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=sys.stderr)  # stdout stays this script's (--json)


def dense_twin(src: Path, dst: Path) -> None:
    """The model as llama.cpp's converter lays it out: ffn_down [d, n_ff] instead of ffn_down_t (its bias renamed
    back), no predictors or statistics, the GGUF magic."""
    import numpy as np

    from pinfer_llm.formats import constants as C
    from pinfer_llm.formats.reader import open_gguf
    from pinfer_llm.formats.writer import write_gguf

    f = open_gguf(src)
    tensors = {}
    for name in f.tensors:
        if any(k in name for k in (".fc1.", ".fc2.", ".act_counts", ".act_peak")):
            continue
        a = f.raw(name)
        if ".ffn_down_t.weight" in name:
            name, a = name.replace("ffn_down_t", "ffn_down"), np.ascontiguousarray(np.asarray(a).T)
        elif ".ffn_down_t.bias" in name:
            name = name.replace("ffn_down_t", "ffn_down")
        tensors[name] = a
    meta = {k: v for k, v in f.metadata.items() if not k.startswith(("pinfer.predictor", "powerinfer.",
                                                                      "pinfer.activation"))}
    meta[C.NAME] = f"{meta.get(C.NAME, 'model')} (dense twin)"
    write_gguf(dst, meta, tensors, value_types={k: v for k, v in f.value_types.items() if k in meta})


def lockstep(models: dict, ids: list[int], rounds: int) -> dict:
    """Decode the same tokens through every model in lockstep: for every position, one step of each mode back to back
    (the order rotates), so that a burst of other work on this shared machine hits all modes of a position. A mode's
    speed-up is the median over positions of dense step time / its step time."""
    import torch

    trs = {k: m.transformer for k, m in models.items()}
    with torch.inference_mode():
        for tr in trs.values():
            tr.forward(torch.tensor(ids[:PROMPT_TOKENS]), 0)
            tr.forward(torch.tensor([ids[PROMPT_TOKENS]]), PROMPT_TOKENS)  # warm-up step
            for b in tr.blocks:  # count the active neurons of the timed steps only
                if hasattr(b.ffn, "stats"):
                    b.ffn.stats.tokens = b.ffn.stats.active = 0
        names = list(trs)
        times: dict[str, list[float]] = {k: [] for k in names}
        sums: dict[str, list[float]] = {k: [] for k in names}
        for r in range(rounds):
            for k in names:
                sums[k].append(0.0)
            for p in range(PROMPT_TOKENS + 1, len(ids)):  # a round re-decodes the same positions (cache overwritten)
                shift = (p + r) % len(names)
                for k in names[shift:] + names[:shift]:
                    t0 = time.perf_counter()
                    trs[k].forward(torch.tensor([ids[p]]), p)
                    dt = time.perf_counter() - t0
                    times[k].append(dt)
                    sums[k][-1] += dt
    out = {}
    for k in names:
        frac = models[k].sparsity()
        out[k] = {"decode_tps": 1 / statistics.median(times[k]), "steps": len(times[k]),
                  "active_fraction": None if frac is None else sum(frac) / len(frac)}
        if k != "dense":
            pairs = [d / s for d, s in zip(times["dense"], times[k], strict=True)]
            out[k]["speedup_median_of_pairs"] = statistics.median(pairs)
            out[k]["speedup_per_round"] = [round(d / s, 3) for d, s in zip(sums["dense"], sums[k], strict=True)]
    return out


def agreement(dense, other, ids: list[int]) -> dict:
    a, b = dense.forward_logits(ids), other.forward_logits(ids)
    return {"positions": len(ids), "top1_agreement": float((a.argmax(-1) == b.argmax(-1)).mean())}


def add_run_args(ap: argparse.ArgumentParser) -> None:
    """The options of a planted model and its lockstep run, shared with benchmarks/archs_sparse.py."""
    ap.add_argument("--recall", type=float, default=0.99, help="predictor recall target when training them")
    ap.add_argument("--dtype", default="f32", choices=["f32", "f16"])
    ap.add_argument("--sparsity", type=float, default=0.9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5, help="passes over the decoded tokens")
    ap.add_argument("--tokens", type=int, default=48, help="tokens decoded per round")
    ap.add_argument("--agree-tokens", type=int, default=512)
    ap.add_argument("--no-oracle", action="store_true", help="skip the exact-mask (--oracle-masks) mode")
    ap.add_argument("--json", action="store_true")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="default: benchmarks/results/planted-<shape>-<dtype>-s<sparsity>-"
                    "r<recall>.gguf, made on first use")
    ap.add_argument("--shape", default="22,2048,5632,32,4", help="n_layer,n_embd,n_ff,n_head,n_head_kv")
    add_run_args(ap)
    args = ap.parse_args()

    args.model = args.model or default_path(args)
    ensure_model(args.model, args)
    from pinfer_llm.runtime import load_model
    from pinfer_llm.runtime.profiling.corpus import HELDOUT

    ctx = max(256, args.agree_tokens + 8, PROMPT_TOKENS + args.tokens + 8)
    twin = args.model.with_name(args.model.stem + "-dense.gguf")
    if not twin.exists():
        print(f"writing the dense twin {twin} ...", file=sys.stderr)
        dense_twin(args.model, twin)
    dense = load_model(twin, threads=args.threads, ffn_mode="dense", ctx_size=ctx)
    assert not dense.cfg.down_transposed and not dense.cfg.has_predictors
    ids = dense.tokenizer.encode(HELDOUT.read_text(encoding="utf-8"))
    summary = {"model": str(args.model), "dense_twin": str(twin), "threads": args.threads, "rounds": args.rounds,
               "tokens": args.tokens}
    for mode in ["sparse"] + ([] if args.no_oracle else ["oracle"]):  # each mode in lockstep with dense, in turn
        other = load_model(args.model, threads=args.threads, ffn_mode=mode, ctx_size=ctx)
        res = lockstep({"dense": dense, mode: other}, ids[:PROMPT_TOKENS + 1 + args.tokens], args.rounds)
        summary[mode] = res[mode] | {"dense_decode_tps": res["dense"]["decode_tps"],
                                     "agreement": agreement(dense, other, ids[:args.agree_tokens])}
        del other
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    for mode in ("sparse", "oracle"):
        if mode in summary:
            r, agree = summary[mode], summary[mode]["agreement"]
            print(f"{args.model.name} {mode}: {r['decode_tps']:.2f} vs dense {r['dense_decode_tps']:.2f} tok/s "
                  f"(medians of {r['steps']} steps), speed-up {r['speedup_median_of_pairs']:.2f}x (median of paired "
                  f"steps; per round: {', '.join(f'{x:.2f}' for x in r['speedup_per_round'])}); computes "
                  f"{r['active_fraction']:.1%} of FFN neurons; top-1 agreement with dense {agree['top1_agreement']:.3f}"
                  f" over {agree['positions']} held-out positions")


if __name__ == "__main__":
    main()
