"""Activation locality, shown: a planted ReLU model decoded --dense and --sparse side by side (part of `make demo`).

    python benchmarks/sparsity_demo.py          # makes build/planted-demo-*.gguf and its predictors on first use
    python benchmarks/sparsity_demo.py --json

1. The model: a synthetic ReluLLaMA-shaped model with planted activation locality (pinfer_llm.synth.generate, the
   function behind `python -m pinfer_llm.synth`): in every layer ~90% of the FFN neurons are exactly zero on a
   token, a different 90% for each token. Made once into build/ (kept while the file opens and has the asked shape).
2. Its predictors: `pi-profile MODEL --train-predictors`, the real CLI, stored into the file (skipped when the file
   has them). The corpus is random text, not the built-in English one: a planted model has no language, and from
   any prompt its greedy continuation wanders over the whole byte vocabulary, of which English reaches 91 of 257
   tokens. Predictors trained on English meet unseen inputs there (measured on an 8 x 512 x 2048 planted model:
   top-1 agreement 0.77 on its greedy continuation, 0.995 on held-out English; trained on random text instead:
   0.94 and 0.97). Random UTF-8 text reaches 242 of the tokens, every byte value UTF-8 can hold.
3. Speed: the model loaded twice in this process, ffn_mode "dense" and "sparse" (pi-run --dense / --sparse), each
   decoding the same greedy prompt. A warm-up generation first (not counted), then --rounds rounds of one run of
   each mode back to back, the order alternating, so that a burst of other work on a shared machine hits both runs
   of a round. Reported: each mode's median decode tok/s, and the median of the per-round speed-ups.
4. Neurons computed, per token and layer: dense evaluates every neuron (1.0); sparse the ones its predictors pick
   (its counter over the timed rounds, prompts included, as pi-run --json's ffn_active_fraction).
5. Top-1 agreement: the dense greedy continuation teacher-forced through the sparse model (one causal pass over
   prompt + continuation, Model.forward_logits): the share of the continuation's positions where the sparse
   model's argmax is the dense model's token. Free-running, one early divergence would make every later token
   differ, which says little about the predictors (the first divergence is reported too).
6. The physical bound: bytes of FFN weights read per token. Dense over a PowerInfer file is already exact about
   zeros: its kernel reads every neuron's gate row, and the up and down rows only of the neurons that fire (the
   others' activation is exactly 0), so G + f*(U + D) per layer, f the share that fires on these tokens (counted
   with exact masks, ffn_mode "oracle", over prompt + continuation). Sparse reads its predictors P, the gate rows of
   the neurons they pick (share p) and the up and down rows of those that fire: at most P + p*G + f*(U + D). The
   ratio bounds the FFN's speed-up; attention and the output head cost the same in both modes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
if "pinfer_llm" not in sys.modules:  # the checkout, also without an install (a caller's --src tree stays)
    sys.path[:0] = [str(SRC)]

# n_layer, n_embd, n_ff, n_head, n_head_kv. A few wide layers: the FFN is most of a decode step, as in LLMs, and the
# model is made, profiled and given predictors in ~40 s on 2 cores. synth's byte vocabulary keeps the head small.
SHAPE = "4,1024,4096,16,2"
PROMPT = "Once upon a time"
CORPUS_CHARS = 3300  # of random text: ~8k byte tokens, pi-profile's 8192 training samples per layer
TRAIN_STEPS = 200  # pi-profile --steps; the default 600 took 2.6x the time for a predicted density of 0.112
# instead of 0.117 (one 512 x 2048 layer, recall 0.99)


def default_path(shape: str, sparsity: float, recall: float) -> Path:
    return ROOT / "build" / f"planted-demo-{shape.replace(',', 'x')}-s{sparsity:g}-r{recall:g}.gguf"


def parse_shape(shape: str) -> dict:
    try:
        vals = [int(v) for v in shape.split(",")]
    except ValueError:
        vals = []
    if len(vals) != 5:
        raise SystemExit(f"--shape must be n_layer,n_embd,n_ff,n_head,n_head_kv, got '{shape}'")
    return dict(zip(("n_layer", "n_embd", "n_ff", "n_head", "n_head_kv"), vals, strict=True))


def is_valid(path: Path, dims: dict, sparsity: float) -> bool:
    """The file opens as a planted model of this shape and sparsity (a file of another shape, or one that no longer
    reads, is made again)."""
    from pinfer_llm.formats import constants as C
    from pinfer_llm.formats.config import config_from_gguf
    from pinfer_llm.formats.reader import open_gguf

    if not path.exists():
        return False
    try:
        f = open_gguf(path)
        cfg = config_from_gguf(f)
        planted = f.get(C.SYNTH_SPARSITY)
    except Exception:  # noqa: BLE001 - whatever is wrong with it, the file is made again
        return False
    have = dict(n_layer=cfg.n_layer, n_embd=cfg.n_embd, n_ff=cfg.n_ff, n_head=cfg.n_head, n_head_kv=cfg.n_head_kv)
    return have == dims and planted is not None and abs(float(planted) - sparsity) < 1e-4


def has_predictors(path: Path) -> bool:
    from pinfer_llm.formats.config import config_from_gguf
    from pinfer_llm.formats.reader import open_gguf

    return config_from_gguf(open_gguf(path)).has_predictors


def random_text(n_chars: int, seed: int = 0) -> str:
    """Characters drawn from the four UTF-8 lengths alike, so that their bytes take every value UTF-8 can hold."""
    import numpy as np

    rng = np.random.default_rng(seed)
    ranges = [(0x01, 0x80), (0x80, 0x800), (0x800, 0x10000), (0x10000, 0x110000)]
    out: list[str] = []
    while len(out) < n_chars:
        lo, hi = ranges[int(rng.integers(0, len(ranges)))]
        c = int(rng.integers(lo, hi))
        if not 0xD800 <= c < 0xE000:  # surrogates are not characters
            out.append(chr(c))
    return "".join(out)


def ensure_model(path: Path, dims: dict, sparsity: float = 0.9, recall: float = 0.99, threads: int = 2,
                 say=print, make: bool = True) -> dict:
    """Make the planted model where the file is missing or another model (unless make is False), and train its
    predictors with pi-profile where it has none; returns the seconds each step took (empty: nothing to do)."""
    from pinfer_llm.synth import SynthSpec, generate

    took: dict[str, float] = {}
    if make and not is_valid(path, dims, sparsity):
        path.parent.mkdir(parents=True, exist_ok=True)
        say(f"making {path.name}: a planted ReLU model (python -m pinfer_llm.synth) ...")
        t0 = time.perf_counter()
        generate(path, SynthSpec(**dims, vocab="bytes", sparsity=sparsity, seed=0, name="planted-relullama-demo"))
        took["synth_s"] = round(time.perf_counter() - t0, 1)
    if not has_predictors(path):
        corpus = path.with_name(path.stem + "-random.txt")
        corpus.write_text(random_text(CORPUS_CHARS), encoding="utf-8")
        cmd = [sys.executable, "-m", "pinfer_llm.cli.profile", str(path), "--train-predictors", "--recall",
               str(recall), "--steps", str(TRAIN_STEPS), "--corpus", str(corpus), "-t", str(threads), "--json"]
        say(f"profiling it and training predictors: pi-profile {path.name} --train-predictors --recall {recall} "
            f"--steps {TRAIN_STEPS} --corpus {corpus.name} ...")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])))
        t0 = time.perf_counter()
        res = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if res.returncode != 0:
            raise SystemExit(f"pi-profile failed ({res.returncode}): {res.stderr.strip() or res.stdout.strip()}")
        took["profile_s"] = round(time.perf_counter() - t0, 1)
    return took



def planted_model(threads: int = 2) -> Path:
    """The demo's planted model with its predictors (made into build/ on first use, silently), for other benchmarks."""
    path = default_path(SHAPE, 0.9, 0.99)
    ensure_model(path, parse_shape(SHAPE), threads=threads, say=lambda msg: None)
    return path


