"""Fast planted models of any size, for memory, load and speed measurements (no calibration).

    python -m pinfer_llm.synth.fast OUT.gguf --shape llama2-13b --type f16        # 26 GB in about a minute of disk time

synth/generator.py calibrates every neuron's threshold on the model built so far, which is exact but takes minutes
for a 1B model and hours for a 13B. Speed and memory measurements need the size, the file layout and the locality,
not exact frequencies, so this generator keeps the mechanism and drops the calibration:

- Weights are slices of one random pool (a few hundred MB), so a 70B file is written at disk speed and generating it
  needs little memory. Layers share weights; that does not matter to speed.
- A constant direction u: every token embedding is r_t + sqrt(d) u with r_t orthogonal to u, and no layer writes along
  u (attention output columns and ffn_down_t rows are projected orthogonal to it), so the pre-norm residual of every
  layer holds exactly sqrt(d) u (synth/generator.py explains it).
- Gate row i is g_i - theta_i u, with theta_i from the Gaussian approximation of the pre-activation, so neuron i fires
  on about a planted fraction f_i of tokens (a power law over neurons: hot neurons exist).
- The predictor of each layer has a "bias unit": fc1's first row reads u, which is constant, so fc2's first column
  gives every neuron a fixed score offset; the other hidden units add noise. Offsets are set so that neuron i is
  predicted active on about f_i of tokens: the predicted sets follow the same power law, as trained predictors do.
- blk.N.act_counts holds the planted f_i (x tokens), in pinfer's section after the model's data (formats/section.py),
  so pi-plan plans the file directly and PowerInfer's engine still loads it.
The file is a PowerInfer file (PWRI magic, ffn_down_t, fc1/fc2) of F16, F32, Q4_0 or Q8_0 weights (predictors F16).
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from statistics import NormalDist
from typing import Annotated

import numpy as np
import typer
from gguf import quants
from gguf.constants import GGMLQuantizationType as T

from pinfer_llm.formats import constants as C
from pinfer_llm.formats.config import ModelConfig
from pinfer_llm.formats.encoder import RawTensor
from pinfer_llm.formats.errors import PinferError, report
from pinfer_llm.formats.model_writer import byte_vocab, llama_metadata
from pinfer_llm.formats.update import update_model
from pinfer_llm.formats.writer import write_gguf
from pinfer_llm.synth.generator import power_law_frequencies

SHAPES = {  # n_layer, n_embd, n_ff, n_head, n_head_kv, vocab
    "tiny": (2, 64, 256, 4, 2, 320),
    "1b": (22, 2048, 5632, 32, 4, 32000),
    "llama2-7b": (32, 4096, 11008, 32, 32, 32000),
    "llama2-13b": (40, 5120, 13824, 40, 40, 32000),
    "llama2-70b": (80, 8192, 28672, 64, 8, 32000),
}
TYPES = {"f32": T.F32, "f16": T.F16, "q4_0": T.Q4_0, "q8_0": T.Q8_0}
TOKENS = 10_000  # the token count act_counts pretend to come from
OUT_SCALE = 0.3  # attention and FFN outputs relative to a unit-RMS residual: the stream grows slowly with depth


def _encode(a: np.ndarray, qtype: T) -> np.ndarray:
    """float32 [rows, cols] -> uint8 [rows, row_bytes] in qtype."""
    if qtype == T.F32:
        return a.astype(np.float32).view(np.uint8)
    if qtype == T.F16:
        return a.astype(np.float16).view(np.uint8)
    return quants.quantize(a.astype(np.float32), qtype)


class _Pool:
    """Random rows of width d, encoded once per type; tensors are views of them."""

    def __init__(self, rows: np.ndarray, qtype: T):
        self.raw = _encode(rows, qtype)
        self.qtype = qtype

    def tensor(self, rows: int) -> RawTensor:
        if rows > self.raw.shape[0]:
            raise ValueError("pool too small")
        d = self.raw.shape[1]
        return RawTensor(self.raw[:rows], self.qtype, (rows, _cols(d, self.qtype)))


def _cols(row_bytes: int, qtype: T) -> int:
    if qtype == T.F32:
        return row_bytes // 4
    if qtype == T.F16:
        return row_bytes // 2
    return row_bytes // (18 if qtype == T.Q4_0 else 34) * 32


def _rms(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5)


def _thresholds(rng, embd, wq, nh, nkv, hd, wo, g, up, down, freq, u, n_layer, tokens: int = 64):
    """Per layer, theta_i such that neuron i fires on about freq[i] of tokens, and the RMS of the residual's part
    orthogonal to u at the FFN's input (what the predictor's noise units read): a short float32 forward over random
    tokens (attention without RoPE, which does not change these statistics) measures y = (g . xn) / (u . xn) at every
    depth, and theta is its Gaussian quantile. Without it the residual's growth with depth lowers u . xn and deep
    layers fire several times their planted rate. Layers share weights, so the forward is cheap."""
    q_inv = np.array([NormalDist().inv_cdf(1 - min(max(f, 1e-6), 1 - 1e-6)) for f in freq], dtype=np.float32)
    ids = rng.integers(0, embd.shape[0], tokens)
    x = embd[ids].astype(np.float32)  # (T, d)
    T, group = tokens, nh // nkv
    wk, wv = wq[:nkv * hd], wq[:nkv * hd]
    causal = np.tril(np.ones((T, T), dtype=bool))
    out, spread = [], []
    for _ in range(n_layer):
        xn = _rms(x)
        q = (xn @ wq[:nh * hd].T).reshape(T, nh, hd)
        k = (xn @ wk.T).reshape(T, nkv, hd)
        v = (xn @ wv.T).reshape(T, nkv, hd)
        heads = []
        for h in range(nh):
            a = q[:, h] @ k[:, h // group].T / math.sqrt(hd)
            a = np.where(causal, a, -np.inf)
            a = np.exp(a - a.max(-1, keepdims=True))
            heads.append((a / a.sum(-1, keepdims=True)) @ v[:, h // group])
        x = x + np.concatenate(heads, axis=1) @ wo.T
        r = x - np.outer(x @ u, u)
        spread.append(float(np.sqrt((r * r).mean())))  # the predictor's input grows with depth
        xn = _rms(x)
        y = (xn @ g.T) / (xn @ u)[:, None]  # fires iff y > theta
        theta = (y.mean() + q_inv * y.std()).astype(np.float32)
        out.append(theta)
        z = xn @ g.T - np.outer(xn @ u, theta)
        x = x + (np.maximum(z, 0) * (xn @ up.T)) @ down
    return out, spread


def generate_fast(path: str | os.PathLike, shape: str = "tiny", qtype: str = "f16", *, sparsity: float = 0.9,
                  skew: float = 1.0, pred_rank: int | None = None, seed: int = 0, stats: bool = True,
                  say=lambda msg: None) -> dict:
    if shape not in SHAPES:
        raise PinferError(f"unknown shape '{shape}' (one of {', '.join(SHAPES)})")
    if qtype not in TYPES:
        raise PinferError(f"unknown type '{qtype}' (one of {', '.join(TYPES)})")
    t0 = time.perf_counter()
    L, d, n_ff, nh, nkv, vocab = SHAPES[shape]
    hd = d // nh
    qt = TYPES[qtype]
    rng = np.random.default_rng(seed)
    u = rng.standard_normal(d).astype(np.float32)
    u /= np.linalg.norm(u)
    perp = lambda a: a - np.outer(a @ u, u)  # noqa: E731  rows orthogonal to u

    n_rows = max(vocab, n_ff, d)
    base = perp(rng.standard_normal((n_rows, d), dtype=np.float32))  # rows orthogonal to u, N(0, 1) entries
    sd = 1 / math.sqrt(d)
    # attention: q/k/v read the normed residual; o writes along directions orthogonal to u (columns projected)
    attn_pool = _Pool(base[:d] * sd, qt)
    o = base[d:2 * d] if n_rows >= 2 * d else base[:d]
    o = o * (OUT_SCALE * sd)
    o = o - np.outer(u, u @ o)
    o_pool = _Pool(o, qt)
    # FFN: gate rows g_i - theta_i u (per layer), up and down rows from the pool
    freq = power_law_frequencies(n_ff, sparsity, skew)
    freq = freq[rng.permutation(n_ff)]
    g = base[:n_ff] * sd
    up = base[n_ff - 1::-1][:n_ff] * sd
    down = base[:n_ff] * (OUT_SCALE * sd / math.sqrt(max(1.0, (1 - sparsity) * n_ff / d)))
    embd = base[:vocab] + math.sqrt(d) * u[None, :]  # r_t + sqrt(d) u
    thetas, spread = _thresholds(rng, embd, base[:d] * sd, nh, nkv, hd, o, g, up, down, freq, u, L)
    gate_pools = {}
    for th in {t.tobytes(): t for t in thetas}.values():
        gate_pools[th.tobytes()] = _Pool(g - th[:, None] * u[None, :], qt)
    up_pool, down_pool = _Pool(up, qt), _Pool(down, qt)
    # embeddings (F16/F32 for the lookup; the output head reads the rows orthogonal to u)
    embd_t = RawTensor(_encode(embd, T.F16 if qt != T.F32 else T.F32), T.F16 if qt != T.F32 else T.F32, (vocab, d))
    out_pool = _Pool(base[:vocab] * (4.0 * sd), qt)

    # the predictor: hidden unit 0 reads u (constant sqrt(d) on the pre-norm residual), the others random
    r = pred_rank or max(64, (n_ff // 16) // 32 * 32)
    fc1 = rng.standard_normal((r, d), dtype=np.float32) * sd
    fc1[0] = u / math.sqrt(d)  # relu(u . x) = 1 for every token
    fc2 = rng.standard_normal((n_ff, r), dtype=np.float32) / math.sqrt(r)
    xs = perp(rng.standard_normal((256, d), dtype=np.float32)) * spread[0] + math.sqrt(d) * u  # layer 0 residuals
    noise = np.maximum(xs @ fc1[1:].T, 0) @ fc2[:, 1:].T  # (256, n_ff)
    mu, sigma = noise.mean(0), noise.std(0) + 1e-6
    fc2[:, 0] = sigma * np.array([NormalDist().inv_cdf(min(max(f, 1e-6), 1 - 1e-6)) for f in freq]) - mu

    cfg = ModelConfig(arch="llama", n_layer=L, n_embd=d, n_ff=n_ff, n_head=nh, n_head_kv=nkv, vocab_size=vocab,
                      n_ctx_train=4096, ffn_act="relu", name=f"pinfer-fast-{shape}-{qtype}")
    tensors: dict[str, RawTensor | np.ndarray] = {C.TOKEN_EMBD: embd_t, C.OUTPUT_NORM: np.ones(d, np.float32),
                                                  C.OUTPUT: out_pool.tensor(vocab)}
    # the noise units read the residual's spread of each layer as they read layer 0's (where mu/sigma were measured)
    fc1_l = {}
    for sp in sorted(set(spread)):
        a = fc1.copy()
        a[1:] *= spread[0] / sp
        fc1_l[sp] = a.astype(np.float16)
    fc2_t = fc2.astype(np.float16)
    counts = (freq * TOKENS).astype(np.float32)
    for i in range(L):
        t = lambda name, i=i: C.tensor(name, i)  # noqa: E731
        tensors.update({
            t(C.ATTN_NORM): np.ones(d, np.float32), t(C.FFN_NORM): np.ones(d, np.float32),
            t(C.ATTN_Q): attn_pool.tensor(nh * hd), t(C.ATTN_K): attn_pool.tensor(nkv * hd),
            t(C.ATTN_V): attn_pool.tensor(nkv * hd), t(C.ATTN_OUT): o_pool.tensor(d),
            t(C.FFN_GATE): gate_pools[thetas[i].tobytes()].tensor(n_ff), t(C.FFN_UP): up_pool.tensor(n_ff),
            t(C.FFN_DOWN_T): down_pool.tensor(n_ff), t(C.PRED_FC1): fc1_l[spread[i]], t(C.PRED_FC2): fc2_t,
        })
    meta = llama_metadata(cfg) | byte_vocab(vocab) | {
        C.FFN_ACTIVATION: "relu", C.SPARSE_THRESHOLD: np.float32(0.0),
        C.FILE_TYPE: np.uint32({T.F32: 0, T.F16: 1, T.Q4_0: 2, T.Q8_0: 7}[qt])}
    say(f"writing {path}")
    write_gguf(path, meta, tensors, powerinfer=True, progress=True)
    if stats:  # in pinfer's section after the model's data, where PowerInfer's loader does not look
        update_model(path, set_tensors={C.tensor(C.ACT_COUNTS, i): counts for i in range(L)},
                     set_metadata={C.ACT_TOKENS: np.uint64(TOKENS), C.ACT_CORPUS: "planted (synth.fast)",
                                   C.ACT_RULE: "relu>0"})
    size = Path(path).stat().st_size
    return {"path": str(path), "shape": shape, "type": qtype, "bytes": size, "seconds": time.perf_counter() - t0,
            "predictor_rank": r, "mean_frequency": float(freq.mean())}


app = typer.Typer(add_completion=False, help="Write a large planted ReLU model fast (no calibration).")


@app.command()
def cli(out: Annotated[Path, typer.Argument(help="output .gguf")],
        shape: Annotated[str, typer.Option(help=f"one of {', '.join(SHAPES)}")] = "tiny",
        type_: Annotated[str, typer.Option("--type", help=f"weights: {', '.join(TYPES)}")] = "f16",
        sparsity: Annotated[float, typer.Option(help="planted mean fraction of inactive neurons")] = 0.9,
        seed: Annotated[int, typer.Option(help="random seed")] = 0,
        stats: Annotated[bool, typer.Option(help="store the planted activation statistics (blk.N.act_counts)")] = True,
        verbose: Annotated[bool, typer.Option(help="tracebacks on errors")] = False):
    try:
        res = generate_fast(out, shape, type_, sparsity=sparsity, seed=seed, stats=stats, say=print)
    except BaseException as e:  # noqa: BLE001
        raise typer.Exit(report(e, verbose, prog="pinfer_llm.synth.fast")) from None
    print(f"{res['path']}: {res['bytes'] / 1e9:.2f} GB in {res['seconds']:.1f} s")


if __name__ == "__main__":
    app()
