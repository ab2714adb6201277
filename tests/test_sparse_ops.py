"""Sparse FFN operators: exactness against an independent dense reference, every variant and path (no timing)."""

import os

import pytest
import torch
import torch.nn.functional as F
from gguf.constants import GGMLQuantizationType as T

from pinfer_llm.formats.errors import PinferError
from pinfer_llm.runtime.cpu import kernels as cpu_kernels
from pinfer_llm.runtime.ffn import ops as S

N_FF, D = 320, 96


def reference(gate, up, down_t, x, act, keep=None):
    """The FFN from the raw matrices, with neurons outside `keep` zeroed; computed in float64."""
    g, u = x.double() @ gate.double().T, x.double() @ up.double().T
    h = {"silu": F.silu(g) * u, "relu": F.relu(g) * u, "drelu": F.relu(g) * F.relu(u)}[act]
    if keep is not None:
        mask = torch.zeros(gate.shape[0], dtype=torch.float64)
        mask[keep] = 1
        h = h * mask
    return h @ down_t.double()


def exact_mask(gate, up, x, act):
    g, u = x @ gate.T, x @ up.T
    return (g > 0) if act == "relu" else (g > 0) & (u > 0)


@pytest.fixture(autouse=True, params=["kernel", "torch"])
def path(request, monkeypatch):
    """Every test runs twice: through the C++ kernel (pi-run's path for fp32 and few tokens) and through torch's own
    kernels (the fallback without a compiler). The kernel must build here unless PINFER_CPU_KERNELS=0 says not to."""
    if request.param == "torch":
        monkeypatch.setattr(S, "KERNEL_MAX_T", 0)
    elif os.environ.get("PINFER_CPU_KERNELS") == "0":
        pytest.skip("PINFER_CPU_KERNELS=0")
    else:
        assert cpu_kernels.available(), cpu_kernels.status()
    return request.param


@pytest.fixture(scope="module")
def mats():
    gen = torch.Generator().manual_seed(0)
    gate, up, down_t = (torch.randn(N_FF, D, generator=gen) * D ** -0.5 for _ in range(3))
    gate[:, 0] = -1.0  # with inputs(): gate pre-activations ~ N(-2, 1), so ReLU masks are sparse like a real model's
    return gate, up, down_t


def inputs(T: int, seed: int = 0) -> torch.Tensor:
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(seed))
    x[:, 0] = 2.0
    return x


def close(a, b, tol=2e-5):
    err = (a.double() - b).abs().max().item()
    scale = b.abs().max().item()
    assert err <= tol * scale, f"max error {err:.3g} vs scale {scale:.3g}"


@pytest.mark.parametrize("act", S.ACTIVATIONS)
@pytest.mark.parametrize("down_transposed", [True, False])
def test_dense_matches_reference(mats, act, down_transposed):
    gate, up, down_t = mats
    w = S.pack_ffn(gate, up, down_t if down_transposed else down_t.T.contiguous(), down_transposed=down_transposed,
                   act=act)
    x = inputs(5)
    close(S.ffn_dense(w, x), reference(gate, up, down_t, x, act))
    assert torch.equal(w.gate, gate) and torch.equal(w.up, up) and torch.equal(w.down_t, down_t)


@pytest.mark.parametrize("act", ["relu", "drelu"])
@pytest.mark.parametrize("T", [1, 2, 3, S.GATHER_MIN_T, 9])
def test_relu_exact_mask_equals_dense(mats, act, T):
    gate, up, down_t = mats
    w = S.pack_ffn(gate, up, down_t, down_transposed=True, act=act)
    x = inputs(T)
    idx = S.union_indices(exact_mask(gate, up, x, act))
    assert 0 < idx.numel() < N_FF // 2  # a real subset, or the test would not test sparsity
    out = S.ffn_sparse(w, x, idx)
    close(out, reference(gate, up, down_t, x, act))
    close(out, S.ffn_dense(w, x).double())


