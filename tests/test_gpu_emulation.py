"""The CPU emulation itself (tests/cuda_emu) and what it catches: warp operations, barriers, races, divergence,
out-of-bounds writes, and faults planted in the real kernels (each must fail the comparison the kernel tests make).
Also benchmarks/gpu_check.py: a clean one-line exit without a GPU, and its correctness section on the emulation.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from cuda_emu import emu, fake_cupy

from pinfer_llm.runtime.gpu import CudaDevice, ReferenceDevice
from pinfer_llm.runtime.gpu import cuda as cuda_mod
from pinfer_llm.runtime.gpu import layout as L
from pinfer_llm.runtime.gpu.sources import source

ROOT = Path(__file__).resolve().parents[1]

PROBE = r"""
extern "C" __global__ void probe(const float* __restrict__ x, float* __restrict__ out, unsigned* __restrict__ bal,
                                 int* __restrict__ total) {
  __shared__ float s[64];
  const int t = threadIdx.x, lane = t & 31;
  const float v = x[blockIdx.x * blockDim.x + t];
  float* o = out + (blockIdx.x * blockDim.x + t) * 6;
  o[0] = __shfl_xor_sync(0xffffffffu, v, 5);
  o[1] = __shfl_down_sync(0xffffffffu, v, 3);
  o[2] = __shfl_up_sync(0xffffffffu, v, 2);
  o[3] = __shfl_sync(0xffffffffu, v, 7);
  o[4] = __shfl_xor_sync(0xffffffffu, v, 1, 4);
  s[t] = v;
  __syncthreads();
  o[5] = s[(t + 32) % blockDim.x];
  const unsigned b = __ballot_sync(0xffffffffu, v > 0.f);
  if (lane == 0) bal[blockIdx.x * 2 + (t >> 5)] = b;
  atomicAdd(total, 1);
}
extern "C" __global__ void diverge(float* out) {
  float v = threadIdx.x;
  if (threadIdx.x < 16) v += __shfl_xor_sync(0xffffffffu, v, 1);
  out[threadIdx.x] = v;
}
extern "C" __global__ void racy(float* out) {
  __shared__ float s[64];
  s[threadIdx.x] = threadIdx.x;
  out[blockIdx.x * 64 + threadIdx.x] = s[(threadIdx.x + 32) % 64];  // no __syncthreads
}
extern "C" __global__ void overrun(float* out, int n) { out[threadIdx.x] = 1.f; (void)n; }
"""


@pytest.fixture(scope="module")
def probe():
    return emu.build(PROBE)


def test_warp_operations_and_barriers(probe):
    rng = np.random.default_rng(0)
    x = fake_cupy.asarray(rng.standard_normal(3 * 64).astype(np.float32))
    out, bal, total = fake_cupy.zeros((3 * 64, 6)), fake_cupy.zeros((6,), np.uint32), fake_cupy.zeros((1,), np.int32)
    probe.get_function("probe")((3,), (64,), (x, out, bal, total))
    xv = np.asarray(x).reshape(3, 2, 32)
    lane = np.arange(32)
    want = np.empty((3, 2, 32, 6), np.float32)
    want[..., 0] = xv[..., lane ^ 5]
    want[..., 1] = xv[..., np.where(lane + 3 < 32, lane + 3, lane)]
    want[..., 2] = xv[..., np.where(lane >= 2, lane - 2, lane)]
    want[..., 3] = xv[..., [7] * 32]
    want[..., 4] = xv[..., lane ^ 1]
    want[..., 5] = xv[:, ::-1]  # the other warp's value of the same lane, through shared memory
    np.testing.assert_array_equal(np.asarray(out).reshape(3, 2, 32, 6), want)
    bits = (xv > 0).astype(np.uint64) << lane.astype(np.uint64)
    np.testing.assert_array_equal(np.asarray(bal).reshape(3, 2), bits.sum(-1))
    assert int(total[0]) == 3 * 64


def test_divergent_warp_operation_is_reported(probe):
    with pytest.raises(emu.EmuError, match="deadlock"):
        probe.get_function("diverge")((1,), (32,), (fake_cupy.zeros((32,)),))


def test_missing_barrier_shows(probe):
    """Without __syncthreads a thread reads its neighbour's slot with no barrier after the write: the race detector
    reports it in every launch, whatever order the fibers ran in."""
    for _ in range(3):
        with pytest.raises(emu.EmuError, match=r"racy: data race on shared memory \((read after write|write after "
                                               r"read)\).*no (__syncthreads|barrier) between"):
            probe.get_function("racy")((8,), (64,), (fake_cupy.zeros((8 * 64,)),))


def test_out_of_bounds_write_is_caught(probe):
    with pytest.raises(AssertionError, match="guard bytes"):
        fake_cupy.RawModule(PROBE, options=("--std=c++17",)).get_function("overrun")(
            (1,), (64,), (fake_cupy.zeros((60,)), np.int32(60)))  # 16 bytes past the end: inside the guard


# ------------------------------------------------------------------ planted faults

def _check_matmul(dev, ref):
    rng = np.random.default_rng(1)
    raw = L.random_rows(rng, L.Q4_0, 9, 1056)  # one tile and a tail
    x = rng.standard_normal((1, 1056)).astype(np.float32)
    got = dev.to_numpy(dev.matmul(dev.upload_matrix(raw, L.Q4_0, 1056), dev.asarray(x)))
    want = ref.to_numpy(ref.matmul(ref.upload_matrix(raw, L.Q4_0, 1056), ref.asarray(x)))
    return np.max(np.abs(got - want) / (np.abs(x) @ np.abs(L.dequantize(raw, L.Q4_0, 1056)).T))


def _check_ffn(dev, ref):
    rng = np.random.default_rng(2)
    d, n_ff = 2048 + 96, 64
    gate, up, down = (L.random_rows(rng, L.F16, n_ff, d, 0.3) for _ in range(3))
    x = rng.standard_normal((2, d)).astype(np.float32)
    outs = []
    for D in (dev, ref):
        f = D.upload_ffn(up, down, L.F16, d, np.arange(n_ff), act="relu", gate=gate)
        for _ in range(3):  # races show in some launches
            outs.append(D.to_numpy(D.ffn(f, D.asarray(x))))
    want = outs[-1]
    return max(np.max(np.abs(o - want)) for o in outs[:3]) / np.abs(want).max()


def _check_attention(dev, ref):
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 8, 64)).astype(np.float32)
    k, v = (rng.standard_normal((1, 2, 64)).astype(np.float32) for _ in range(2))
    ck, cv = (rng.standard_normal((2, 64, 64)).astype(np.float16) for _ in range(2))
    outs = [D.to_numpy(D.attention(D.asarray(q), D.asarray(k), D.asarray(v), D.asarray(ck), D.asarray(cv), 40))
            for D in (dev, ref)]
    return np.max(np.abs(outs[0] - outs[1])) / np.abs(outs[1]).max()


FAULTS = {  # name: (module, file the text is in, correct text, planted text, check)
    "q4 high nibble shifted by 3": (
        "gemv", "quant.cuh", "((w >> 4) & 0x0F0F0F0Fu), 8388616.f)", "((w >> 3) & 0x0F0F0F0Fu), 8388616.f)",
        _check_matmul),
    "tail block of the last lane dropped": (
        "gemv", "quant.cuh", "(ntile - u0) % ustep == 0 && lane < ntail)",
        "(ntile - u0) % ustep == 0 && lane < ntail - 1)", _check_matmul),
    "shuffle reduction skipped by one lane (divergence)": (
        "gemv", "quant.cuh", "      if (t < T)\n#pragma unroll\n        for (int o = 16;",
        "      if (t < T && lane != 3)\n#pragma unroll\n        for (int o = 16;", _check_matmul),
    "GQA maps query head h to kv head h % n_kv": (
        "attention", "attention.cu", "const int kvh = h / (n_head / n_kv);", "const int kvh = h % n_kv;",
        _check_attention),
    "no barrier between the steps of sparse_down's reduction tree": (
        "sparse_ffn", "sparse_ffn.cu", "      }\n      __syncthreads();\n      if (wib < half) {",
        "      }\n      if (wib < half) {", _check_ffn),
    "tail partial sums written without the bank padding": (
        "sparse_ffn", "sparse_ffn.cu", "[wslot][t][is_tail ? 36 * lane + 4 * q : 128 * q + 4 * lane]",
        "[wslot][t][is_tail ? 32 * lane + 4 * q : 128 * q + 4 * lane]", _check_ffn),
}


@pytest.fixture(scope="module")
def ref():
    return ReferenceDevice()


@pytest.fixture(scope="module")
def planted():
    """The planted sources, built in parallel; each fault's text must still be found in the real source."""
    texts = {}
    for name, (module, _, good, bad, _) in FAULTS.items():
        text = source(module)
        assert text.count(good) == 1, f"planted fault '{name}': its correct text is no longer in {module}"
        texts[name] = text.replace(good, bad)
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(emu.build, [source(m) for m in ("gemv", "attention", "sparse_ffn")] + list(texts.values())))
    return texts


