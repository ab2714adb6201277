"""Building and caching the C++ CPU kernels (runtime/cpu_kernels.py); their numbers are tested in test_sparse_ops."""

import os
import subprocess
import sys

import pytest
import torch

from runtime import cpu_kernels
from runtime import sparse_ops as S

pytestmark = pytest.mark.skipif(os.environ.get("PINFER_CPU_KERNELS") == "0", reason="PINFER_CPU_KERNELS=0")


def test_build_is_cached_and_complete():
    path = cpu_kernels.build()
    assert path.exists() and path.name.startswith("pinfer_cpu_")
    assert cpu_kernels.build() == path  # cached: same key, no rebuild
    assert not list(path.parent.glob("*.tmp"))  # no temporary left behind


def test_disabled_falls_back_to_torch(tmp_path):
    code = ("from runtime import cpu_kernels as K, sparse_ops as S; import torch;"
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("r,d,n_ff", [(128, 256, 700), (12, 37, 77), (3, 16, 5)])
def test_fused_predictor_equals_torch(r, d, n_ff, dtype):
    """Predictor.fused_indices (the C++ kernel over fc1/fc2 as stored) against the torch predictor: the same
    neurons, except ones whose score lies within rounding of the threshold."""
    from runtime.predictor import Predictor

    assert cpu_kernels.available(), cpu_kernels.status()
    gen = torch.Generator().manual_seed(r)
    fc1, fc2 = torch.randn(r, d, generator=gen).to(dtype), torch.randn(n_ff, r, generator=gen).to(dtype)
    pred = Predictor(fc1, fc2, threshold=0.5)
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