@pytest.mark.parametrize("T", [1, 2, S.GATHER_MIN_T, 7])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_silu_any_index_set(mats, T, threads):
    gate, up, down_t = mats
    w = S.pack_ffn(gate, up, down_t, down_transposed=True, act="silu")
    x = inputs(T)
    idx = torch.randperm(N_FF, generator=torch.Generator().manual_seed(T))[:77]  # unsorted on purpose
    close(S.ffn_sparse(w, x, idx, threads=threads), reference(gate, up, down_t, x, "silu", keep=idx))
    close(S.ffn_dense(w, x, keep=idx), reference(gate, up, down_t, x, "silu", keep=idx))


def test_sparse_neurons_outside_idx_do_not_contribute(mats):
    gate, up, down_t = mats
    w = S.pack_ffn(gate, up, down_t, down_transposed=True, act="silu")
    x = inputs(1)
    idx = torch.arange(0, N_FF, 3)
    full = reference(gate, up, down_t, x, "silu")
    out = S.ffn_sparse(w, x, idx)
    assert (out.double() - full).abs().max() > 1e-3  # SwiGLU: dropping neurons changes the output
    close(out, reference(gate, up, down_t, x, "silu", keep=idx))


def test_empty_and_single_index(mats):
    gate, up, down_t = mats
    w = S.pack_ffn(gate, up, down_t, down_transposed=True, act="relu")
    x = inputs(2)
    assert torch.equal(S.ffn_sparse(w, x, torch.zeros(0, dtype=torch.long)), torch.zeros(2, D))
    one = torch.tensor([5])
    close(S.ffn_sparse(w, x[:1], one), reference(gate, up, down_t, x[:1], "relu", keep=one))


@pytest.mark.parametrize("T", [1, 6])
def test_bfloat16_path(mats, T):
    gate, up, down_t = mats
    w = S.pack_ffn(gate, up, down_t, down_transposed=True, act="relu", dtype=torch.bfloat16)
    assert w.dtype == torch.bfloat16
    x = inputs(T)
    idx = S.union_indices(exact_mask(w.gate.float(), w.up.float(), x.bfloat16().float(), "relu"))
    ref = reference(w.gate.float(), w.up.float(), w.down_t.float(), x.bfloat16().float(), "relu")
    close(S.ffn_sparse(w, x.bfloat16(), idx).float(), ref, tol=3e-2)


@pytest.mark.parametrize("T,frac", [(1, 0.1), (1, 1.0), (64, 0.1), (64, 1.0)])
def test_auto_result_does_not_depend_on_the_choice(mats, monkeypatch, T, frac):
    gate, up, down_t = mats
    w = S.pack_ffn(gate, up, down_t, down_transposed=True, act="silu")
    x = inputs(T)
    idx = torch.arange(int(frac * N_FF))
    chose = []
    real = S.ffn_sparse
    monkeypatch.setattr(S, "ffn_sparse", lambda *a, **k: chose.append("sparse") or real(*a, **k))
    close(S.ffn_auto(w, x, idx), reference(gate, up, down_t, x, "silu", keep=idx))
    assert chose == (["sparse"] if frac < S.sparse_max_density(T) else [])


def test_rule_interpolates_between_measured_points(path):
    pts = dict(S.SPARSE_MAX_DENSITY if path == "kernel" else S.SPARSE_MAX_DENSITY_TORCH)
    for t, dens in pts.items():
        assert S.sparse_max_density(t) == pytest.approx(dens)
    assert 0 < S.sparse_max_density(10 ** 6) <= 1
    assert S.sparse_pays(1, 0, 100) and not S.sparse_pays(1, 100, 100)


def test_pack_rejects_bad_input(mats):
    gate, up, down_t = mats
    with pytest.raises(PinferError, match="shapes do not match"):
        S.pack_ffn(gate, up, down_t, down_transposed=False, act="relu")  # [n_ff, d] given as ffn_down
    with pytest.raises(PinferError, match="unknown FFN activation"):
        S.pack_ffn(gate, up, down_t, down_transposed=True, act="gelu")