def bench_models(names: str, threads: int = 2) -> list[tuple[str, str, dict]]:
    """--models of the batching benchmarks ("smollm2,planted") as (label, path, load_model keywords)."""
    out = []
    for name in names.split(","):
        if name == "smollm2":
            out.append((name, "smollm2", {}))
        elif name == "planted":
            path = planted_model(threads)
            out.append((f"planted {SHAPE} ({path.name})", str(path), {"ffn_mode": "sparse"}))
        else:
            raise SystemExit(f"--models: unknown model '{name}' (smollm2, planted)")
    return out

def ffn_bytes(f, cfg) -> dict:
    """Bytes of FFN weights, summed over the layers, by role: gate rows, up + down rows, predictors."""
    from pinfer_llm.formats import constants as C

    def size(template: str, i: int) -> int:
        name = C.tensor(template, i)
        return f.info(name).nbytes if f.has(name) else 0

    down = C.FFN_DOWN_T if f.has(C.tensor(C.FFN_DOWN_T, 0)) else C.FFN_DOWN
    layers = range(cfg.n_layer)
    return {"gate": sum(size(C.FFN_GATE, i) for i in layers),
            "up_down": sum(size(C.FFN_UP, i) + size(down, i) for i in layers),
            "predictors": sum(size(C.PRED_FC1, i) + size(C.PRED_FC2, i) for i in layers)}


