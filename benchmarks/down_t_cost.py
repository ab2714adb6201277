"""What sparse mode's neuron-major down projection costs in quality on a file that stores only ffn_down.

    python benchmarks/down_t_cost.py                      # the demo model (SmolLM2-135M, Q4_1)
    python benchmarks/down_t_cost.py --model m.gguf --tokens 2048 --json

A neuron's column of ffn_down [d, n_ff] shares its quantisation blocks with 31 other neurons, so sparse mode reads
neuron rows from ffn_down transposed (PowerInfer's ffn_down_t), which for block types is requantised (as Q8_0, see
runtime/loader.transposed; --same-type requantises to the source's own type instead): runtime/loader.py does it in
memory at load, `pi-profile --store-down-t` once into the file. This measures the held-out perplexity of the DENSE
model computed both ways, so that only the down projection's encoding differs: ffn_down as stored vs the transposed,
requantised ffn_down_t over every neuron.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

_TREE = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(_TREE), str(_TREE / "src")]  # the checkout, without an install


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=None, help="score at most this many tokens of the held-out text")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--same-type", action="store_true", help="requantise to the source's type (what a naive "
                    "transpose does) instead of Q8_0")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from pinfer_llm.runtime import load_model
    from pinfer_llm.runtime.cpu import qops
    from pinfer_llm.runtime.loader import transposed
    from pinfer_llm.runtime.perplexity import perplexity
    from pinfer_llm.runtime.profiling.corpus import HELDOUT
    from pinfer_llm.runtime.weights import quantize_like

    text = HELDOUT.read_text()
    res = {}
    for way in ("ffn_down", "ffn_down_t"):
        m = load_model(args.model, threads=args.threads, ctx_size=args.ctx, ffn_mode="dense")
        if args.tokens:
            text = m.tokenizer.decode(m.tokenizer.encode(text)[:args.tokens])
        if way == "ffn_down_t":
            for b in m.transformer.blocks:
                if b.ffn.down is None:
                    raise SystemExit("the model stores ffn_down_t already: nothing to compare")
                w = b.ffn.down.ws[0]
                b.ffn.rows.down_t = (quantize_like(qops.rows(w, 0, w.rows).T.contiguous(), w.qtype, "down_t")
                                     if args.same_type else transposed(w))
                b.ffn.down = None  # DenseFFN then computes every neuron over the neuron-major rows
        r = perplexity(m, text, args.ctx)
        rows = m.transformer.blocks[0].ffn.rows
        res[way] = {"ppl": round(r.ppl, 4), "stderr": round(r.stderr, 4), "tokens_scored": r.tokens_scored,
                    "type": (rows.down_t if way == "ffn_down_t" else m.transformer.blocks[0].ffn.down.ws[0]).type_name}
    res["relative_change"] = round(res["ffn_down_t"]["ppl"] / res["ffn_down"]["ppl"] - 1, 5)
    if args.json:
        print(json.dumps(res, indent=1))
        return
    print(f"held-out perplexity, dense, ctx {args.ctx}: ffn_down as stored {res['ffn_down']['ppl']:.3f} "
          f"(+/- {res['ffn_down']['stderr']:.3f}); neuron-major requantised ffn_down_t {res['ffn_down_t']['ppl']:.3f}: "
          f"{100 * res['relative_change']:+.2f}% ({res['ffn_down']['tokens_scored']} tokens scored)")


if __name__ == "__main__":
    main()