def _mapping(addr: int) -> tuple[int, int, list[str]]:
    """(start, end, VmFlags) of the kernel's mapping holding `addr` (/proc/self/smaps)."""
    inside, lo, hi = False, 0, 0
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= addr < hi
            elif inside and line.startswith("VmFlags:"):
                return lo, hi, line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.mark.skipif(not hasattr(__import__("mmap"), "MADV_HUGEPAGE"), reason="no madvise(MADV_HUGEPAGE) here")
def test_large_layer_uses_huge_page_memory_and_stays_alive():
    """The fallback's float copies of a large layer live in a mapping advised for transparent huge pages (the kernel
    shows "hg" in its VmFlags), which stays alive as long as a view of it does."""
    n_ff, d = 1024, 1024  # 8 MiB of gate_up: above the huge-page threshold
    w = S.pack_ffn(torch.ones(n_ff, d), torch.ones(n_ff, d), torch.ones(n_ff, d), down_transposed=True, act="relu")
    assert "hg" in _mapping(w.gate_up.data_ptr())[2]
    assert not w.gate_up.untyped_storage().resizable()  # a buffer we mapped, not torch's allocator
    # Below the threshold: torch's own allocation. (Whether the heap shows "hg" depends on the machine's THP and
    # malloc settings, so it is told apart by its storage, which torch can resize and a mapped buffer cannot.)
    small = S.pack_ffn(torch.ones(8, 16), torch.ones(8, 16), torch.ones(8, 16), down_transposed=True, act="relu")
    assert small.gate_up.untyped_storage().resizable()
    view = w.gate_up[3]
    del w
    assert float(view.sum()) == 2 * d  # the view keeps the anonymous mapping alive


@pytest.mark.parametrize("T", [1, 2, 5, 40])
@pytest.mark.parametrize("act", S.ACTIVATIONS)
def test_masked_rows_use_their_own_masks(mats, T, act):
    gate, up, down_t = mats
    w = S.pack_ffn(gate, up, down_t, down_transposed=True, act=act)
    x = inputs(T, seed=T)
    gen = torch.Generator().manual_seed(T)
    density = 0.05 if T < 40 else 0.6  # T=40 at 60% union density takes the dense branch of the rule
    mask = torch.rand(T, N_FF, generator=gen) < density
    out = S.ffn_masked(w, x, mask)
    for t in range(T):
        close(out[t:t + 1], reference(gate, up, down_t, x[t:t + 1], act, keep=mask[t].nonzero().view(-1)))


@pytest.mark.parametrize("T", [1, 3, 24])
@pytest.mark.parametrize("act", S.ACTIVATIONS)
def test_widths_and_index_counts_without_vector_multiples(act, T, path):
    """The kernel's vector loop takes 16 floats and 8 neurons at a time: widths and index counts that are not
    multiples of either exercise its scalar tails."""
    gen = torch.Generator().manual_seed(T)
    n_ff, d = 77, 37
    gate, up, down_t = (torch.randn(n_ff, d, generator=gen) for _ in range(3))
    w = S.pack_ffn(gate, up, down_t, down_transposed=True, act=act)
    x = torch.randn(T, d, generator=gen)
    for k in (1, 2, 3, 5, 13, 77):
        idx = torch.randperm(n_ff, generator=gen)[:k]
        close(S.ffn_sparse(w, x, idx), reference(gate, up, down_t, x, act, keep=idx))


def test_kernel_threads_agree(mats, path):
    gate, up, down_t = mats
    w = S.pack_ffn(gate, up, down_t, down_transposed=True, act="silu")
    x, idx = inputs(2), torch.arange(0, N_FF, 3)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = S.ffn_sparse(w, x, idx)
        torch.set_num_threads(2)
        two = S.ffn_sparse(w, x, idx)
    finally:
        torch.set_num_threads(saved)
    close(one, reference(gate, up, down_t, x, "silu", keep=idx))
    close(two, one.double())



