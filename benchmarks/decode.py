"""Decode speed and peak memory of pinfer vs llama.cpp on the same GGUF, side by side.

    python benchmarks/decode.py                      # SmolLM2 demo model, 2 threads, 5 interleaved rounds
    python benchmarks/decode.py --model m.gguf --threads 2 --tokens 128 --rounds 7 --json

Each measurement runs in a fresh subprocess (so peak RSS is the engine's own), and the engines alternate within each
round, so machine noise hits both alike. Reported: medians over rounds, and the median of per-round ratios.
llama.cpp is measured when llama-cpp-python is installed (pip install 'pinfer[bench]').
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROMPT = "Once upon a time"


def worker_pinfer(model: str, threads: int, tokens: int, prompt: str, extra: dict) -> dict:
    from runtime import load_model

    t0 = time.perf_counter()
    m = load_model(model, threads=threads, **extra)
    load_s = time.perf_counter() - t0
    ids = m.tokenizer.encode(prompt)
    list(m.generate(ids, max_tokens=8, temperature=0.0, stop_ids=set()))  # warm-up
    out = list(m.generate(ids, max_tokens=tokens, temperature=0.0, stop_ids=set()))
    st = m.stats
    return {"load_s": load_s, "decode_tps": st.decode_tps, "prompt_tps": st.prompt_tps, "tokens": len(out),
            "text": m.tokenizer.decode(out)[:80]}


def worker_llamacpp(model: str, threads: int, tokens: int, prompt: str, extra: dict) -> dict:
    import llama_cpp

    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model, n_threads=threads, n_threads_batch=threads, n_ctx=512, verbose=False)
    load_s = time.perf_counter() - t0
    ids = llm.tokenize(prompt.encode(), add_bos=False, special=True)

    def run(n):
        llm.reset()
        t = time.perf_counter()
        llm.eval(ids)
        t_prompt = time.perf_counter() - t
        out = []
        t = time.perf_counter()
        for _ in range(n):
            tok = llm.sample(temp=0.0)
            out.append(tok)
            llm.eval([tok])
        return t_prompt, time.perf_counter() - t, out

    run(8)  # warm-up
    t_prompt, t_decode, out = run(tokens)
    return {"load_s": load_s, "decode_tps": tokens / t_decode, "prompt_tps": len(ids) / t_prompt, "tokens": tokens,
            "text": llm.detokenize(out).decode(errors="replace")[:80]}


def run_worker(engine: str, args) -> dict:
    cmd = [sys.executable, __file__, "--worker", engine, "--model", args.model, "--threads", str(args.threads),
           "--tokens", str(args.tokens), "--prompt", args.prompt, "--dtype", args.dtype]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{engine} worker failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--dtype", default="f32")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", choices=["pinfer", "llamacpp"], help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.worker:
        fn = worker_pinfer if args.worker == "pinfer" else worker_llamacpp
        extra = {"dtype": args.dtype} if args.worker == "pinfer" else {}
        res = fn(args.model, args.threads, args.tokens, args.prompt, extra)
        res["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps(res))
        return

    from runtime.engine import resolve_model_path

    args.model = str(resolve_model_path(args.model))
    try:
        import llama_cpp  # noqa: F401

        engines = ["pinfer", "llamacpp"]
    except ImportError:
        engines = ["pinfer"]
        print("llama-cpp-python not installed: measuring pinfer only (pip install 'pinfer[bench]')", file=sys.stderr)

    rows: dict[str, list[dict]] = {e: [] for e in engines}
    ratios = []
    for r in range(args.rounds):
        order = engines if r % 2 == 0 else engines[::-1]
        res = {e: run_worker(e, args) for e in order}
        for e in engines:
            rows[e].append(res[e])
        if "llamacpp" in res:
            ratios.append(res["pinfer"]["decode_tps"] / res["llamacpp"]["decode_tps"])
        if not args.json:
            print(f"round {r + 1}: " + "  ".join(f"{e} {res[e]['decode_tps']:.1f} tok/s" for e in engines),
                  file=sys.stderr)

    med = lambda e, k: statistics.median(x[k] for x in rows[e])  # noqa: E731
    summary = {"model": args.model, "threads": args.threads, "tokens": args.tokens, "rounds": args.rounds,
               "engines": {e: {k: round(med(e, k), 3) for k in ("decode_tps", "prompt_tps", "load_s", "peak_rss_mb")}
                           | {"text": rows[e][0]["text"]} for e in engines}}
    if ratios:
        summary["decode_ratio_vs_llamacpp"] = round(statistics.median(ratios), 3)
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"decode, {Path(args.model).name}, {args.threads} threads, {args.tokens} tokens, "
                    f"median of {args.rounds} rounds")
    for c in ("engine", "decode tok/s", "prompt tok/s", "load s", "peak RSS MB"):
        t.add_column(c, justify="right" if c != "engine" else "left")
    for e in engines:
        s = summary["engines"][e]
        t.add_row(e, f"{s['decode_tps']:.1f}", f"{s['prompt_tps']:.1f}", f"{s['load_s']:.2f}",
                  f"{s['peak_rss_mb']:.0f}")
    Console().print(t)
    if ratios:
        ratio = summary["decode_ratio_vs_llamacpp"]
        print(f"pinfer / llama.cpp decode speed: {ratio:.2f}x (median of per-round ratios)")


if __name__ == "__main__":
    main()
