"""How close pinfer's logits are to llama.cpp's on the same GGUF (needs llama-cpp-python: pip install '.[bench]').

    python benchmarks/llamacpp_logits.py [--model smollm2] [--text FILE] [--tokens 400]

Reports, over the positions of a text, against llama.cpp's batched prefill: top-1 agreement, mean and max
KL(llama.cpp || pinfer), max |logit diff|, and the perplexity each engine assigns to the text. For context it also
reports pinfer's exact-dequantisation path (PINFER_CPU_KERNELS=0, in a child process: every weight dequantised to
fp32, fp32 arithmetic), which shows how far llama.cpp is from exact arithmetic: it quantises activations to 8-bit
blocks for quantised matrices, while pinfer's prefill (what is compared here) multiplies dequantised tiles in fp32,
so pinfer's logits equal the exact path's up to fp32 rounding.

Imitating llama.cpp's rounding does not bring the two closer. Rounding pinfer's prefill activations as llama.cpp does
(per 32 values, scale and Q4_1's block sum in fp16, bit-exact with ggml's quantize_row_q8_1 and vec_dot on one row)
was tried: SmolLM2 Q4_1, 400 tokens, mean KL to llama.cpp 0.0034 instead of 0.0027.

The last row is llama.cpp against itself: the same text decoded one token at a time (n_batch 1) against its batched
prefill, the reference's own noise floor for these figures. Why even an exact imitation of its rounding does not
agree with it much better: 8-bit activation blocks make each output jump when an input crosses a rounding boundary,
so float differences of ~1e-7 in a matrix's input (pinfer's RMSNorm sums in another order than ggml's) move some
outputs by ~1%. Seen on SmolLM2 Q4_1, layer 0, attn_v over 64 tokens: with ggml's own quantize_row_q8_1 and vec_dot
on pinfer's input, 61 tokens bit-exact, 3 off by 0.08-0.8%.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

_TREE = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(_TREE), str(_TREE / "src")]  # the checkout, without an install


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def compare(ref: np.ndarray, ours: np.ndarray, ids: list[int]) -> dict:
    lp, lq = log_softmax(ref), log_softmax(ours)
    kl = (np.exp(lp) * (lp - lq)).sum(-1)
    tgt = np.asarray(ids[1:])
    nll = lambda lp_: -lp_[np.arange(len(tgt)), tgt].mean()  # noqa: E731
    return {"top1_agreement": float((ref.argmax(-1) == ours.argmax(-1)).mean()), "mean_kl": float(kl.mean()),
            "max_kl": float(kl.max()), "max_abs_logit_diff": float(np.abs(ref - ours).max()),
            "ppl_llamacpp": float(np.exp(nll(lp[:-1]))), "ppl_pinfer": float(np.exp(nll(lq[:-1])))}


def exact_logits(path: str, ids: list[int], threads: int) -> np.ndarray:
    """pinfer's logits without its C++ kernels (float32 copies of the dequantised weights), from a child process:
    whether the kernels are used is decided once per process."""
    code = ("import sys, json, numpy as np; from pinfer_llm.runtime import load_model; "
            "m = load_model(sys.argv[1], threads=int(sys.argv[2])); "
            "np.save(sys.argv[3], m.forward_logits(json.loads(sys.argv[4])))")
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "logits.npy"
        subprocess.run([sys.executable, "-c", code, path, str(threads), str(out), json.dumps(list(ids))], check=True,
                       cwd=Path(__file__).resolve().parent.parent, env=os.environ | {"PINFER_CPU_KERNELS": "0"})
        return np.load(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--text", default=None, help="text file (default: the package's held-out corpus text)")
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import llama_cpp

    from pinfer_llm.runtime import load_model
    from pinfer_llm.runtime.engine import resolve_model_path

    path = str(resolve_model_path(args.model))
    from pinfer_llm.runtime.profiling.corpus import HELDOUT

    text_path = Path(args.text) if args.text else HELDOUT
    text = text_path.read_text(encoding="utf-8")
    llm = llama_cpp.Llama(path, n_threads=args.threads, n_ctx=max(512, args.tokens + 8), verbose=False,
                          logits_all=True)
    ids = llm.tokenize(text.encode(), add_bos=False, special=False)[:args.tokens]
    llm.eval(ids)
    ref = np.array(llm.scores[:len(ids)], dtype=np.float32)
    out = {"model": path, "text": str(text_path), "tokens": len(ids)}
    out["pinfer"] = compare(ref, load_model(path, threads=args.threads).forward_logits(ids), ids)
    out["pinfer_exact_dequant_f32"] = compare(ref, exact_logits(path, ids, args.threads), ids)
    del llm
    one = llama_cpp.Llama(path, n_threads=args.threads, n_ctx=max(512, args.tokens + 8), n_batch=1, n_ubatch=1,
                          verbose=False, logits_all=True)
    one.eval(ids)
    out["llamacpp_token_by_token"] = compare(ref, np.array(one.scores[:len(ids)], dtype=np.float32), ids)
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"{Path(path).name}, {len(ids)} tokens of {text_path.name}")
    for k in ("pinfer", "pinfer_exact_dequant_f32", "llamacpp_token_by_token"):
        r = out[k]
        print(f"  {k:26s} top-1 agree {r['top1_agreement']:.3f}  mean KL {r['mean_kl']:.4f}  max KL {r['max_kl']:.3f}"
              f"  ppl {r['ppl_pinfer']:.3f} (llama.cpp {r['ppl_llamacpp']:.3f})")


if __name__ == "__main__":
    main()
