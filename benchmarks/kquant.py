"""A K-quant (or IQ4) file as pinfer runs it, against the re-encodings it could take instead: Q4_K and Q5_K (most of
llama.cpp's Q4_K_M and Q5_K_M), Q6_K (their attn_v and half their ffn_down, the output head of llama.cpp's Q4_0
files), IQ4_NL and IQ4_XS are read in place by default, against each re-encoded as Q8_0 (and Q4_K as Q4_1, the
default until 2026-12-07).

    python benchmarks/kquant.py --model m-q4_k_m.gguf                        # memory, load, paired decode speed
    python benchmarks/kquant.py --model m-q4_0.gguf                          # a Q4_0 file's Q6_K head alone
    python benchmarks/kquant.py --model m-q4_k_m.gguf --llamacpp             # + logits against llama.cpp's own
    python benchmarks/kquant.py --model m-q4_k_m.gguf --original m-f16.gguf  # + logits against the unquantised model
    python benchmarks/kquant.py --kernels                                    # the kernels alone, no model file

--kernels times torch.ops.pinfer.qmatmul on random matrices of the types only dot products read against their
re-encodings (Q4_K / Q4_1, the others / Q8_0) at 1B shapes and several token counts, enough copies of each to read
from beyond the caches, in alternated rounds (median of per-round time ratios; below 1, in place is faster).

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


def kernels(threads: int, rounds: int) -> None:
    import torch
    from gguf.constants import GGMLQuantizationType as T
    from qblocks import weights

    from pinfer_llm.runtime.cpu import kernels as cpu_kernels
    from pinfer_llm.runtime.weights import QWeight, as_q4_1, as_q8_0

    if not cpu_kernels.available():
        raise SystemExit(f"the C++ kernels are not available: {cpu_kernels.status()}")
    cpu_kernels.set_threads(threads)
    cases = [(T.Q4_K, as_q4_1, 11264, 2048, (1, 2, 4)), (T.Q4_K, as_q4_1, 2048, 5632, (1, 4, 16, 63)),
             (T.Q5_K, as_q8_0, 11264, 2048, (1, 2, 4)), (T.Q5_K, as_q8_0, 2048, 5632, (1, 4, 16, 63)),
             (T.Q6_K, as_q8_0, 32000, 2048, (1, 2, 4)), (T.Q6_K, as_q8_0, 2048, 5632, (1, 4, 16, 63)),
             (T.Q5_0, as_q8_0, 11264, 2048, (1, 4, 63)), (T.Q5_1, as_q8_0, 11264, 2048, (1, 4, 63)),
             (T.IQ4_NL, as_q8_0, 11264, 2048, (1, 4, 63)), (T.IQ4_XS, as_q8_0, 11264, 2048, (1, 4, 63))]
    out = []
    for t, reencode, rows, cols, ts in cases:
        nbytes = weights(1, cols, t, 0).numel() * rows
        copies = max(2, (400 << 20) // nbytes)  # ~400 MB of each: read from memory, not a cache
        kq = [QWeight("w", t, rows, cols, weights(rows, cols, t, i)) for i in range(copies)]
        re = [reencode(w) for w in kq]
        for n_tok in ts:
            x = torch.randn(n_tok, cols)
            times = {"in_place": [], "re_encoded": []}
            for r in range(rounds):
                pair = (("in_place", kq), ("re_encoded", re))
                for name, ws in pair if r % 2 == 0 else pair[::-1]:
                    t0 = time.perf_counter()
                    for w in ws:
                        torch.ops.pinfer.qmatmul(x, [w.data], [int(w.qtype)], 1 << 30)
                    times[name].append((time.perf_counter() - t0) / len(ws))
            ratios = [a / b for a, b in zip(times["in_place"], times["re_encoded"], strict=True)]
            us = statistics.median(times["in_place"]) * 1e6
            row = {"type": t.name, "against": re[0].type_name, "shape": [rows, cols], "tokens": n_tok,
                   "in_place_us": round(us, 1), "re_encoded_us": round(statistics.median(times["re_encoded"]) * 1e6, 1),
                   "time_ratio": round(statistics.median(ratios), 3), "ratio_range": [round(min(ratios), 3),
                                                                                      round(max(ratios), 3)],
                   "in_place_gb_s": round(nbytes / us / 1e3, 1)}
            out.append(row)
            print(f"{t.name} {rows} x {cols}, {n_tok} token(s): {row['in_place_us']} us ({row['in_place_gb_s']} GB/s) "
                  f"against {row['against']} {row['re_encoded_us']} us: {row['time_ratio']}x the time "
                  f"({row['ratio_range'][0]}-{row['ratio_range'][1]})", file=sys.stderr)
    print(json.dumps({"threads": threads, "rounds": rounds, "kernels": out}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--kernels", action="store_true", help="time the kernels on random matrices instead of a model")
    ap.add_argument("--original", help="the unquantised file the K-quant one was made from, as a logits reference")
    ap.add_argument("--llamacpp", action="store_true", help="compare logits with llama.cpp's (llama-cpp-python)")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if args.kernels:
        return kernels(args.threads, args.rounds)
    if not args.model:
        ap.error("--model FILE (or --kernels)")

    import torch
    from llamacpp_logits import compare

    from pinfer_llm.runtime import load_model, loader, weights
    from pinfer_llm.runtime.profiling.corpus import HELDOUT

    torch.set_num_threads(args.threads)
    from gguf.constants import GGMLQuantizationType as T

    from pinfer_llm.formats.reader import open_gguf

    f = open_gguf(args.model)
    held = {T(t.ggml_type) for t in f.tensors.values()}
    f.close()
    kernel_types = weights.KERNEL_TYPES
    as_q8_0 = lambda w: w if w.in_kernel else weights.as_q8_0(w)  # noqa: E731
    # name -> the type taken out of the kernels' table (so the loader re-encodes it) and the loader's re-encoding
    variants = {"default": (None, weights.runnable)}
    if T.Q4_K in held:
        variants["q4_k_as_q4_1"] = (T.Q4_K, weights.runnable)
    for t in sorted(held & (weights.KERNEL_TYPES - weights.ROW_TYPES)):  # the types read by dot products only
        variants[f"{t.name.lower()}_as_q8_0"] = (t, as_q8_0)
    if len(variants) == 1:
        raise SystemExit(f"{args.model}: no Q4_K, Q5_K, Q6_K, IQ4_NL or IQ4_XS tensors, nothing to compare")
    models, res = {}, {"model": args.model, "threads": args.threads, "variants": {}}
    for name, (out, fn) in variants.items():
        loader.runnable = fn
        weights.KERNEL_TYPES = kernel_types - {out} if out else kernel_types
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
