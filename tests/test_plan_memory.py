"""Byte accounting against real tensor sizes: tiny GGUFs with real quantised weights, skeletons, and SmolLM2."""

import gguf
import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as T
from test_plan_helpers import fast_hw, gpu, tiny_model

from pinfer_llm.formats import constants as C
from pinfer_llm.formats.reader import open_gguf
from pinfer_llm.planner.ilp import solve
from pinfer_llm.planner.memory import account, tensor_table
from pinfer_llm.planner.planfile import fingerprint
from pinfer_llm.planner.problem import build_problem
from pinfer_llm.planner.skeleton import SHAPES, make_skeleton, skeleton_from, tensor_specs


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PINFER_CACHE_DIR", str(tmp_path / "cache"))


def _layer_tensors(f, b):
    return {n: t for n, t in f.tensors.items() if n.startswith(f"blk.{b}.")}


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q8_0, T.F16])
@pytest.mark.parametrize("predictor", [True, False])
def test_parts_add_up_to_the_tensors(tmp_path, qtype, predictor):
    f = open_gguf(tiny_model(tmp_path / "m.gguf", qtype=qtype, predictor=predictor))
    m = account(f, ctx_size=200)
    for b, lb in enumerate(m.layers):
        ts = _layer_tensors(f, b)
        ffn = [n for n in ts if any(x in n for x in ("ffn_gate.", "ffn_up.", "ffn_down.", "ffn_down_t."))]
        pred = [n for n in ts if ".fc1." in n or ".fc2." in n]
        stats = [n for n in ts if "act_counts" in n]
        attn = [n for n in ts if n not in ffn + pred + stats]
        assert lb.ffn == sum(ts[n].nbytes for n in ffn)
        assert lb.pred == sum(ts[n].nbytes for n in pred)
        assert lb.attn == sum(ts[n].nbytes for n in attn)
        assert lb.kv == 2 * 200 * 2 * 16 * 2  # K and V, ctx, 2 kv heads of 16, F16
        assert int(lb.neuron_bytes(lb.n_ff)) == lb.ffn
    stats = sum(t.nbytes for n, t in f.tensors.items() if "act_counts" in n)
    kv = sum(lb.kv for lb in m.layers)
    assert m.total - kv + m.host_fixed == sum(t.nbytes for t in f.tensors.values()) - stats


def test_neuron_bytes_are_the_sliced_rows(tmp_path):
    f = open_gguf(tiny_model(tmp_path / "m.gguf", qtype=T.Q4_0, n_ff=96))
    lb = account(f).layers[1]
    rows = [C.tensor(t, 1) for t in (C.FFN_GATE, C.FFN_UP, C.FFN_DOWN_T)]
    idx = np.array([3, 7, 50, 95])
    for k in (0, 1, 17, 96):
        assert int(lb.neuron_bytes(k)) == sum(f.raw(n)[:k].nbytes for n in rows)
    assert int(lb.neuron_bytes(len(idx))) == sum(f.raw(n)[idx].nbytes for n in rows)


def test_plan_vram_matches_real_tensor_bytes(tmp_path):
    path = tiny_model(tmp_path / "m.gguf", qtype=T.Q4_0, n_layer=4, n_ff=96)
    f = open_gguf(path)
    total = account(f).total
    p = build_problem(f, fast_hw([gpu(budget_bytes=int(0.5 * total), model=path)]))
    sol = solve(p)
    plan, ev = sol.plan, sol.evaluation
    assert ev.fits and ev.vram[0] <= p.hw.gpus[0].budget_bytes
    real = p.model.gpu_workspace
    buckets = plan.gpu_buckets(p.order)
    for b in range(p.model.n_layer):
        ts = _layer_tensors(f, b)
        if plan.attn[b]:
            real += sum(t.nbytes for n, t in ts.items() if not any(
                x in n for x in ("ffn_gate.", "ffn_up.", "ffn_down_t.", ".fc1.", ".fc2.", "act_counts")))
            real += p.model.layers[b].kv
        if plan.pred[b]:
            real += ts[C.tensor(C.PRED_FC1, b)].nbytes + ts[C.tensor(C.PRED_FC2, b)].nbytes
        for n in (C.FFN_GATE, C.FFN_UP, C.FFN_DOWN_T):
            real += f.raw(C.tensor(n, b))[buckets[b]].nbytes
    if plan.output:
        real += f.tensors[C.OUTPUT].nbytes + f.tensors[C.OUTPUT_NORM].nbytes
    assert ev.vram[0] == real


def test_tied_embeddings_need_a_gpu_copy(tmp_path):
    f = open_gguf(tiny_model(tmp_path / "m.gguf", tied=True))
    m = account(f)
    assert m.output == f.tensors[C.TOKEN_EMBD].nbytes + f.tensors[C.OUTPUT_NORM].nbytes
    assert m.host_fixed == f.tensors[C.TOKEN_EMBD].nbytes


