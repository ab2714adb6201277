"""The hybrid executor's own host cost per layer: runtime/hybrid/executor.py over a device that computes nothing.

    python benchmarks/hybrid_overhead.py            # 40 layers, attention + predictor + half the neurons on the "GPU"
    python benchmarks/hybrid_overhead.py --layers 80 --steps 300 --json

On a real GPU every device call costs host time of its own (a CuPy launch, ~5-10 us); this measures what pinfer's
Python adds around them: staging buffers, views, events, the CPU's share of the FFN (tiny here: a 64-wide model with
192 neurons, half of them the CPU's), per decode step of a split layer. The device is runtime.gpu.ReferenceDevice
with its compute replaced by returning buffers of the right shape, so the figure is the orchestration alone, on one
thread. Then the same with runtime.gpu.CudaDevice's own wrappers (argument packing, shape checks, views) around
kernels that do nothing, over plain numpy arrays: pinfer's whole Python cost per layer, to which a real GPU adds
CuPy's per launch. The CPU-only forward of the same model is printed beside it for scale.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

_TREE = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(_TREE), str(_TREE / "src")]  # the checkout, without an install

from pinfer_llm.formats import constants as C  # noqa: E402
from pinfer_llm.formats.model_writer import write_llama  # noqa: E402
from pinfer_llm.runtime import load_model  # noqa: E402
from pinfer_llm.runtime.gpu import ReferenceDevice  # noqa: E402
from pinfer_llm.runtime.hybrid import executor as hybrid  # noqa: E402
from pinfer_llm.runtime.hybrid.placement import Placement  # noqa: E402
from tests.tiny import random_weights, tiny_config, to_powerinfer_layout  # noqa: E402


class NullDevice(ReferenceDevice):
    """The reference device's memory and copies, no compute: each op returns a buffer of its result's shape."""

    def matmul(self, w, x, *, bias=None, out=None, accumulate=False, relu=False):
        return out if out is not None else self.empty((x.shape[0], w.rows))

    def attention(self, q, k, v, cache_k, cache_v, pos, **kw):
        return self.empty(q.shape)

    def ffn(self, ffn, x, *, scores=None, threshold=0.0, cats=None, out=None):
        return out if out is not None else self.zeros((x.shape[0], ffn.d))

    def predict(self, pred, x, *, threshold=0.0, skip=None, ids=False, found=None):
        scores = self.zeros((x.shape[0], pred.n_ff))
        if not ids:
            return scores
        found = self.zeros((1 + pred.n_ff,), np.int32) if found is None else found
        found[0] = 3  # three active CPU neurons
        found[1:4] = torch.tensor([1, 5, 9], dtype=torch.int32)
        return scores, found

    def rms_norm(self, x, w, eps, out=None, *, add=None, copy=None):
        return out if out is not None else self.empty(tuple(x.shape))

    def add(self, a, b, out=None):
        return out if out is not None else self.empty(tuple(a.shape))

    def count_active(self, ffn, scores, threshold, acc):
        return acc


def null_cuda():
    """runtime.gpu.CudaDevice whose kernels do nothing, over the tests' CuPy stand-in with plain numpy allocations
    (no guard bytes): what pinfer's own Python costs around each CuPy launch, CuPy's own costs not included."""
    from pinfer_llm.runtime.gpu import CudaDevice
    from tests.cuda_emu import fake_cupy

    class Module(fake_cupy.RawModule):  # launches counted and captured as the fake's, the kernels themselves no-ops
        def __init__(self, code, options=()):
            pass

        def _kernel(self, name):
            if name == "select_active":  # three active CPU neurons, as NullDevice.predict
                def select(grid, block, args, **kw):
                    args[9][0], args[8][:3] = 3, (1, 5, 9)  # count, ids

                return select
            return lambda grid, block, args, **kw: None

    class Graph(fake_cupy.Graph):
        """A replay is one driver call (cudaGraphLaunch); the fake's Python loop over the captured no-op kernels is
        not pinfer's cost. Their outputs do not change from step to step, so the first replay runs them, the rest
        only count."""

        def launch(self, stream=None):
            if getattr(self, "ran", False):
                fake_cupy.calls["graph_launch"] += 1
                return
            super().launch(stream)
            self.ran = True

    fake_cupy.CHECKED = False  # plain numpy allocations, no guard bytes
    fake_cupy.RawModule = Module
    fake_cupy.Graph = Graph  # what end_capture makes
    return CudaDevice(cupy=fake_cupy)


def per_layer_us(m, steps: int, n_layer: int, calls=None) -> float:
    """Host time per layer and decode step (after two steps that warm up and capture). calls: a counter to reset
    before the timed steps (the fake CuPy's driver calls)."""
    tr = m.transformer
    with torch.inference_mode():
        tr.forward(torch.tensor([5, 6, 7]), 0)
        tr.forward(torch.tensor([8]), 3)
        tr.forward(torch.tensor([8]), 4)
        if calls is not None:
            calls.reset()
        t0 = time.perf_counter()
        for i in range(steps):
            tr.forward(torch.tensor([8]), 5 + i % 32)
        return (time.perf_counter() - t0) / steps / n_layer * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    L = args.layers
    cfg = tiny_config(ffn_act="relu", n_layer=L, n_ff=192)
    w = to_powerinfer_layout(cfg, random_weights(cfg, seed=3, scale=0.15))
    counts = {C.tensor(C.ACT_COUNTS, i): np.linspace(100, 1, cfg.n_ff).astype(np.float32) for i in range(L)}
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "m.gguf"
        write_llama(path, cfg, w | counts, powerinfer=True, extra_metadata={C.ACT_TOKENS: np.uint64(100)})
        cpu = per_layer_us(load_model(path, ffn_mode="sparse", threads=1), args.steps, L)
        m = load_model(path, ffn_mode="sparse", threads=1)
        half = [np.arange(0, cfg.n_ff, 2, dtype=np.int64)] * L
        place = Placement("split", np.ones(L, bool), np.ones(L, bool), half, True, "benchmark")
        hybrid.apply(m, place, NullDevice())
        hyb = per_layer_us(m, args.steps, L)
        m = load_model(path, ffn_mode="sparse", threads=1)
        dev = null_cuda()
        hybrid.apply(m, place, dev)
        calls = dev.cp.calls
        cuda = per_layer_us(m, args.steps, L, calls)
        per_call = {k: round(v / (args.steps * L), 3) for k, v in sorted(calls.items())}
    res = {"layers": L, "hybrid_us_per_layer": round(hyb, 1), "with_cuda_wrappers_us_per_layer": round(cuda, 1),
           "cpu_path_us_per_layer": round(cpu, 1), "hybrid_ms_per_token": round(hyb * L / 1e3, 2),
           "with_cuda_wrappers_ms_per_token": round(cuda * L / 1e3, 2),
           "cupy_calls_per_split_layer": round(calls.total() / (args.steps * L), 3), "cupy_calls_by_kind": per_call}
    if args.json:
        print(json.dumps(res))
    else:
        print(f"hybrid host cost {hyb:.1f} us per split layer ({hyb * L / 1e3:.2f} ms per token of {L} layers), "
              f"device compute excluded; with runtime.gpu.CudaDevice's wrappers around no-op kernels {cuda:.1f} us "
              f"({cuda * L / 1e3:.2f} ms per token), CuPy's own launch costs excluded, in "
              f"{res['cupy_calls_per_split_layer']} CuPy calls per split layer and step; the CPU path's whole layer of "
              f"this tiny model: {cpu:.1f} us")


if __name__ == "__main__":
    main()
