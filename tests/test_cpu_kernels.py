"""Building and caching the C++ CPU kernels (runtime/cpu/kernels.py), with planted faults: a compiler that fails, one
that writes a bogus library, a smoke test that dies with SIGILL, a corrupt cached library, CPU flags that change, an
empty XDG_CACHE_HOME. Their numbers are tested in test_qkernels.py and test_sparse_ops.py."""

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pinfer_llm.runtime.cpu import kernels as cpu_kernels
from pinfer_llm.runtime.ffn import ops as S

pytestmark = pytest.mark.skipif(os.environ.get("PINFER_CPU_KERNELS") == "0", reason="PINFER_CPU_KERNELS=0")


def test_build_is_cached_and_complete():
    path = cpu_kernels.build()
    assert path.exists() and path.name.startswith("pinfer_cpu_")
    assert cpu_kernels.build() == path  # cached: same key, no rebuild
    # no build directory of this build left behind (another test run on the machine, sharing the cache, may be
    # building other sources: a clean clone's CI beside a checkout's tests)
    key = path.stem.removeprefix("pinfer_cpu_")
    assert not list(path.parent.glob(f"build_{key}_*"))
    assert cpu_kernels.status().startswith("pinfer C++ kernels (")


def fake_compiler(tmp_path: Path, version: str, fail: bool) -> tuple[Path, Path]:
    """A CXX that logs its arguments, then fails with a planted error or writes a bogus "library" to its -o path."""
    log = tmp_path / f"{version}.log"
    script = tmp_path / f"{version}.sh"
    action = ('echo "fakecc: error: planted failure" >&2; exit 1' if fail else
              'out=""; prev=""; for a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done; '
              'echo "not a library" > "$out"; exit 0')
    script.write_text(f'#!/bin/sh\necho "$@" >> "{log}"\n'
                      f'if [ "$1" = "--version" ]; then echo "{version} 1.0"; exit 0; fi\n{action}\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script, log


def compiles(log: Path) -> int:
    return sum(" -c " in line for line in log.read_text().splitlines()) if log.exists() else 0


def test_failed_build_is_remembered(monkeypatch, tmp_path):
    """A broken compiler fails once; the failure is kept under the build's key, so the next call (and every later
    process) falls back at once with the same error instead of compiling again."""
    cc, log = fake_compiler(tmp_path, "brokencc", fail=True)
    monkeypatch.setenv("CXX", str(cc))
    monkeypatch.setenv("PINFER_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(RuntimeError, match="planted failure"):
        cpu_kernels.build(spinner=False)
    n = compiles(log)
    assert n > 0
    markers = list((tmp_path / "cache" / "kernels").glob("*.failed"))
    assert len(markers) == 1 and "planted failure" in markers[0].read_text()
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="planted failure.*an earlier build"):
        cpu_kernels.build(spinner=False)
    assert compiles(log) == n and time.perf_counter() - t0 < 5  # not compiled again
    code = "from pinfer_llm.runtime.cpu import kernels as K; print(K.available(), K.status())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(os.environ, CXX=str(cc), PINFER_CACHE_DIR=str(tmp_path / "cache")))
    assert out.stdout.startswith("False torch kernels (") and "an earlier build" in out.stdout
    assert compiles(log) == n


def test_bogus_library_fails_the_smoke_test(monkeypatch, tmp_path):
    """A library that cannot load (here: a compiler that writes garbage) never reaches the cache: the smoke test in a
    subprocess rejects it and the failure is remembered."""
    cc, log = fake_compiler(tmp_path, "garbagecc", fail=False)
    monkeypatch.setenv("CXX", str(cc))
    monkeypatch.setenv("PINFER_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(RuntimeError, match="smoke test failed"):
        cpu_kernels.build(spinner=False)
    d = tmp_path / "cache" / "kernels"
    assert not list(d.glob("*.so")) and len(list(d.glob("*.failed"))) == 1
    with pytest.raises(RuntimeError, match="an earlier build"):
        cpu_kernels.build(spinner=False)


def test_smoke_test_crash_marks_the_build_bad(monkeypatch, tmp_path):
    """A library with instructions this CPU lacks dies with SIGILL when used: in the smoke test's subprocess, not in
    the caller (planted: the smoke command kills itself with SIGILL)."""
    cc, _ = fake_compiler(tmp_path, "sigillcc", fail=False)
    monkeypatch.setenv("CXX", str(cc))
    monkeypatch.setenv("PINFER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_kernels, "_smoke_cmd", lambda lib, ns: [
        sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGILL)"])
    with pytest.raises(RuntimeError, match=f"killed by signal {int(signal.SIGILL)}"):
        cpu_kernels.build(spinner=False)
    assert not list((tmp_path / "cache" / "kernels").glob("*.so"))


def test_corrupt_cached_library_falls_back(tmp_path):
    """A cached library that does not load (truncated, another machine's) means torch's kernels, not a crash."""
    env = dict(os.environ, PINFER_CACHE_DIR=str(tmp_path))
    key = subprocess.run([sys.executable, "-c", "from pinfer_llm.runtime.cpu import kernels as K; "
                          "print(K.cache_key(K.march()))"], capture_output=True, text=True, env=env,
                         check=True).stdout.strip()
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / f"pinfer_cpu_{key}.so").write_bytes(b"\x7fELF truncated")
    code = ("from pinfer_llm.runtime.cpu import kernels as K; from pinfer_llm.runtime.ffn import ops as S; "
            "import torch;"
            "w = S.pack_ffn(torch.randn(8, 4), torch.randn(8, 4), torch.randn(8, 4), down_transposed=True, act='relu');"
            "S.ffn_sparse(w, torch.randn(1, 4), torch.tensor([1, 2])); print(K.available(), K.status())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.startswith("False torch kernels (")


def test_cache_key_follows_cpu_flags_and_march(monkeypatch, tmp_path):
    """The key is the CPU's feature flags (not its model name: the same name can hide different ISAs, e.g. AVX-512
    disabled in a VM) and the -march value."""
    cpu = "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Same CPU\nflags\t\t: {flags}\n"
    keys = {}
    for name, flags in (("a", "fpu sse2 avx2 avx512f"), ("b", "fpu sse2 avx2"), ("c", "fpu sse2 avx2 avx512f")):
        f = tmp_path / name
        f.write_text(cpu.format(flags=flags).replace("Same CPU", "Other name" if name == "c" else "Same CPU"))
        monkeypatch.setattr(cpu_kernels, "CPUINFO", str(f))
        assert cpu_kernels.cpu_flags().endswith(flags)
        keys[name] = cpu_kernels.cache_key("native")
    assert keys["a"] != keys["b"]  # same model name, different flags: different libraries
    assert keys["a"] == keys["c"]  # same flags under another name: the same library
    assert cpu_kernels.cache_key("x86-64-v3") != cpu_kernels.cache_key("native")
    assert cpu_kernels.cache_key("native", "pinfer_other") != cpu_kernels.cache_key("native")


def test_cache_dir(monkeypatch, tmp_path):
    """$PINFER_CACHE_DIR, else an absolute $XDG_CACHE_HOME, else ~/.cache: an empty or relative XDG_CACHE_HOME never
    puts the cache in the current directory."""
    monkeypatch.delenv("PINFER_CACHE_DIR", raising=False)
    home = Path.home() / ".cache" / "pinfer" / "kernels"
    for xdg in ("", "relative/dir"):
        monkeypatch.setenv("XDG_CACHE_HOME", xdg)
        assert cpu_kernels.cache_dir() == home
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cpu_kernels.cache_dir() == home
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cpu_kernels.cache_dir() == tmp_path / "pinfer" / "kernels"
    monkeypatch.setenv("PINFER_CACHE_DIR", str(tmp_path / "p"))
    assert cpu_kernels.cache_dir() == tmp_path / "p" / "kernels"


def test_disabled_falls_back_to_torch(tmp_path):
    code = ("from pinfer_llm.runtime.cpu import kernels as K; from pinfer_llm.runtime.ffn import ops as S; "
            "import torch;"
            "w = S.pack_ffn(torch.randn(8, 4), torch.randn(8, 4), torch.randn(8, 4), down_transposed=True, act='relu');"
            "S.ffn_sparse(w, torch.randn(1, 4), torch.tensor([1, 2]));"
            "print(K.available(), K.status())")
    env = dict(os.environ, PINFER_CPU_KERNELS="0")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.startswith("False torch kernels (disabled by PINFER_CPU_KERNELS=0)")


def test_missing_compiler_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", "no-such-compiler-pinfer")
    monkeypatch.setenv("PINFER_CACHE_DIR", str(tmp_path))
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        cpu_kernels.build()


def test_kernel_rejects_out_of_range_indices():
    w = S.pack_ffn(torch.randn(8, 4), torch.randn(8, 4), torch.randn(8, 4), down_transposed=True, act="relu")
    assert cpu_kernels.available(), cpu_kernels.status()
    with pytest.raises(RuntimeError, match="out of range"):
        S.ffn_sparse(w, torch.randn(1, 4), torch.tensor([0, 8]))
    with pytest.raises(RuntimeError, match="out of range"):
        S.ffn_sparse(w, torch.randn(1, 4), torch.tensor([-1]))


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("r,d,n_ff", [(128, 256, 700), (12, 37, 77), (3, 16, 5)])
def test_fused_predictor_equals_torch(r, d, n_ff, dtype, transposed):
    """Predictor.fused_indices (the C++ kernel over fc1 and fc2 as stored, or over fc2_t: the live hidden units'
    rows) against the torch predictor: the same neurons, except ones whose score lies within rounding of the
    threshold."""
    from pinfer_llm.runtime.ffn.predictor import Predictor

    assert cpu_kernels.available(), cpu_kernels.status()
    gen = torch.Generator().manual_seed(r)
    fc1, fc2 = torch.randn(r, d, generator=gen).to(dtype), torch.randn(n_ff, r, generator=gen).to(dtype)
    pred = Predictor(fc1, fc2, threshold=0.5, fc2_t=fc2.t().contiguous() if transposed else None)
    always = torch.tensor([0, n_ff - 1])
    for _ in range(5):
        x = torch.randn(1, d, generator=gen)
        idx_fused = pred.fused_indices(x, always)
        assert torch.all(idx_fused[1:] > idx_fused[:-1])  # ascending, no duplicates
        got = torch.zeros(n_ff, dtype=torch.bool)
        got[idx_fused] = True
        want = pred.mask(x)[0]
        want[always] = True
        scores = pred.scores(x)[0]
        near = (scores - 0.5).abs() <= 1e-4 * scores.abs().max()
        assert torch.equal(got[~near], want[~near])
        assert got[always].all()


@pytest.mark.parametrize("H,Hkv", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("pos", [0, 16, 299])
def test_attend_decode_equals_float64_reference(H, Hkv, pos):
    """One token's RoPE + cache write + attention against a float64 softmax over the same cache; scores spread over a
    wide range so that the vectorised exp sees large negative arguments (and the clamp at -87)."""
    assert cpu_kernels.available(), cpu_kernels.status()
    gen = torch.Generator().manual_seed(pos * 7 + H)
    D, ctx = 32, 320
    k_cache, v_cache = torch.randn(Hkv, ctx, D, generator=gen) * 3, torch.randn(Hkv, ctx, D, generator=gen)
    qkv = torch.randn(1, (H + 2 * Hkv) * D, generator=gen) * 3
    ang = torch.rand(D // 2, generator=gen) * 6
    rope = torch.stack([ang.cos(), ang.sin()], -1).contiguous()
    k_ref, v_ref = k_cache.clone().double(), v_cache.clone().double()
    out = torch.ops.pinfer.attend_decode(qkv, rope, k_cache, v_cache, pos, H, Hkv, 0.5)

    def rot(v):  # adjacent pairs (2i, 2i+1) rotated by (cos, sin)
        a, b = v.double().view(-1, D // 2, 2).unbind(-1)
        c, s = rope.double().unbind(-1)
        return torch.stack([a * c - b * s, a * s + b * c], -1).view(-1, D)

    q = rot(qkv[0, :H * D])
    k_ref[:, pos] = rot(qkv[0, H * D:(H + Hkv) * D])
    v_ref[:, pos] = qkv[0, (H + Hkv) * D:].double().view(Hkv, D)
    torch.testing.assert_close(k_cache[:, pos].double(), k_ref[:, pos], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v_cache[:, pos].double(), v_ref[:, pos])
    want = []
    for h in range(H):
        g = h // (H // Hkv)
        p = torch.softmax(k_ref[g, :pos + 1] @ q[h] * 0.5, -1)
        want.append(p @ v_ref[g, :pos + 1])
    torch.testing.assert_close(out.double().view(H, D), torch.stack(want), rtol=1e-4, atol=1e-5)


class _Mapped:
    """What guard_map reads of a GGUFFile: its map and path."""

    def __init__(self, n: int):
        import numpy as np

        self.mm, self.path = np.zeros(n, np.uint8), f"/m{n}.gguf"


def test_guard_map_frees_its_slot_when_the_file_goes():
    """The SIGBUS guard has 64 slots: a file collected frees its own (a test run or a server loads hundreds of files
    one after another), and a 65th file mapped at once stays unguarded rather than failing its load."""
    if not cpu_kernels.available():
        pytest.skip(cpu_kernels.status())
    for i in range(200):  # one at a time: each is collected before the next
        assert cpu_kernels.guard_map(_Mapped(4096 + i))
    held = [_Mapped(4096 + i) for i in range(64)]
    ok = [cpu_kernels.guard_map(f) for f in held]
    assert sum(ok) >= 32 and not all(ok + [cpu_kernels.guard_map(_Mapped(99))])  # other tests may hold a few
    del held, ok
    assert cpu_kernels.guard_map(_Mapped(123))