def share_computed(m) -> float:
    """Mean over layers of the share of neurons computed per token (1.0 for a dense FFN, which counts nothing)."""
    s = m.sparsity()
    return 1.0 if s is None else sum(s) / len(s)


def reset_counts(m) -> None:
    for b in m.transformer.blocks:
        st = getattr(b.ffn, "stats", None)
        if st is not None:
            st.tokens = st.active = 0


def top1_agreement(m, prompt_ids: list[int], continuation: list[int]) -> float:
    """Teacher-force `continuation` after the prompt through m: the share of its positions where m's argmax is that
    token. Row P-1+k of the logits (P = prompt length) is the prediction for continuation[k]."""
    if not continuation:
        raise ValueError("no continuation to compare")
    logits = m.forward_logits(list(prompt_ids) + list(continuation[:-1]))
    P = len(prompt_ids)
    pred = logits[P - 1:P - 1 + len(continuation)].argmax(-1)
    return float((pred == continuation).mean())


def ensure_twin(path: Path, twin: Path, say=print) -> None:
    """The model as llama.cpp's converter lays it out (benchmarks/e2e_sparse.py dense_twin): what a dense engine
    reads, every row of every neuron. Made once beside the model."""
    if twin.exists() and twin.stat().st_mtime >= path.stat().st_mtime:
        return
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from e2e_sparse import dense_twin

    say(f"writing {twin.name}: the same weights in llama.cpp's layout ...")
    dense_twin(path, twin)


