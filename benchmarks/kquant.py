"""A K-quant file (llama.cpp's Q4_K_M) as pinfer runs it: Q4_K re-encoded as Q4_1 (the default) against as Q8_0.

    python benchmarks/kquant.py --model m-q4_k_m.gguf                        # memory, load, paired decode speed
    python benchmarks/kquant.py --model m-q4_k_m.gguf --llamacpp             # + logits against llama.cpp's own
    python benchmarks/kquant.py --model m-q4_k_m.gguf --original m-f16.gguf  # + logits against the unquantised model

Both variants load in one process (runtime.weights.runnable chooses the encoding; the other is forced for the
comparison). Reported: the load notice (re-encoded bytes and seconds) and load time of each; decode tokens/s in
paired rounds (the two alternate, median of per-round ratios); and over --tokens positions of held-out text, top-1
agreement and mean KL(reference || pinfer) for each, the reference being llama.cpp's batched prefill on the same
file (llama-cpp-python) or pinfer on the unquantised original.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

_TREE = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(_TREE), str(_TREE / "src")]  # the checkout, without an install
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--original", help="the unquantised file the K-quant one was made from, as a logits reference")
    ap.add_argument("--llamacpp", action="store_true", help="compare logits with llama.cpp's (llama-cpp-python)")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch
    from llamacpp_logits import compare

    from pinfer_llm.runtime import load_model, loader, weights
    from pinfer_llm.runtime.profiling.corpus import HELDOUT

    torch.set_num_threads(args.threads)
    variants = {"q4_1": weights.runnable, "q8_0": lambda w: w if w.in_kernel else weights.as_q8_0(w)}
    models, res = {}, {"model": args.model, "threads": args.threads, "variants": {}}
    for name, fn in variants.items():
        loader.runnable = fn
        t0 = time.perf_counter()
        models[name] = load_model(args.model, threads=args.threads, ctx_size=max(512, args.tokens + 8))
        notes = [n for n in models[name].notices if "re-encoded" in n]  # names the bytes and seconds it cost
        res["variants"][name] = {"load_s": round(time.perf_counter() - t0, 2), "notice": notes[0] if notes else None}
    loader.runnable = weights.runnable

    ids = models["q4_1"].tokenizer.encode(HELDOUT.read_text())[:args.tokens]
    refs = {}
    if args.original:
        refs["original"] = load_model(args.original, threads=args.threads,
                                      ctx_size=max(512, args.tokens + 8)).forward_logits(ids)
    if args.llamacpp:
        import llama_cpp
        import numpy as np

        llm = llama_cpp.Llama(args.model, n_threads=args.threads, n_ctx=max(512, args.tokens + 8), n_batch=512,
                              logits_all=True, verbose=False)
        llm.eval(ids)
        refs["llamacpp"] = np.array(llm.scores[:len(ids)], dtype=np.float32)
    for ref_name, ref in refs.items():
        for name, m in models.items():
            c = compare(ref, m.forward_logits(ids), ids)
            res["variants"][name][f"vs_{ref_name}"] = {k: round(c[k], 5) for k in ("top1_agreement", "mean_kl")}

    prompt = models["q4_1"].tokenizer.encode("Once upon a time")
    rounds = []
    for r in range(args.rounds):
        tps = {}
        for name in (("q4_1", "q8_0") if r % 2 == 0 else ("q8_0", "q4_1")):
            list(models[name].generate(prompt, max_tokens=48, temperature=0.0, stop_ids=set()))
            tps[name] = models[name].stats.decode_tps
        rounds.append(tps)
        print(f"round {r + 1}: " + "  ".join(f"{k} {v:.1f} tok/s" for k, v in tps.items()), file=sys.stderr)
    ratios = [x["q4_1"] / x["q8_0"] for x in rounds]
    res["decode_q4_1_over_q8_0"] = round(statistics.median(ratios), 3)
    res["ratios"] = [round(x, 3) for x in ratios]
    res["decode_tps"] = {k: round(statistics.median(x[k] for x in rounds), 1) for k in models}
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