# --- gate-less FFNs (Falcon, OPT): down(act(up x + b)), the up row decides activity ----------------------------------

def gateless_reference(up, bias, down_t, x, act, keep=None):
    u = x.double() @ up.double().T + bias.double()
    h = F.relu(u) if act == "relu" else F.gelu(u)
    if keep is not None:
        mask = torch.zeros(up.shape[0], dtype=torch.float64)
        mask[keep] = 1
        h = h * mask
    return h @ down_t.double()


@pytest.fixture(scope="module")
def gateless(mats):
    _, up, down_t = mats
    bias = torch.randn(N_FF, generator=torch.Generator().manual_seed(5)) * 0.5
    return up, bias, down_t


@pytest.mark.parametrize("act", S.GATELESS_ACTIVATIONS)
@pytest.mark.parametrize("T", [1, 2, S.GATHER_MIN_T, 9, 40])
def test_gateless_packed_equals_reference(gateless, act, T):
    """The fallback's layout with one row per neuron and the up bias: dense, any index set, per-row masks."""
    up, bias, down_t = gateless
    w = S.pack_ffn(None, up, down_t, down_transposed=True, act=act, up_bias=bias)
    assert w.gate is None and torch.equal(w.up, up)
    x = inputs(T, seed=T)
    close(S.ffn_dense(w, x), gateless_reference(up, bias, down_t, x, act))
    idx = torch.randperm(N_FF, generator=torch.Generator().manual_seed(T))[:77]
    close(S.ffn_sparse(w, x, idx), gateless_reference(up, bias, down_t, x, act, keep=idx))
    mask = torch.rand(T, N_FF, generator=torch.Generator().manual_seed(T)) < 0.1
    out = S.ffn_masked(w, x, mask)
    for t in range(T):
        close(out[t:t + 1], gateless_reference(up, bias, down_t, x[t:t + 1], act, keep=mask[t].nonzero().view(-1)))


@pytest.mark.parametrize("T", [1, 3])
def test_gateless_relu_exact_masks_come_from_up_plus_bias(gateless, T):
    up, bias, down_t = gateless
    w = S.pack_ffn(None, up, down_t, down_transposed=True, act="relu", up_bias=bias)
    x = inputs(T)
    active = (x.double() @ up.double().T + bias.double()) > 0
    idx = S.union_indices(active)
    assert 0 < idx.numel() < N_FF
    full = gateless_reference(up, bias, down_t, x, "relu")
    close(S.ffn_sparse(w, x, idx), full)
    done = S.ffn_exact(w, x)
    if done is not None:  # the C++ kernel (fp32, few tokens): reads up rows first, counts the active pairs
        close(done[0], full)
        assert done[1] == int(active.sum())


def test_gateless_rows_without_kernels_use_the_packed_copy(gateless, monkeypatch):
    """FFNRows as the loader builds it for Falcon/OPT (gate None, up bias), with the C++ kernels unavailable: the
    torch fallback packs the up rows with their bias and computes the same FFN."""
    from pinfer_llm.runtime.cpu import qops
    from pinfer_llm.runtime.weights import quantize_like

    up, bias, down_t = gateless
    rows = S.FFNRows(None, quantize_like(up, T.F32, "up"), quantize_like(down_t, T.F32, "down_t"), "relu", bias)
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    assert not rows.kernels and not qops.available()
    x = inputs(2)
    close(S.ffn_dense(rows, x), gateless_reference(up, bias, down_t, x, "relu"))
    idx = torch.arange(0, N_FF, 4)
    close(S.ffn_sparse(rows, x, idx), gateless_reference(up, bias, down_t, x, "relu", keep=idx))
    assert rows.packed().up_bias is not None


def test_pack_rejects_gate_with_a_gateless_activation(gateless):
    up, bias, down_t = gateless
    with pytest.raises(PinferError, match="'silu' without a gate"):
        S.pack_ffn(None, up, down_t, down_transposed=True, act="silu")