def test_unplanted_sources_pass_the_checks(ref, planted):
    dev = CudaDevice(cupy=fake_cupy)
    for name, (*_, check) in FAULTS.items():
        assert check(dev, ref) < 1e-5, name


@pytest.mark.parametrize("name", list(FAULTS))
def test_planted_fault_is_caught(ref, planted, monkeypatch, name):
    module, *_, check = FAULTS[name]
    monkeypatch.setattr(cuda_mod, "source", lambda m: planted[name] if m == module else source(m))
    dev = CudaDevice(cupy=fake_cupy)
    try:
        err = check(dev, ref)
    except emu.EmuError as e:  # divergence or a race: the emulation reports it instead of a number
        assert "deadlock" in str(e) or "data race" in str(e), str(e)
        return
    assert err > 1e-3, f"planted fault '{name}' went unnoticed (error {err})"


# ------------------------------------------------------------------ benchmarks/gpu_check.py

def test_gpu_check_without_gpu_exits_with_one_line(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    code = ("import builtins, runpy, sys\n"
            "real = builtins.__import__\n"
            "def imp(name, *a, **k):\n"
            "    if name == 'cupy' or name.startswith('cupy.'): raise ImportError(\"No module named 'cupy'\")\n"
            "    return real(name, *a, **k)\n"
            "builtins.__import__ = imp\n"
            f"sys.argv = ['gpu_check.py', '-o', {str(tmp_path / 'r.json')!r}]\n"
            f"runpy.run_path({str(ROOT / 'benchmarks/gpu_check.py')!r}, run_name='__main__')\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert p.returncode == 2, p.stderr
    assert p.stdout == ""
    assert p.stderr.count("\n") == 1 and p.stderr.startswith("gpu_check: no GPU to check: CuPy is not installed")
    assert not (tmp_path / "r.json").exists()


@pytest.mark.slow
def test_gpu_check_correctness_section_on_the_emulation(ref):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    out: list = []
    gpu_check.run_checks(CudaDevice(cupy=fake_cupy), ref, out, replace(gpu_check.SIZES["quick"], n_ff=96))
    failed = [c for c in out if not c["pass"]]
    assert len(out) > 60 and not failed, failed


@pytest.mark.slow
def test_gpu_check_benchmark_section_runs_on_the_emulation(monkeypatch):
    """gpu_check's timed section end to end on the CPU emulation with a stub clock (no CUDA graphs here): a GPU
    session's few minutes must not be lost to an error in the benchmark's own code. The figures mean nothing."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))

    class Clock:  # each timed call once
        def time(self, fn, reps):
            return (fn(0), 1e-5)[1]

        def same_size_copy(self, nbytes):
            return 1.0

        def free(self):
            pass

    out: list = []
    gpu_check.run_bench(CudaDevice(cupy=fake_cupy), Clock(), out, 1000.0, replace(gpu_check.SIZES["quick"], n_ff=160))
    kernels = {o["kernel"] for o in out}
    assert {"sparse_up", "sparse_down", "gemv", "predict", "attention"} <= kernels, kernels
    assert not [o for o in out if "error" in o]


@pytest.mark.slow
def test_gpu_e2e_runs_on_the_reference_device(tmp_path, monkeypatch):
    """make gpu-check's end-to-end script on the CPU stand-in, a tiny planted model: every placement runs, decodes
    the CPU path's tokens, and reports its device-side split from the timed extra decode."""
    import json

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_e2e
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    monkeypatch.setenv("PINFER_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "e2e.json"
    gpu_e2e.main(["--gpu", "reference", "--shape", "tiny", "--type", "f32", "--model", str(tmp_path / "tiny.gguf"),
                  "--rounds", "1", "--tokens", "4", "--timed-tokens", "3", "--placements", "plan,layers",
                  "--threads", "1", "--out", str(out)])
    runs = {k: r for k, r in json.loads(out.read_text())["runs"].items() if r["gpu"] == "reference"}
    assert set(runs) == {"plan", "layers"} and not [r for r in runs.values() if r.get("error")]
    assert all(r["tokens_equal_cpu_path"] for r in runs.values())
    assert {"gpu_compute_ms", "gpu_copy_ms"} <= set(runs["layers"]["timed"])
