"""Decode speed at depth with the f16 KV cache (pi-run's default, llama.cpp's) against f32, side by side.

    python benchmarks/kv_cache.py                              # SmolLM2 demo model, 1024 tokens deep, 2 threads
    python benchmarks/kv_cache.py --model m.gguf --depth 2000 --tokens 32 --rounds 5 --json

Both caches are loaded in one process (the weights are the same mapped file); each round prefills the same
--depth-token prompt into each, then times --tokens greedy decode steps, the two in alternating order. THE result
is the median over rounds of the per-round ratio f16 / f32 of decode tokens per second (paired); also the KV bytes of
each and how many leading greedy tokens the two continuations share.
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


def decode_tps(m, ids: list[int], tokens: int) -> tuple[float, list[int]]:
    import torch

    tr = m.transformer
    with torch.inference_mode():
        logits = m.forward_logits(ids)[-1]
        out, pos = [], len(ids)
        t0 = time.perf_counter()
        for _ in range(tokens):
            tok = int(logits.argmax())
            out.append(tok)
            logits = tr.forward(torch.tensor([tok]), pos)[-1]
            pos += 1
        return tokens / (time.perf_counter() - t0), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--depth", type=int, default=1024, help="prompt tokens before the timed decode steps")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from benchmarks.decode import long_prompt
    from pinfer_llm.runtime import load_model

    ctx = args.depth + args.tokens + 1
    ms = {kv: load_model(args.model, threads=args.threads, ctx_size=ctx, kv_type=kv) for kv in ("f16", "f32")}
    ids = ms["f16"].tokenizer.encode(long_prompt(args.depth))[:args.depth]
    if len(ids) < args.depth:
        raise SystemExit(f"the prompt text gives {len(ids)} tokens, fewer than --depth {args.depth}")
    decode_tps(ms["f16"], ids[:64], 2)  # warm-up: kernels built, pages touched
    rounds, same = [], args.tokens
    for r in range(args.rounds):
        got = {}
        for kv in (("f16", "f32") if r % 2 == 0 else ("f32", "f16")):
            got[kv] = decode_tps(ms[kv], ids, args.tokens)
        a, b = got["f16"][1], got["f32"][1]
        same = min(same, next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a)))
        rounds.append({kv: round(v[0], 3) for kv, v in got.items()})
        if not args.json:
            print(f"round {r + 1}: f16 {got['f16'][0]:.2f} tok/s, f32 {got['f32'][0]:.2f} tok/s", file=sys.stderr)
    ratios = [x["f16"] / x["f32"] for x in rounds]
    kv_bytes = {kv: sum(t.nbytes for t in m.transformer.cache.k + m.transformer.cache.v if t is not None)
                for kv, m in ms.items()}
    res = {"model": args.model, "depth": args.depth, "tokens": args.tokens, "threads": args.threads,
           "f16_over_f32": round(statistics.median(ratios), 3), "ratios": [round(x, 3) for x in ratios],
           "rounds": rounds, "kv_bytes": kv_bytes, "greedy_tokens_equal": same}
    if args.json:
        print(json.dumps(res))
    else:
        print(f"decode at depth {args.depth}: f16 cache / f32 cache = {res['f16_over_f32']:.2f}x "
              f"(per round {min(ratios):.2f}-{max(ratios):.2f}); KV {kv_bytes['f16'] / 2**20:.0f} vs "
              f"{kv_bytes['f32'] / 2**20:.0f} MiB; the first {same} of {args.tokens} greedy tokens equal")


if __name__ == "__main__":
    main()
