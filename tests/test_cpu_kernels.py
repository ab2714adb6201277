"""Building and caching the C++ CPU kernels (runtime/cpu_kernels.py); their numbers are tested in test_sparse_ffn."""

import os
import subprocess
import sys

import pytest
import torch

from runtime import cpu_kernels
from runtime import sparse_ffn as S

pytestmark = pytest.mark.skipif(os.environ.get("PINFER_CPU_KERNELS") == "0", reason="PINFER_CPU_KERNELS=0")


def test_build_is_cached_and_complete():
    path = cpu_kernels.build()
    assert path.exists() and path.parent == cpu_kernels.cache_dir()
    assert cpu_kernels.build() == path  # cached: same key, no rebuild
    assert not list(path.parent.glob("*.tmp"))  # no temporary left behind


def test_disabled_falls_back_to_torch(tmp_path):
    code = ("from runtime import cpu_kernels as K, sparse_ffn as S; import torch;"
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


@pytest.mark.parametrize("r,d,n_ff", [(128, 256, 700), (12, 37, 77), (3, 16, 5)])
def test_fused_predictor_equals_torch(r, d, n_ff):
    """predict_active (fc2 stored transposed, axpy over the live hidden units) against the torch predictor: the same
    neurons, except ones whose score lies within rounding of the threshold."""
    from runtime.predictor import Predictor

    assert cpu_kernels.available(), cpu_kernels.status()
    gen = torch.Generator().manual_seed(r)
    fc1, fc2 = torch.randn(r, d, generator=gen), torch.randn(n_ff, r, generator=gen)
    fused = Predictor(fc1, fc2.t().contiguous().t(), threshold=0.5)
    plain = Predictor(fc1, fc2.contiguous(), threshold=0.5)
    always = torch.tensor([0, n_ff - 1])
    for _ in range(5):
        x = torch.randn(1, d, generator=gen)
        got = torch.zeros(n_ff, dtype=torch.bool)
        got[fused.indices(x, always)] = True
        idx = plain.indices(x, always)
        assert torch.all(idx[1:] > idx[:-1])  # ascending, no duplicates
        want = torch.zeros(n_ff, dtype=torch.bool)
        want[idx] = True
        scores = plain.scores(x)[0]
        near = (scores - 0.5).abs() <= 1e-4 * scores.abs().max()
        assert torch.equal(got[~near], want[~near])
        assert got[always].all()
        idx_fused = fused.indices(x, always)
        assert torch.all(idx_fused[1:] > idx_fused[:-1])