def compare(path, prompt: str = PROMPT, tokens: int = 64, rounds: int = 3, threads: int = 2,
            mode: str = "sparse", baseline: str = "dense", twin: Path | None = None) -> dict:
    """The demo's measurements: ffn_mode `baseline` and `mode` (load_model's) decoding the same greedy prompt; with
    `twin` (the model in llama.cpp's layout), also a dense engine that reads every row, as a third row."""
    from pinfer_llm.formats import constants as C
    from pinfer_llm.runtime import load_model

    if rounds < 1 or tokens < 2:
        raise ValueError("need rounds >= 1 and tokens >= 2")
    models = {"baseline": load_model(path, threads=threads, ffn_mode=baseline),
              "mode": load_model(path, threads=threads, ffn_mode=mode)}
    if twin is not None:
        models["twin"] = load_model(twin, threads=threads, ffn_mode="dense")
    ids = models["baseline"].tokenizer.encode(prompt)

    def run(m) -> tuple[list[int], float]:
        # stop_ids=set(): both modes decode exactly `tokens` tokens, even past an end-of-text token
        out = list(m.generate(ids, max_tokens=tokens, temperature=0.0, stop_ids=set()))
        return out, m.stats.decode_tps

    for m in models.values():  # warm-up: page faults, the thread pool, first-call costs
        list(m.generate(ids, max_tokens=4, temperature=0.0, stop_ids=set()))
        reset_counts(m)
    tps: dict[str, list[float]] = {k: [] for k in models}
    outs: dict[str, list[int]] = {}
    for r in range(rounds):
        for k in (list(models) if r % 2 == 0 else list(models)[::-1]):
            out, t = run(models[k])
            tps[k].append(t)
            if outs.setdefault(k, out) != out:
                raise RuntimeError(f"greedy decoding in mode {k} gave two different continuations")
    ratios = [s / d for s, d in zip(tps["mode"], tps["baseline"], strict=True)]
    if twin is not None and outs["twin"] != outs["baseline"]:
        raise RuntimeError("the llama.cpp-layout twin decoded other tokens than the model")
    share = {k: share_computed(m) for k, m in models.items()}

    cont = outs["baseline"]
    agree = top1_agreement(models["mode"], ids, cont)
    diverge = next((i for i, (a, b) in enumerate(zip(cont, outs["mode"], strict=True)) if a != b), None)

    exact = load_model(path, threads=threads, ffn_mode="oracle")  # which neurons truly fire on these tokens
    exact.forward_logits(list(ids) + cont[:-1])
    fires = share_computed(exact)
    f, cfg = models["baseline"].file, models["baseline"].cfg
    b = ffn_bytes(f, cfg)
    skips_zeros = cfg.down_transposed and cfg.ffn_act in ("relu", "drelu")  # the kernel reads gate rows first

    def read(m, computed: float) -> int:
        if m.ffn_mode == "dense" and not skips_zeros:
            return b["gate"] + b["up_down"]
        preds = b["predictors"] if m.ffn_mode == "sparse" else 0
        return int(preds + computed * b["gate"] + min(fires, computed) * b["up_down"])

    rows = []
    for k, name in (("baseline", baseline), ("mode", mode)):
        rows.append({"mode": name, "decode_tokens_per_s": round(statistics.median(tps[k]), 2),
                     "decode_tokens_per_s_rounds": [round(t, 2) for t in tps[k]],
                     "speedup": 1.0 if k == "baseline" else round(statistics.median(ratios), 3),
                     "neurons_computed": round(share[k], 4),
                     "ffn_bytes_per_token": read(models[k], share[k]),
                     "top1_agreement": 1.0 if k == "baseline" else round(agree, 4)})
    rows[1]["speedup_rounds"] = [round(x, 3) for x in ratios]
    if twin is not None:  # every row read: what llama.cpp's dense kernels read for this model
        vs = [s / d for s, d in zip(tps["mode"], tps["twin"], strict=True)]
        rows.append({"mode": "all rows (llama.cpp)",
                     "decode_tokens_per_s": round(statistics.median(tps["twin"]), 2),
                     "decode_tokens_per_s_rounds": [round(x, 2) for x in tps["twin"]],
                     "speedup": round(statistics.median([d / s for s, d in zip(tps["baseline"], tps["twin"],
                                                                               strict=True)]), 3),
                     "neurons_computed": 1.0, "ffn_bytes_per_token": b["gate"] + b["up_down"],
                     "top1_agreement": 1.0, "sparse_speedup_over_it": round(statistics.median(vs), 3)})
    rows[1]["first_divergence"] = diverge  # index of the first token the free-running runs differ in, or None
    return {"model": str(path), "shape": [cfg.n_layer, cfg.n_embd, cfg.n_ff, cfg.n_head, cfg.n_head_kv],
            "dtype": f.info(C.tensor(C.FFN_UP, 0)).type_name, "prompt": prompt, "prompt_tokens": len(ids),
            "tokens": tokens, "rounds": rounds, "threads": models["baseline"].threads,
            "neurons_firing": round(fires, 4), "ffn_bytes": b,
            "bytes_ratio": round(rows[0]["ffn_bytes_per_token"] / rows[1]["ffn_bytes_per_token"], 3), "rows": rows}


