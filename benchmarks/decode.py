"""Decode and prefill speed and peak memory of pinfer vs llama.cpp on the same GGUF, side by side.

    python benchmarks/decode.py                      # SmolLM2 demo model, 2 threads, 5 interleaved rounds
    python benchmarks/decode.py --model m.gguf --threads 2 --tokens 128 --prefill 512 --rounds 7 --json
    python benchmarks/decode.py --llama-bench /path/to/llama.cpp/build/bin/llama-bench
    python benchmarks/decode.py --depth 1024        # decode after a 1024-token prompt: the KV cache read each step

Each measurement runs in a fresh subprocess (so peak RSS is the engine's own), and the engines alternate within each
round (the order rotates), so machine noise hits all of a round alike.

THE result is the median over rounds of the per-round ratio pinfer / llama.cpp (paired: both measured in the same
round); it is printed first. The engines' own medians over rounds are unpaired (each engine's median may come from
a different round), so on a shared machine they can disagree with the paired ratio (84.3 vs 72.0 tok/s once, while
the paired ratio was 1.00x): they are printed as context only.

Two llama.cpps: llama-cpp-python (pip install 'pinfer-llm[bench]') drives llama.cpp one token at a time from Python,
as this script drives pinfer; `--llama-bench PATH` also runs llama.cpp's own C++ benchmark (llama-bench, text
generation of --tokens tokens after an empty prompt, one repetition per round), which has no Python in its loop.
This script never builds llama.cpp; without --llama-bench it says so.

`--forward` adds pinfer with its fused decode step off (PINFER_DECODE_STEP=0: every token through the Python forward,
runtime/cpu/step.py), so the step's own gain is a paired ratio of the same run. `--no-team` adds pinfer with the
step's one-team decode off (PINFER_DECODE_TEAM=0: the pool forked per operation, csrc/step.cpp decode_layers).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

_TREE = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(_TREE), str(_TREE / "src")]  # the checkout, without an install

PROMPT = "Once upon a time"


def long_prompt(n: int) -> str:
    """Held-out prose long enough for an n-token prompt (each engine cuts its own ids to n)."""
    from pinfer_llm.runtime.profiling.corpus import HELDOUT

    text = HELDOUT.read_text()
    return (text * (1 + 8 * n // max(len(text), 1)))[:8 * n]


def worker_pinfer(model: str, threads: int, tokens: int, prompt: str, prefill: int, depth: int) -> dict:
    from pinfer_llm.runtime import load_model

    t0 = time.perf_counter()
    m = load_model(model, threads=threads, ctx_size=max(512, prefill + 16, depth + tokens + 16))
    load_s = time.perf_counter() - t0
    ids = m.tokenizer.encode(long_prompt(depth))[:depth] if depth else m.tokenizer.encode(prompt)
    list(m.generate(ids, max_tokens=8, temperature=0.0, stop_ids=set()))  # warm-up
    out = list(m.generate(ids, max_tokens=tokens, temperature=0.0, stop_ids=set()))
    st = m.stats
    res = {"load_s": load_s, "decode_tps": st.decode_tps, "prompt_tps": st.prompt_tps, "tokens": len(out),
           "text": m.tokenizer.decode(out)[:80], "prefill_tps": None}
    if prefill:
        long = m.tokenizer.encode(long_prompt(prefill))[:prefill]
        list(m.generate(long, max_tokens=1, temperature=0.0, stop_ids=set()))
        res["prefill_tps"] = m.stats.prompt_tps
    return res


def worker_llamacpp(model: str, threads: int, tokens: int, prompt: str, prefill: int, depth: int) -> dict:
    import llama_cpp

    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model, n_threads=threads, n_threads_batch=threads,
                          n_ctx=max(512, prefill + 16, depth + tokens + 16), n_batch=max(512, prefill, depth),
                          verbose=False)
    load_s = time.perf_counter() - t0
    ids = (llm.tokenize(long_prompt(depth).encode(), add_bos=False, special=False)[:depth] if depth
           else llm.tokenize(prompt.encode(), add_bos=False, special=True))

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
    res = {"load_s": load_s, "decode_tps": tokens / t_decode, "prompt_tps": len(ids) / t_prompt, "tokens": tokens,
           "text": llm.detokenize(out).decode(errors="replace")[:80], "prefill_tps": None}
    if prefill:
        long = llm.tokenize(long_prompt(prefill).encode(), add_bos=False, special=False)[:prefill]
        llm.reset()
        t = time.perf_counter()
        llm.eval(long)
        res["prefill_tps"] = len(long) / (time.perf_counter() - t)
    return res


def run_llama_bench(args) -> dict:
    """One run of llama.cpp's llama-bench: text generation of --tokens tokens after an empty prompt, CPU only."""
    cmd = [args.llama_bench, "-m", args.model, "-t", str(args.threads), "-p", str(args.prefill), "-n",
           str(args.tokens), "-r", "1", "-ngl", "0", "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode in (-4, -11, 132, 139):  # SIGILL / SIGSEGV (from the process, or through a shell)
        raise SystemExit(f"llama-bench died with {'SIGILL' if out.returncode in (-4, 132) else 'SIGSEGV'}: a native "
                         "llama.cpp build runs AMX kernels on prompts, which this OS may not grant; rebuild it with "
                         "-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF (docs/results.md)")
    if out.returncode != 0:
        raise SystemExit(f"llama-bench failed ({' '.join(cmd)}):\n{(out.stderr or out.stdout)[-2000:]}")
    results = json.loads(out.stdout)
    tests = [t for t in results if t.get("n_gen") and not t.get("n_prompt")]
    if not tests:
        raise SystemExit(f"llama-bench printed no text-generation result:\n{out.stdout[-2000:]}")
    pp = [t for t in results if t.get("n_prompt") and not t.get("n_gen")]
    return {"decode_tps": float(tests[0]["avg_ts"]), "prompt_tps": None, "load_s": None, "peak_rss_mb": None,
            "tokens": int(tests[0]["n_gen"]), "text": "", "prefill_tps": float(pp[0]["avg_ts"]) if pp else None}


def bytes_bound(model: str, threads: int) -> dict:
    """The memory bound on decode: every weight is read once per token (the file's size stands for the weights:
    the tied or separate output head reads the embedding's bytes too, metadata and the tokenizer are a few MB at
    most), at the streaming read bandwidth of `threads` threads measured now. A model whose weights fit in cache
    can beat it; the figure says how far from memory speed both engines are."""
    from pinfer_llm.planner.hardware import measure_cpu_bandwidth

    nbytes = Path(model).stat().st_size
    bw = measure_cpu_bandwidth(threads)
    return {"bytes_per_token": nbytes, "bandwidth_gbs": round(bw, 2), "tokens_per_s": round(bw * 1e9 / nbytes, 1)}


def run_worker(engine: str, args) -> dict:
    if engine == "llama-bench":
        return run_llama_bench(args)
    env = dict(os.environ)
    if engine == "pinfer-forward":
        env["PINFER_DECODE_STEP"] = "0"
    if engine == "pinfer-noteam":
        env["PINFER_DECODE_TEAM"] = "0"
    cmd = [sys.executable, __file__, "--worker", engine.split("-")[0], "--model", args.model,
           "--threads", str(args.threads),
           "--tokens", str(args.tokens), "--prompt", args.prompt, "--prefill", str(args.prefill),
           "--depth", str(args.depth)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if out.returncode < 0:  # a crash writes nothing to stderr: say which signal (llama.cpp's AMX build: SIGSEGV)
        raise SystemExit(f"{engine} worker died of {signal.Signals(-out.returncode).name}")
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
    ap.add_argument("--prefill", type=int, default=0, help="also time the prefill of a prompt of this many tokens")
    ap.add_argument("--depth", type=int, default=0, help="decode after a prompt of this many tokens (held-out prose) "
                    "instead of --prompt (not with --llama-bench, whose text generation starts from an empty cache)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--llama-bench", metavar="PATH", help="llama.cpp's llama-bench binary, to run beside the others "
                    "(never built by this script)")
    ap.add_argument("--forward", action="store_true", help="also run pinfer without its fused decode step")
    ap.add_argument("--no-team", action="store_true", help="also run pinfer with the step's team decode off")
    ap.add_argument("--worker", choices=["pinfer", "llamacpp"], help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.worker:
        fn = worker_pinfer if args.worker == "pinfer" else worker_llamacpp
        res = fn(args.model, args.threads, args.tokens, args.prompt, args.prefill, args.depth)
        res["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps(res))
        return

    from pinfer_llm.runtime.engine import resolve_model_path

    args.model = str(resolve_model_path(args.model))
    engines = ["pinfer", *(["pinfer-forward"] if args.forward else []), *(["pinfer-noteam"] if args.no_team else [])]
    missing: dict[str, str] = {}
    try:
        import llama_cpp  # noqa: F401

        engines.append("llamacpp")
    except ImportError:
        missing["llamacpp"] = "llama-cpp-python is not installed (pip install 'pinfer-llm[bench]')"
    if args.llama_bench and not (Path(args.llama_bench).is_file() and os.access(args.llama_bench, os.X_OK)):
        raise SystemExit(f"--llama-bench {args.llama_bench}: not an executable file")
    if args.llama_bench and args.depth:
        raise SystemExit("--depth and --llama-bench: llama-bench's text generation starts from an empty cache")
    if args.llama_bench:
        engines.append("llama-bench")
    else:
        missing["llama-bench"] = "no --llama-bench PATH given (this script never builds llama.cpp)"
    for e, why in missing.items():
        print(f"{e}: not measured: {why}", file=sys.stderr)
    bound = bytes_bound(args.model, args.threads)

    rows: dict[str, list[dict]] = {e: [] for e in engines}
    for r in range(args.rounds):
        shift = r % len(engines)
        res = {e: run_worker(e, args) for e in engines[shift:] + engines[:shift]}
        for e in engines:
            rows[e].append(res[e])
        if not args.json:
            print(f"round {r + 1}: " + "  ".join(f"{e} {res[e]['decode_tps']:.1f} tok/s" for e in engines),
                  file=sys.stderr)

    paired = {e: [p["decode_tps"] / o["decode_tps"] for p, o in zip(rows["pinfer"], rows[e], strict=True)]
              for e in engines if e != "pinfer"}

    def med(e, k):
        vals = [x[k] for x in rows[e] if x[k] is not None]
        return round(statistics.median(vals), 3) if vals else None

    ratios = {e: {"median": round(statistics.median(v), 3), "per_round": [round(x, 3) for x in v]}
              for e, v in paired.items()}
    prefill = {}
    if args.prefill:
        for e in engines:
            if e != "pinfer" and all(o.get("prefill_tps") for o in rows[e]):
                v = [p["prefill_tps"] / o["prefill_tps"] for p, o in zip(rows["pinfer"], rows[e], strict=True)]
                prefill[e] = {"median": round(statistics.median(v), 3), "per_round": [round(x, 3) for x in v]}
    summary = {"model": args.model, "threads": args.threads, "tokens": args.tokens, "rounds": args.rounds,
               "depth": args.depth,
               "paired_decode_ratio": ratios, "prefill_tokens": args.prefill, "paired_prefill_ratio": prefill,
               "not_measured": missing, "bytes_bound": bound,
               "unpaired_medians": {e: {k: med(e, k) for k in ("decode_tps", "prompt_tps", "load_s", "peak_rss_mb")}
                                    | {"prefill_tps": med(e, "prefill_tps"), "text": rows[e][0]["text"]}
                                    for e in engines}}
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    names = {"llamacpp": "llama.cpp via llama-cpp-python (per-token Python loop)",
             "llama-bench": "llama.cpp's llama-bench (C++ loop)",
             "pinfer-forward": "pinfer without its fused decode step (the Python forward per token)",
             "pinfer-noteam": "pinfer with the step forking the pool per operation (PINFER_DECODE_TEAM=0)"}
    print(f"RESULT: pinfer / llama.cpp decode speed, median of per-round paired ratios over {args.rounds} rounds "
          f"({Path(args.model).name}, {args.threads} threads, {args.tokens} tokens):")
    for e in ("llamacpp", "llama-bench", *(["pinfer-forward"] if args.forward else []),
              *(["pinfer-noteam"] if args.no_team else [])):
        if e in paired:
            v = summary["paired_decode_ratio"][e]
            print(f"  vs {names[e]}: {v['median']:.2f}x  (per round: {', '.join(f'{x:.2f}' for x in v['per_round'])})")
        else:
            print(f"  vs {names[e]}: not measured: {missing[e]}")
    print(f"  bound: {bound['bytes_per_token'] / 1e6:.1f} MB read per token at {bound['bandwidth_gbs']:.1f} GB/s "
          f"({args.threads} threads, measured now) = {bound['tokens_per_s']:.0f} tok/s at most")
    for e, v in prefill.items():
        print(f"  prefill of {args.prefill} tokens vs {names[e]}: {v['median']:.2f}x  "
              f"(per round: {', '.join(f'{x:.2f}' for x in v['per_round'])})")
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"context only: each engine's median over {args.rounds} rounds (unpaired: medians of different "
                    f"rounds; the paired ratios above are the result)")
    for c in ("engine", "decode tok/s", "prompt tok/s", "load s", "peak RSS MB"):
        t.add_column(c, justify="right" if c != "engine" else "left")
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    for e in engines:
        u = summary["unpaired_medians"][e]
        t.add_row(e, fmt(u["decode_tps"], ".1f"), fmt(u["prompt_tps"], ".1f"), fmt(u["load_s"], ".2f"),
                  fmt(u["peak_rss_mb"], ".0f"))
    Console().print(t)


if __name__ == "__main__":
    main()