def test_skeleton_of_a_real_model_accounts_the_same(tmp_path):
    real = tiny_model(tmp_path / "m.gguf", qtype=T.Q4_0)
    skel = skeleton_from(real, tmp_path / "s.gguf")
    a, b = account(open_gguf(real)), account(open_gguf(skel))
    assert [vars(x) for x in a.layers] == [vars(x) for x in b.layers]
    assert (a.output, a.host_fixed, a.total) == (b.output, b.host_fixed, b.total)
    assert fingerprint(open_gguf(real)) == fingerprint(open_gguf(skel))
    assert skel.stat().st_size < real.stat().st_size


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_skeletons_open_with_standard_tools(tmp_path, shape):
    path = make_skeleton(shape, tmp_path / "s.gguf", quant="q4_0", n_layer=2)
    r = gguf.GGUFReader(path)
    assert "pinfer.skeleton" in r.fields
    assert [t.name for t in r.tensors] == [C.tensor(C.ACT_COUNTS, b) for b in range(2)]
    f = open_gguf(path)
    table = tensor_table(f)
    s = SHAPES[shape]
    assert table[C.tensor(C.FFN_UP, 1)].shape == (s.n_ff, s.n_embd)
    m = account(f)
    assert m.n_layer == 2 and m.layers[0].n_ff == s.n_ff


def test_skeleton_sizes_match_known_models(tmp_path):
    # Llama2-7B at F16: 6.74e9 parameters; the PowerInfer layout adds predictors of ~7% of that
    specs = tensor_specs(SHAPES["llama2-7b"], "f16")
    params = sum(int(np.prod(sh)) for n, sh, _ in specs if ".fc" not in n)
    assert params == 6_738_415_616
    m = account(open_gguf(make_skeleton("llama2-70b", tmp_path / "s.gguf", quant="q4_0")))
    weights = m.total - sum(lb.kv + lb.pred for lb in m.layers) + m.host_fixed
    assert 38e9 < weights < 40e9  # 69e9 parameters at 4.5 bits (Q4_0), the output head at Q6_K
    pred = sum(lb.pred for lb in m.layers) / 2  # F16 predictors: parameters
    assert 0.049 < pred / 69e9 < 0.087  # within the paper's 4.9-8.7% of the model


def test_smollm2_accounting(smollm2):
    f = open_gguf(smollm2)
    m = account(f, ctx_size=2048)
    assert m.n_layer == 30 and m.layers[0].n_ff == 1536
    for b, lb in enumerate(m.layers):
        ts = _layer_tensors(f, b)
        assert lb.ffn == sum(t.nbytes for n, t in ts.items() if "ffn_" in n and "norm" not in n)
        assert lb.attn == sum(t.nbytes for n, t in ts.items() if not ("ffn_" in n and "norm" not in n))
        assert lb.kv == 2 * 2048 * 3 * 64 * 2
        assert int(lb.neuron_bytes(100)) == f.raw(C.tensor(C.FFN_GATE, b))[:100].nbytes * 3  # gate, up, down alike
    assert m.output == f.tensors[C.TOKEN_EMBD].nbytes + f.tensors[C.OUTPUT_NORM].nbytes  # tied
    placed = sum(lb.attn + lb.ffn for lb in m.layers) + m.output
    assert placed == sum(t.nbytes for t in f.tensors.values())  # every byte once, plus the tied copy
    # no statistics in the file: planning it asks for them
    from pinfer_llm.formats.errors import PinferError

    with pytest.raises(PinferError, match="pi-profile"):
        build_problem(f, fast_hw([gpu()]))


def test_planning_never_reads_weights(tmp_path, monkeypatch):
    from pinfer_llm.formats.header import GGUFFile

    path = tiny_model(tmp_path / "m.gguf")
    read = []
    real_raw = GGUFFile.raw

    def spy(self, name):
        read.append(name)
        return real_raw(self, name)

    monkeypatch.setattr(GGUFFile, "raw", spy)
    p = build_problem(path, fast_hw([gpu()]))
    solve(p)
    assert read and all(n.endswith("act_counts") for n in read)


def test_kv_cache_type(tmp_path):
    path = tiny_model(tmp_path / "m.gguf")
    hw = fast_hw([gpu()])
    f16 = build_problem(path, hw, ctx_size=100).model.layers[0].kv
    f32 = build_problem(path, hw, ctx_size=100, kv_type="f32").model.layers[0].kv
    assert f32 == 2 * f16 == 2 * (2 * 100 * 2 * 16 * 2)