def render(res: dict, setup: dict | None = None) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    con = Console(highlight=False, width=None if sys.stdout.isatty() else 112)
    n_layer, d, n_ff, *_ = res["shape"]
    mb = lambda n: f"{n / 2**20:.1f} MB"  # noqa: E731
    con.print(f"planted ReLU model: {n_layer} layers x {d} wide x {n_ff} FFN neurons, {res['dtype']}; "
              f"{res['tokens']} greedy tokens of \"{res['prompt']}\" on {res['threads']} threads, median of "
              f"{res['rounds']} paired rounds" + ("; made in " + ", ".join(f"{k.removesuffix('_s')} {v:.0f} s"
                                                                         for k, v in setup.items()) if setup else ""))
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("FFN", "decode tok/s", "speed-up", "neurons computed", "FFN weights read", "top-1 agreement"):
        t.add_column(col, justify="left" if col == "FFN" else "right")
    for r in res["rows"][2:] + res["rows"][:2]:
        every = r["mode"] == "all rows (llama.cpp)"
        t.add_row(r["mode"] if every else f"--{r['mode']}", f"{r['decode_tokens_per_s']:.1f}",
                  f"{r['speedup']:.2f}x", f"{r['neurons_computed']:.1%}", mb(r["ffn_bytes_per_token"]) + "/token",
                  "(same tokens)" if every else "(reference)" if r is res["rows"][0] else f"{r['top1_agreement']:.3f}")
    con.print(t)
    s = res["rows"][1]
    div = s["first_divergence"]
    preds = mb(res["ffn_bytes"]["predictors"])
    con.print(f"{res['neurons_firing']:.1%} of the neurons fire per token. --dense reads all gate rows, then the up "
              f"and down rows of the neurons that fire; --sparse reads its predictors ({preds}) and the rows of "
              f"the neurons they pick: {res['bytes_ratio']:.2f}x fewer FFN bytes, the bound on the "
              f"FFN's speed-up (attention and the output head cost the same in both). Agreement: the --dense "
              f"continuation teacher-forced through --sparse (free-running, "
              + (f"they first differ at token {div + 1} of {res['tokens']})." if div is not None
                 else f"all {res['tokens']} tokens are the same)."))
    if len(res["rows"]) > 2:
        w = res["rows"][2]
        fewer = w["ffn_bytes_per_token"] / s["ffn_bytes_per_token"]
        con.print(f"all rows (llama.cpp): the same weights in llama.cpp's layout, every row of every neuron read, as "
                  f"a dense engine does; --sparse is {w['sparse_speedup_over_it']:.2f}x faster, reading {fewer:.1f}x "
                  f"fewer FFN bytes.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="a planted (or any ReLU) model to run; given predictors with "
                    "pi-profile if it has none. Default: build/planted-demo-<shape>-s<sparsity>-r<recall>.gguf, "
                    "made on first use")
    ap.add_argument("--shape", default=SHAPE, help=f"n_layer,n_embd,n_ff,n_head,n_head_kv (default {SHAPE})")
    ap.add_argument("--sparsity", type=float, default=0.9, help="planted share of zero neurons per token")
    ap.add_argument("--recall", type=float, default=0.99, help="pi-profile --recall for the predictors")
    ap.add_argument("-p", "--prompt", default=PROMPT)
    ap.add_argument("-n", "--tokens", type=int, default=64, help="greedy tokens per run")
    ap.add_argument("--rounds", type=int, default=3, help="paired --dense/--sparse rounds after the warm-up")
    ap.add_argument("-t", "--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--no-twin", action="store_true", help="skip the row of a dense engine that reads every row "
                    "(the demo's model copied into llama.cpp's layout, once, into build/; never made for --model)")
    ap.add_argument("--json", action="store_true", help="print the results as one JSON object")
    args = ap.parse_args()

    if args.model is not None and not args.model.exists():
        raise SystemExit(f"{args.model}: no such model file")
    path = args.model or default_path(args.shape, args.sparsity, args.recall)
    say = (lambda msg: print(msg, file=sys.stderr)) if args.json else print
    # a --model is never replaced, only given predictors where it has none
    setup = ensure_model(path, parse_shape(args.shape), args.sparsity, args.recall, args.threads, say,
                         make=args.model is None)
    twin = None
    if not args.no_twin and args.model is None:  # a copy of the demo's own model only, never of a user's file
        twin = path.with_name(path.stem + "-llamacpp-layout.gguf")
        ensure_twin(path, twin, say)
    res = compare(path, args.prompt, args.tokens, args.rounds, args.threads, twin=twin)
    if args.json:
        print(json.dumps(res | {"setup_s": setup}))
    else:
        render(res, setup)


if __name__ == "__main__":
    main()
