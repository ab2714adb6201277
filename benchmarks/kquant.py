"""A K-quant file as pinfer runs it, against the re-encodings it could take instead: Q4_K (most of llama.cpp's
Q4_K_M) is re-encoded as Q4_1 by default, against as Q8_0; Q6_K (Q4_K_M's attn_v and half its ffn_down, the output
head of llama.cpp's Q4_0 files) is read in place by default, against re-encoded as Q8_0.

    python benchmarks/kquant.py --model m-q4_k_m.gguf                        # memory, load, paired decode speed
    python benchmarks/kquant.py --model m-q4_0.gguf                          # a Q4_0 file's Q6_K head alone
    python benchmarks/kquant.py --model m-q4_k_m.gguf --llamacpp             # + logits against llama.cpp's own
    python benchmarks/kquant.py --model m-q4_k_m.gguf --original m-f16.gguf  # + logits against the unquantised model

The variants load in one process (the default is runtime.weights.runnable's choice; each other forces one type's
re-encoding, and only the types the file holds are tried). Reported: the load notice (re-encoded bytes and seconds)
and load time of each; decode tokens/s in paired rounds (the variants in turn, the order rotated each round; median of
per-round ratios default / variant: above 1, the default is faster); and over --tokens positions of held-out text,
top-1 agreement and mean KL(reference || pinfer) for each, the reference being llama.cpp's batched prefill on the same
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
    from gguf.constants import GGMLQuantizationType as T

    from pinfer_llm.formats.reader import open_gguf

    f = open_gguf(args.model)
    held = {t.ggml_type for t in f.tensors.values()}
    f.close()
    kernel_types = weights.KERNEL_TYPES
    variants = {"default": weights.runnable}  # name -> the loader's re-encoding, and the kernel types it reads
    if T.Q4_K in held:
        variants["q4_k_as_q8_0"] = lambda w: w if w.in_kernel else weights.as_q8_0(w)
    if T.Q6_K in held:
        variants["q6_k_as_q8_0"] = weights.runnable
    if len(variants) == 1:
        raise SystemExit(f"{args.model}: no Q4_K or Q6_K tensors, nothing to compare")
    models, res = {}, {"model": args.model, "threads": args.threads, "variants": {}}
    for name, fn in variants.items():
        loader.runnable = fn
        # Q6_K as Q8_0: the kernels' table without Q6_K, so the loader takes it for a type to re-encode
        weights.KERNEL_TYPES = kernel_types - {T.Q6_K} if name == "q6_k_as_q8_0" else kernel_types
        t0 = time.perf_counter()
        try:
            models[name] = load_model(args.model, threads=args.threads, ctx_size=max(512, args.tokens + 8))
        finally:
            loader.runnable, weights.KERNEL_TYPES = weights.runnable, kernel_types
        notes = [n for n in models[name].notices if "re-encoded" in n]  # names the bytes and seconds it cost
        res["variants"][name] = {"load_s": round(time.perf_counter() - t0, 2), "notice": notes[0] if notes else None}

    ids = models["default"].tokenizer.encode(HELDOUT.read_text())[:args.tokens]
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

    prompt = models["default"].tokenizer.encode("Once upon a time")
    names, rounds = list(models), []
    for r in range(args.rounds):
        tps = {}
        for name in names[r % len(names):] + names[:r % len(names)]:
            list(models[name].generate(prompt, max_tokens=48, temperature=0.0, stop_ids=set()))
            tps[name] = models[name].stats.decode_tps
        rounds.append(tps)
        print(f"round {r + 1}: " + "  ".join(f"{k} {v:.1f} tok/s" for k, v in tps.items()), file=sys.stderr)
    res["decode_tps"] = {k: round(statistics.median(x[k] for x in rounds), 1) for k in models}
    for name in names[1:]:
        ratios = [x["default"] / x[name] for x in rounds]
        res[f"decode_default_over_{name}"] = round(statistics.median(ratios), 3)
        res[f"ratios_default_over_{name}"] = [round(x, 3) for x in ratios]
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
