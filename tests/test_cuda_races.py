"""The CPU emulation's race detector (tests/cuda_emu/cuda_emu.h) against what a GPU does to racy kernels.

Each plant breaks the live kernel source by text substitution (the text must still be found exactly once, so a
moved source fails here rather than silently testing nothing) and runs it through CudaDevice on the emulation. Run
blocks one after another, none of these changes a result: a GPU runs the blocks at once and interleaves the warps, so
only a check of every access sees them. The unplanted kernels run clean on the same inputs, on the generic and on
Hopper's branch. sparse_down's old busy-flag race lives in a fixture (tests/cuda_emu/racy_sparse_down.cu), the
original kept verbatim, so that it stays tested however the live kernel is rewritten.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from cuda_emu import emu, fake_cupy

from pinfer_llm.runtime.gpu import CudaDevice, ReferenceDevice
from pinfer_llm.runtime.gpu import cuda as cuda_mod
from pinfer_llm.runtime.gpu import layout as L
from pinfer_llm.runtime.gpu.sources import source

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
    # rms_norm calls block_sum once and never reuses buf: the other warps exit cleanly and warp 0 waits for them
    "a barrier only warp 0 reaches in block_sum": (
        "norm", BLOCK_SUM_TAIL, BLOCK_SUM_TAIL.replace("  __syncthreads();", "  if (w == 0) __syncthreads();"),
        "rms_norm", r"deadlock in block \(\d+,0,0\): 32 threads wait at __syncthreads, 0 at a warp operation, "
        r"\d+ exited"),
}
def _planted(module: str, good: str, bad: str) -> str:
    text = source(module)
    assert text.count(good) == 1, f"the plant's correct text is no longer in {module} (exactly once)"
    return text.replace(good, bad)


def _run(dev, what: str):
    """The kernels a plant sits in, on inputs where several blocks meet (outputs, for the clean runs' check)."""
    rng = np.random.default_rng(7)
    if what == "ffn":
        d, n_ff = 1024 + 64, 1024  # one tile and a tail; 4 blocks add into every unit (down_splits below)
        up, down = (L.random_rows(rng, L.F16, n_ff, d, 0.3) for _ in range(2))
        x = rng.standard_normal((2, d)).astype(np.float32)
        f = dev.upload_ffn(up, down, L.F16, d, np.arange(n_ff), act="relu_up")  # OPT-style: up, ReLU, down
        return dev.to_numpy(dev.ffn(f, dev.asarray(x)))
    x = rng.standard_normal((3, 1000)).astype(np.float32)
    w, b = (rng.standard_normal(1000).astype(np.float32) for _ in range(2))
    if what == "rms_norm":
        return dev.to_numpy(dev.rms_norm(dev.asarray(x), dev.asarray(w), 1e-5))
    return dev.to_numpy(dev.layer_norm(dev.asarray(x), dev.asarray(w), dev.asarray(b), 1e-5))


def _device():
    dev = CudaDevice(cupy=fake_cupy)
    dev.down_splits = 4  # 4 blocks add into every output unit, so a plain add loses updates
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
@pytest.mark.parametrize("what", ["ffn", "layer_norm", "rms_norm"])
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


# sparse_down's busy flag, as it was (tests/cuda_emu/racy_sparse_down.cu: a fixture, since the live kernel is being
# rewritten), and the fix that went into the live kernel, applied to the same text.
RACY_DOWN = Path(emu.__file__).with_name("racy_sparse_down.cu")
BUSY_FIX = (("  __shared__ int busy;\n", ""), ("    if (threadIdx.x == 0) busy = 0;\n", ""),
            ("    if (worked && lane == 0) busy = 1;\n    __syncthreads();\n    if (!busy) continue;",
             "    if (!__syncthreads_or(worked)) continue;"))
DOWN_D, DOWN_K, DOWN_RPW = 1024 + 64, 512, 32  # a tile and a tail; 2 blocks of 8 warps x 32 rows per unit


def _down_h(case: str) -> np.ndarray:
    """h [T, k]. "every row": one token, every warp has work, so warps 1-7 set the flag beside thread 0's reset.
    "warp 0 only, after idle tokens": tokens 0-1 activate nothing (the block takes the `continue`), tokens 2-3 only
    rows of each block's warp 0, so only thread 0 ever writes the flag: what races is the skipped barrier alone."""
    rng = np.random.default_rng(3)
    if case == "every row":
        return rng.standard_normal((1, DOWN_K)).astype(np.float32)
    h = np.zeros((4, DOWN_K), np.float32)
    for blk in range(DOWN_K // (8 * DOWN_RPW)):
        r0 = blk * 8 * DOWN_RPW
        h[2:, r0:r0 + DOWN_RPW] = rng.standard_normal((2, DOWN_RPW))
    return h


def _run_down(text: str, h: np.ndarray):
    rng = np.random.default_rng(5)
    raw = L.random_rows(rng, L.F16, DOWN_K, DOWN_D)
    w = np.ascontiguousarray(L.to_device(raw, L.F16, DOWN_D))
    y = np.zeros((h.shape[0], DOWN_D), np.float32)
    units = -(-DOWN_D // 1024)
    kernel = emu.build(text).get_function(f"sparse_down_f16_t{1 if h.shape[0] == 1 else 2}")
    kernel((units, DOWN_K // (8 * DOWN_RPW)), (256,),
           (w, np.int64(w.shape[1]), np.int32(DOWN_D), h, np.int32(DOWN_K), np.int32(h.shape[0]), y,
            np.int32(DOWN_RPW)))
    return y, h.astype(np.float64) @ L.dequantize(raw, L.F16, DOWN_D).astype(np.float64)


@pytest.mark.parametrize("case, says", [
    ("every row", r"data race on shared memory \(write after write\): thread \d+ of block .* and thread \d+ of "
                  r"block .* with no __syncthreads between"),
    ("warp 0 only, after idle tokens", r"data race on shared memory \((write after read|read after write)\)"),
])
def test_the_original_busy_flag_race_is_caught(case, says):
    """Run one block after another, this kernel's results are right (see the fixed run below): only the detector
    sees that a GPU would drop a block's sums."""
    with pytest.raises(emu.EmuError, match=says):
        _run_down(RACY_DOWN.read_text(), _down_h(case))


@pytest.mark.parametrize("case", ["every row", "warp 0 only, after idle tokens"])
def test_the_busy_flag_fix_is_clean_and_right(case):
    text = RACY_DOWN.read_text()
    for racy, fixed in BUSY_FIX:
        assert text.count(racy) == 1, f"the fixture no longer holds {racy!r} exactly once"
        text = text.replace(racy, fixed)
    got, want = _run_down(text, _down_h(case))
    assert np.max(np.abs(got - want)) <= 1e-4 * np.abs(want).max()


@pytest.mark.parametrize("arch", [0, 900])
def test_live_sparse_down_is_clean_when_a_block_skips_tokens(monkeypatch, arch):
    """The live kernel on the input that made the old flag's skipped barrier race: four tokens (two token groups of
    the 2-token kernel), the first two activating no row."""
    monkeypatch.setattr(fake_cupy, "ARCH", arch)
    h = _down_h("warp 0 only, after idle tokens")
    rng = np.random.default_rng(5)
    up, down = (L.random_rows(rng, L.F16, DOWN_K, DOWN_D) for _ in range(2))
    out = []
    for dev in (_device(), ReferenceDevice()):
        f = dev.upload_ffn(up, down, L.F16, DOWN_D, np.arange(DOWN_K), act="relu_up")
        y = dev.asarray(np.zeros((h.shape[0], DOWN_D), np.float32))
        out.append(dev.to_numpy(dev.ffn_down(f, dev.asarray(h), y)))
    got, want = out
    assert np.abs(want[2:]).max() > 0 and np.all(want[:2] == 0)
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
