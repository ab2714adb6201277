"""The CPU emulation's race detector (tests/cuda_emu/cuda_emu.h) against what a GPU does to racy kernels.

Each plant breaks the live kernel source by text substitution (the text must still be found exactly once, so a
moved source fails here rather than silently testing nothing) and runs it through CudaDevice on the emulation. Run
blocks one after another, none of these changes a result: a GPU runs the blocks at once and interleaves the warps, so
only a check of every access sees them. The unplanted kernels run clean on the same inputs, on the generic and on
Hopper's branch.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from cuda_emu import emu, fake_cupy

from pinfer_llm.runtime.gpu import CudaDevice, ReferenceDevice
from pinfer_llm.runtime.gpu import cuda as cuda_mod
from pinfer_llm.runtime.gpu import layout as L
from pinfer_llm.runtime.gpu.sources import KERNEL_DIR, source

ATOMICS = """  atomicAdd(y, v.x);
  atomicAdd(y + 1, v.y);
  atomicAdd(y + 2, v.z);
  atomicAdd(y + 3, v.w);"""
PLAIN = """  y[0] += v.x;
  y[1] += v.y;
  y[2] += v.z;
  y[3] += v.w;"""
BLOCK_SUM_TAIL = """  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(FULL_MASK, s, o);
  __syncthreads();
  return s;"""
BUSY_FIXED = "    if (!__syncthreads_or(worked)) continue;"
# The flag sparse_down used until 2026-12-03 (issue #25): thread 0 reset it with no barrier after the reset, and the
# `continue` skipped the closing barrier.
BUSY_RACY = "    if (worked && lane == 0) busy = 1;\n    __syncthreads();\n    if (!busy) continue;"

PLANTS = {  # name: (module, correct text, planted text, runs, what the detector says)
    "atomic_add4 with plain adds": ("sparse_ffn", ATOMICS, PLAIN, "ffn", r"data race on global memory .*another block"),
    "atomic_add4 with plain adds (Hopper)": (
        "sparse_ffn", "  atomicAdd(reinterpret_cast<float4*>(y), v);",
        "  float4* p = reinterpret_cast<float4*>(y);\n"
        "  *p = make_float4(p->x + v.x, p->y + v.y, p->z + v.z, p->w + v.w);",
        "ffn", r"data race on global memory .*another block"),
    "block_sum without its second barrier": (
        "norm", BLOCK_SUM_TAIL, BLOCK_SUM_TAIL.replace("  __syncthreads();\n", ""), "layer_norm",
        r"data race on shared memory \((write after read|read after write)\)"),
    "a divergent barrier in block_sum": (
        "norm", "  if (lane == 0) buf[w] = v;\n  __syncthreads();",
        "  if (lane == 0) buf[w] = v;\n  if (w == 0) __syncthreads(); else __syncthreads();", "layer_norm",
        r"divergent __syncthreads"),
    "sparse_down's busy flag (the original race)": (
        "sparse_down_busy", BUSY_FIXED, BUSY_RACY, "down_old", r"data race on shared memory"),
}
# The kernel the busy flag lived in was rewritten (issue #25: a gathered sparse_down with no flag); this copy of it
# keeps the plant's check alive.
OLD_DOWN = Path(__file__).with_name("cuda_emu") / "sparse_down_busy.cu"


def _source(module: str) -> str:
    if module != "sparse_down_busy":
        return source(module)
    header = (KERNEL_DIR / "quant.cuh").read_text()
    return OLD_DOWN.read_text().replace('#include "quant.cuh"', header.replace("#pragma once\n", ""), 1)


def _planted(module: str, good: str, bad: str) -> str:
    text = _source(module)
    assert text.count(good) == 1, f"the plant's correct text is no longer in {module} (exactly once)"
    if "busy" in bad:  # the flag's declaration and reset, as they were
        anchor = "  const int jb = (blockIdx.y * nwb + wib) * rows_per_warp;"
        loop = "  for (int t0 = 0; t0 < T; t0 += TT) {\n"
        assert text.count(anchor) == 1 and text.count(anchor + "\n  const int je") == 1
        text = text.replace(anchor, "  __shared__ int busy;\n" + anchor)
        i = text.index(loop, text.index(anchor)) + len(loop)
        text = text[:i] + "    if (threadIdx.x == 0) busy = 0;\n" + text[i:]
    return text.replace(good, bad)


def _run(dev, what: str):
    """The kernels a plant sits in, on inputs where several blocks meet (outputs, for the clean runs' check)."""
    rng = np.random.default_rng(7)
    if what == "down_old":  # the old sparse_down, launched as CudaDevice launched it
        d, k, T = 1024 + 64, 1024, 2
        w = dev.upload_matrix(L.random_rows(rng, L.F16, k, d, 0.3), L.F16, d)
        h = rng.standard_normal((T, k)).astype(np.float32)
        h[:, rng.random(k) < 0.5] = 0
        y = dev.zeros((T, d))
        fn = dev.cp.RawModule(code=cuda_mod.source("sparse_down_busy"), options=cuda_mod.NVRTC_OPTIONS)
        fn.get_function("sparse_down_old_f16_t2")((2, k // 256), (256,), (w.data, np.int64(w.stride), np.int32(d),
                                                  dev.asarray(h), np.int32(k), np.int32(T), y, np.int32(32)))
        return dev.to_numpy(y)
    if what == "ffn":
        d, n_ff = 1024 + 64, 1024  # one tile and a tail; 4 blocks add into every unit (down_rows_per_warp below)
        up, down = (L.random_rows(rng, L.F16, n_ff, d, 0.3) for _ in range(2))
        x = rng.standard_normal((2, d)).astype(np.float32)
        f = dev.upload_ffn(up, down, L.F16, d, np.arange(n_ff), act="relu_up")  # OPT-style: up, ReLU, down
        return dev.to_numpy(dev.ffn(f, dev.asarray(x)))
    x = rng.standard_normal((3, 1000)).astype(np.float32)
    w, b = (rng.standard_normal(1000).astype(np.float32) for _ in range(2))
    return dev.to_numpy(dev.layer_norm(dev.asarray(x), dev.asarray(w), dev.asarray(b), 1e-5))


def _device():
    dev = CudaDevice(cupy=fake_cupy)
    dev.down_rows_per_warp = 32  # 8 warps x 32 rows per block: 1024 rows are 4 blocks per output unit
    return dev


@pytest.mark.parametrize("name", list(PLANTS))
def test_planted_race_is_caught(monkeypatch, name):
    module, good, bad, what, says = PLANTS[name]
    text = _planted(module, good, bad)
    monkeypatch.setattr(cuda_mod, "source", lambda m: text if m == module else source(m))
    monkeypatch.setattr(fake_cupy, "ARCH", 900 if "Hopper" in name else 0)
    with pytest.raises(emu.EmuError, match=says):
        _run(_device(), what)


@pytest.mark.parametrize("arch", [0, 900])
@pytest.mark.parametrize("what", ["ffn", "layer_norm"])
def test_live_kernels_are_clean_and_right(monkeypatch, arch, what):
    monkeypatch.setattr(fake_cupy, "ARCH", arch)
    got, want = _run(_device(), what), _run(ReferenceDevice(), what)
    assert np.max(np.abs(got - want)) <= 1e-4 * np.abs(want).max()


def test_the_hopper_plant_sits_in_a_branch_only_arch_900_runs(monkeypatch):
    """The same planted source, built for the generic branch, runs clean: so the Hopper plant's failure above is the
    sm_90 branch running, not the plant breaking something both branches share."""
    module, good, bad, what, _ = PLANTS["atomic_add4 with plain adds (Hopper)"]
    text = _planted(module, good, bad)
    monkeypatch.setattr(cuda_mod, "source", lambda m: text if m == module else source(m))
    monkeypatch.setattr(fake_cupy, "ARCH", 0)
    got, want = _run(_device(), what), _run(ReferenceDevice(), what)
    assert np.max(np.abs(got - want)) <= 1e-4 * np.abs(want).max()


def test_gpu_check_says_in_one_line_when_compute_sanitizer_is_absent(tmp_path):
    import shutil
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    if shutil.which("compute-sanitizer") or list(Path("/usr/local").glob("cuda*/bin/compute-sanitizer")):
        pytest.skip("compute-sanitizer is installed here: the script would run the GPU checks under it")
    out = tmp_path / "s.json"
    r = subprocess.run(["bash", str(root / "benchmarks/gpu_sanitize.sh"), "python3", str(out)], cwd=root,
                       capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 0 and r.stderr == ""
    assert r.stdout.splitlines() == ["gpu-check: compute-sanitizer is not installed: the kernels ran without "
                                     "racecheck, synccheck and memcheck"]
    import json
    assert json.loads(out.read_text()) == {"sanitizer": None, "why": "compute-sanitizer not installed"}
