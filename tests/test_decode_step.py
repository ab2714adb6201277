"""The fused decode step (runtime/cpu/step.py, csrc/step.cpp) against the Python forward it replaces for one token.

The step calls the forward's own kernels in the forward's order, so its logits must equal the forward's to the bit,
for llama (SwiGLU over ffn_down, ReGLU over ffn_down_t), bamboo, falcon (40B layout, and one norm for both branches
as the 7B), opt (biases, LayerNorm, no rope), every FFN mode (dense, exact masks: ReLU and CATS, predicted with fc2
or fc2_t and outlier neurons), every weight type the kernels read, and both KV cache types. Against the torch
fallback (no kernels, no step) and the AVX2 build's step the logits agree to float rounding.

Plants (each seen failing, then restored): opt's output-projection bias added after the residual sum instead of
before (float addition is not associative) fails the 3 opt cases; the parallel branch's FFN and predictor fed the
post-attention residual fails falcon's 3 modes and falcon-7b's predictor (its dense and exact FFNs read the shared
norm, not the residual); the shared norm ignored crashes the run (falcon-7b has no FFN norm of its own); the
predictor's outlier neurons (`always`) dropped fails the 6 predictor cases; a step that never notices a replaced FFN
fails test_a_replaced_ffn_rebuilds_the_step; neuron counts not added fails the stats check.
"""

from __future__ import annotations

import os

import pytest
import torch
from gguf.constants import GGMLQuantizationType as T

from pinfer_llm import synth
from pinfer_llm.runtime import load_model
from pinfer_llm.runtime.cpu import kernels as cpu_kernels
from pinfer_llm.runtime.cpu import step as cpu_step
from pinfer_llm.runtime.ffn.dense import DenseFFN
from pinfer_llm.runtime.ffn.ops import FFNRows
from pinfer_llm.runtime.ffn.predictor import Predictor
from pinfer_llm.runtime.ffn.sparse import CatsOracleMasker, PredictorMasker, ReluOracleMasker, SparseFFN
from pinfer_llm.runtime.linear import Linear
from pinfer_llm.runtime.loader import transposed
from pinfer_llm.runtime.weights import quantize_like
from tests.tiny import write_tiny

KERNELS = os.environ.get("PINFER_CPU_KERNELS") != "0"
needs_kernels = pytest.mark.skipif(not KERNELS, reason="PINFER_CPU_KERNELS=0: no step without the kernels")
ARCHS = ["llama-swiglu", "llama-relu", "bamboo", "falcon", "falcon-7b", "opt"]
TYPES = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q8_0]
PROMPT = [5, 9, 77, 31, 7, 120]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Tiny models of every architecture: SmolLM2-like (llama.cpp's layout, ffn_down) and planted PowerInfer files
    (ffn_down_t) for ReGLU llama, bamboo, falcon (40B layout: grouped KV, two norms) and opt."""
    d = tmp_path_factory.mktemp("step")
    out = {"llama-swiglu": d / "swiglu.gguf"}
    write_tiny(out["llama-swiglu"])
    for arch, variant in (("llama-relu", "relu"), ("bamboo", "drelu"), ("falcon", "falcon"), ("opt", "opt")):
        out[arch] = d / f"{arch}.gguf"
        synth.generate(out[arch], synth.SynthSpec(n_layer=2, n_embd=64, n_ff=128, n_head=4,
                                                  n_head_kv=2 if variant != "opt" else 4, vocab="bytes",
                                                  variant=variant, sparsity=0.7, seed=3))
    out["falcon-7b"] = out["falcon"]
    # 32-wide heads: the team step's heads are whole q8 blocks there, quantised by the threads that attend them
    out["llama-d32"] = d / "llama-d32.gguf"
    synth.generate(out["llama-d32"], synth.SynthSpec(n_layer=2, n_embd=128, n_ff=256, n_head=4, n_head_kv=2,
                                                     vocab="bytes", variant="relu", sparsity=0.7, seed=4))
    return out


def requantise(tr, qtype: T) -> None:
    """Every matrix the layers and the head multiply by re-encoded in qtype (from its dequantised values)."""
    def q(w):
        return w if qtype == T.F32 else quantize_like(w.dequantize(), qtype, w.name)

    lins = [tr.output] + [lin for b in tr.blocks for lin in (b.wqkv, b.wo)]
    for b in tr.blocks:
        rows = b.ffn.rows
        rows.gate = None if rows.gate is None else q(rows.gate)
        rows.up = q(rows.up)
        rows.down_t = None if rows.down_t is None else q(rows.down_t)
        if b.ffn.down is not None:
            lins.append(b.ffn.down)
    for lin in lins:
        lin.ws = [q(w) for w in lin.ws]


def set_mode(tr, mode: str, seed: int = 0) -> None:
    """The layers' FFNs as SparseFFNs over neuron-major rows: exact masks (ReLU-family by their gates, SwiGLU by a CATS
    threshold) or random predictors (fc2 as stored on layer 0 with two outlier neurons, fc2_t on the others)."""
    g = torch.Generator().manual_seed(seed)
    for li, b in enumerate(tr.blocks):
        r = b.ffn.rows
        down_t = r.down_t if r.down_t is not None else transposed(b.ffn.down.ws[0])
        rows = FFNRows(r.gate, r.up, down_t, r.act, r.up_bias)
        if mode == "oracle":
            masker = CatsOracleMasker(0.1) if r.act == "silu" else ReluOracleMasker()
        else:
            fc1 = torch.randn(16, rows.n_embd, generator=g) * 0.3
            fc2 = torch.randn(rows.n_ff, 16, generator=g)
            pred = Predictor(fc1=fc1, fc2=fc2, threshold=0.5, fc2_t=None if li == 0 else fc2.T.contiguous())
            masker = PredictorMasker(pred, torch.tensor([0, 3]) if li == 0 else None)
        b.ffn = SparseFFN(rows, masker)


def model(files, arch: str, qtype: T = T.F32, mode: str = "dense", kv: str = "f16", ffn_down: bool = False):
    """ffn_down: a planted PowerInfer file's FFNs given llama.cpp's ffn_down [d, n_ff] instead of ffn_down_t, so that
    their dense step takes ffn_mm (FFN_MM) as a converted file's would."""
    m = load_model(files[arch], threads=2, ffn_mode="dense", kv_type=kv)
    tr = m.transformer
    if arch == "falcon-7b":  # one norm feeds both branches
        for b in tr.blocks:
            b.attn_norm = b.ffn_norm
    if ffn_down:
        for b in tr.blocks:
            if b.ffn.down is None:
                b.ffn = DenseFFN(b.ffn.rows, Linear([transposed(b.ffn.rows.down_t)]))
    requantise(tr, qtype)
    if mode != "dense":
        set_mode(tr, mode)
    return m


def decode(m, use_step: bool, n: int = 4, prompt=PROMPT) -> tuple[torch.Tensor, list[int]]:
    """The prompt's prefill, then n greedy tokens one at a time: (the decode logits [n, vocab], the tokens)."""
    tr = m.transformer
    tr.use_step = use_step
    with torch.inference_mode():
        logits = tr.forward(torch.tensor(prompt), 0)[-1:]
        outs, toks = [], []
        for i in range(n):
            toks.append(int(logits[-1].argmax()))
            logits = tr.forward(torch.tensor(toks[-1:]), len(prompt) + i)
            outs.append(logits)
    return torch.cat(outs), toks


def active(m) -> list[int]:
    return [b.ffn.stats.active if isinstance(b.ffn, SparseFFN) else 0 for b in m.transformer.blocks]


@needs_kernels
@pytest.mark.parametrize("mode", ["dense", "oracle", "pred"])
@pytest.mark.parametrize("arch", ARCHS)
def test_step_equals_the_forward_to_the_bit(files, arch, mode):
    for qtype in TYPES:
        m = model(files, arch, qtype, mode, kv="f32" if qtype == T.F16 else "f16")
        a0 = active(m)
        want, want_toks = decode(m, use_step=False)
        a1 = active(m)
        got, toks = decode(m, use_step=True)
        a2 = active(m)
        assert m.transformer._step is not None, (arch, mode, qtype.name)  # the step ran
        assert torch.equal(got, want), (arch, mode, qtype.name, float((got - want).abs().max()))
        assert toks == want_toks
        # sparse modes: the step counts each layer's neurons as the forward does
        assert [b - a for a, b in zip(a1, a2, strict=True)] == [b - a for a, b in zip(a0, a1, strict=True)]


@needs_kernels
@pytest.mark.parametrize("arch", ARCHS)
def test_step_equals_the_torch_fallback(files, arch, monkeypatch):
    """With the kernels disabled there is no step and torch runs the forward; on float32 weights it gives the step's
    logits up to float rounding (dense, and exact masks where an activation is exactly zero)."""
    for mode in ("dense", "oracle"):
        if mode == "oracle" and arch == "llama-swiglu":
            continue  # a CATS threshold is a cut through non-zero activations: rounding may move a neuron across
        got, toks = decode(model(files, arch, mode=mode, kv="f32"), use_step=True)
        with monkeypatch.context() as mp:
            mp.setattr(cpu_kernels, "available", lambda: False)
            ref = model(files, arch, mode=mode, kv="f32")
            want, want_toks = decode(ref, use_step=True)
            assert ref.transformer._step is None
        assert (got - want).abs().max() < 1e-4 * want.abs().max(), (arch, mode)
        assert toks == want_toks


@needs_kernels
@pytest.mark.skipif(" avx2" not in cpu_kernels.cpu_flags(), reason="no AVX2 on this CPU")
@pytest.mark.parametrize("arch", ["llama-swiglu", "falcon", "opt"])
def test_the_avx2_builds_step(files, arch):
    """The step of the -march=x86-64-v3 build (AVX2 tiles throughout) equals the native build's to float rounding
    and q8 activations' own (identical for both: the same blocks are rounded the same way)."""
    ns = cpu_kernels.variant_namespace("x86-64-v3")
    cpu_kernels.load_variants(["x86-64-v3"])
    for qtype, mode in ((T.F32, "dense"), (T.Q4_1, "dense"), (T.Q4_0, "pred"), (T.Q8_0, "oracle")):
        m = model(files, arch, qtype, mode)
        want, _ = decode(m, use_step=True)
        m.transformer._step = cpu_step.build(m.transformer, ns)
        got, _ = decode(m, use_step=True)
        assert (got - want).abs().max() < 1e-3 * want.abs().max(), (arch, qtype.name, mode)


@needs_kernels
def test_same_prompt_same_tokens_whatever_ran_before_and_however_it_is_chunked(files, monkeypatch):
    """Greedy tokens through the step depend on the prompt only: not on another prompt decoded before (the step's
    buffers carry nothing over), nor on the prefill's chunking (F32: the GEMV tiles and GEMM agree to rounding)."""
    from pinfer_llm.runtime import engine

    m = model(files, "llama-swiglu", mode="dense", kv="f32")
    want = list(m.generate(PROMPT, max_tokens=8, temperature=0))
    list(m.generate([200, 3, 3, 14], max_tokens=5, temperature=0))
    assert list(m.generate(PROMPT, max_tokens=8, temperature=0)) == want
    monkeypatch.setattr(engine, "PREFILL_CHUNK", 4)
    assert list(m.generate(PROMPT, max_tokens=8, temperature=0)) == want
    m.transformer.use_step = False
    assert list(m.generate(PROMPT, max_tokens=8, temperature=0)) == want


@needs_kernels
def test_a_replaced_ffn_rebuilds_the_step(files):
    """A block whose FFN object is replaced (the hybrid executor, a profiler's wrapper) gets a new step, or none: a
    wrapper the step cannot see into runs through the forward, and sees every token."""
    m = model(files, "llama-relu")
    tr = m.transformer
    decode(m, use_step=True)
    first = tr._step
    assert first is not None
    calls = []

    class Spy:
        def __init__(self, inner):
            self.inner = inner

        def __call__(self, x, resid):
            calls.append(x.shape[0])
            return self.inner(x, resid)

    inner = tr.blocks[1].ffn
    tr.blocks[1].ffn = Spy(inner)
    decode(m, use_step=True, n=3)
    assert tr._step is None and calls == [len(PROMPT), 1, 1, 1]
    tr.blocks[1].ffn = inner
    decode(m, use_step=True)
    assert tr._step is not None and tr._step is not first


@needs_kernels
def test_the_step_refuses_bad_arguments():
    """The native builder checks shapes once, at build time, in one line each."""
    cls = torch.classes.pinfer.DecodeStep
    with pytest.raises(RuntimeError, match="head counts"):
        cls(64, 4, 3, 0.25, False, torch.zeros(8, 8, 2))
    s = cls(64, 4, 2, 0.25, False, torch.zeros(8, 8, 2))
    kc = torch.zeros(2, 8, 16)
    with pytest.raises(RuntimeError, match="qkv"):
        s.add_attention(torch.ones(64), None, 1e-5, False, [torch.zeros(100, 64)], [0], None, [torch.zeros(64, 64)],
                        [0], None, kc, kc, False)
    with pytest.raises(RuntimeError, match="set_output first"):
        s.run(torch.zeros(1, 64), 0)


@needs_kernels
def test_a_range_of_layers_and_a_subset_of_neurons(files):
    """What an executor that runs part of a model elsewhere (the hybrid's CPU half) calls: the step over layers
    [0, 1) then [1, 2), then the head, is the whole step; one layer's FFN over a subset of its neurons is ffn_sparse
    over them."""
    from pinfer_llm.runtime.ffn.ops import ffn_sparse

    m = model(files, "llama-relu", T.Q4_0, "oracle")
    tr = m.transformer
    decode(m, use_step=True, n=1)
    native, pos = tr._step.native, len(PROMPT) + 1
    with torch.inference_mode():
        x = tr.embed(torch.tensor([9]), pos)
        whole = native.run(x, pos)
        h = native.run_layers(native.run_layers(x, pos, 0, 1), pos, 1, 2)
        assert torch.equal(tr.output(tr.norm(h, tr.output_norm)), whole)
        xf = torch.randn(1, tr.cfg.n_embd, generator=torch.Generator().manual_seed(1))
        idx = torch.tensor([40, 1, 5, 7, 100])
        y, _ = native.ffn_subset(1, xf, idx)
        assert torch.equal(y, ffn_sparse(tr.blocks[1].ffn.w, xf, idx))
        with pytest.raises(RuntimeError, match="out of range"):
            native.ffn_subset(1, xf, torch.tensor([tr.cfg.n_ff]))


@needs_kernels
@pytest.mark.parametrize("mode", ["ffn_down", "dense", "oracle", "pred"])
@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("arch", ARCHS)
def test_the_team_step_is_the_bits_of_the_forked_step(files, arch, threads, mode):
    """With several threads the step runs each token on one team of threads meeting at barriers (csrc/step.cpp
    decode_team); the step that forks the pool per operation (decode_layers) gives the same bits, for every
    architecture (opt's biases and LayerNorm, falcon's parallel branches), every FFN the step knows (ffn_down: the
    planted files given llama.cpp's ffn_down; dense over PowerInfer's ffn_down_t; exact masks; predictors, whose
    batched rows keep the forked step), every weight type, and an uneven split (3 threads: shares of 64-wide rows,
    4 heads and 128 neurons that do not divide evenly). Plants (each seen failing, then restored): opt's FFN bias left
    out of the team's residual (opt fails); the last unit of each share dropped; the team's neuron counts not added;
    the barrier between the key/value write and the heads that read it removed (all 12 then); every row's heads at
    the first row's position (12); the sparse parts' sums not added (34 of 48); the predictor's outlier neurons
    (`always`) dropped (the 12 predictor cases); the barrier after the sparse parts removed (34 of 48)."""
    team_equals_forked(files, arch, threads, mode, TYPES)


@needs_kernels
@pytest.mark.parametrize("mode", ["ffn_down", "pred"])
@pytest.mark.parametrize("threads", [2, 3])
def test_the_team_step_shares_whole_q8_blocks(files, threads, mode):
    """Heads of 32 values: each thread quantises the q8 blocks of the heads it attended and of the neurons it
    activated, once for the team, where every thread quantised the whole rows for itself. Plants (each seen failing,
    then restored): the last block of a thread's heads, or of its neurons, left unquantised."""
    team_equals_forked(files, "llama-d32", threads, mode, [T.Q4_0, T.Q4_1, T.Q8_0])


@needs_kernels
@pytest.mark.parametrize("team", [True, False])
def test_a_batch_reads_the_union_of_its_rows_predicted_neurons(files, team):
    """Per layer with predictors the step counts the neurons whose rows a call read (Model.read_counts, pi-serve's
    pinfer_ffn_neurons_read_total): one row's own predicted neurons, as many as it computed; a batch's union of its
    rows' (each row computed over its own), at least the largest row's and below their sum where the rows share
    neurons (layer 0's outlier neurons are in every row's), and one pass per call. Team and forked steps alike.
    Plants (each seen failing, then restored): the team counting the rows' summed lists instead of the union; the
    forked batch counting nothing."""
    m = model(files, "llama-relu", T.F32, "pred")
    tr = m.transformer
    stats = [b.ffn.stats for b in tr.blocks]
    with torch.inference_mode():
        tr.forward(torch.tensor(PROMPT), 0)
        tr.decode_step().native.set_team(team)
        caches = [m.new_cache() for _ in range(3)]
        toks = [3, 9, 14]

        def counts(run):
            before = m.read_counts(), [st.active for st in stats]
            run()
            after = m.read_counts(), [st.active for st in stats]
            passes = [n1 - n0 for (n0, _), (n1, _) in zip(before[0], after[0], strict=True)]
            read = [r1 - r0 for (_, r0), (_, r1) in zip(before[0], after[0], strict=True)]
            return passes, read, [a1 - a0 for a0, a1 in zip(before[1], after[1], strict=True)]

        own = []
        for c, t in zip(caches, toks, strict=True):
            passes, read, active = counts(lambda c=c, t=t: m.run_rows([t], [0], [c], [0]))
            assert passes == [1] * len(stats) and read == active, (passes, read, active)
            own.append(read)
        # the three rows in one call, at the position each wrote alone (rewritten with the same bits)
        passes, read, active = counts(lambda: m.run_rows(toks, [0, 0, 0], caches, [0, 1, 2]))
        assert passes == [1] * len(stats)
        assert active == [sum(o[li] for o in own) for li in range(len(stats))]
        for li in range(len(stats)):
            assert max(o[li] for o in own) <= read[li] <= active[li], (li, read, own)
        assert read[0] < active[0], (read, own)  # the outlier neurons read once for the three rows


def team_equals_forked(files, arch: str, threads: int, mode: str, types) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for qtype in types:
            m = model(files, arch, qtype, "dense" if mode == "ffn_down" else mode,
                      kv="f32" if qtype == T.Q8_0 else "f16", ffn_down=mode == "ffn_down")
            torch.set_num_threads(threads)  # after the load, which sets its own (2)
            tr = m.transformer
            with torch.inference_mode():
                tr.forward(torch.tensor(PROMPT), 0)
                st = tr.decode_step()
                x = tr.embed(torch.tensor([PROMPT[1]]), len(PROMPT))
                runs = {}
                for team in (True, False, True):
                    st.native.set_team(team)
                    # the same token at the same position each time: its cache rows are rewritten with the same bits
                    runs.setdefault(team, []).append(st.native.run(x, len(PROMPT)).clone())
            assert st.native is not None and tr._step is st
            assert torch.equal(runs[True][0], runs[True][1]), (arch, qtype.name)
            assert torch.equal(runs[True][0], runs[False][0]), (arch, qtype.name,
                                                                float((runs[True][0] - runs[False][0]).abs().max()))
            # several sequences' rows in one call (run_rows: a prompt's rows and decode rows of other caches, the
            # logits of some of them), team and forked: the same logits and the same cache rows
            caches = [m.new_cache() for _ in range(2)]
            toks, pos, out = [3, 9, 14, 2, 60], [0, 1, 2, 0, 1], [0, 2, 4, 4]
            rows, got = [caches[0]] * 3 + [caches[1]] * 2, {}
            for team in (True, False):
                st.native.set_team(team)
                logits = m.run_rows(toks, pos, rows, out)
                got[team] = (logits, [c.k[-1][:, :n].clone() for c, n in zip(caches, (3, 2), strict=True)])
            assert torch.equal(got[True][0], got[False][0]), (arch, qtype.name, "rows")
            assert all(map(torch.equal, got[True][1], got[False][1])), (arch, qtype.name, "cache rows")
            # and the team counts the layers' neurons as the forked step does
            st.native.take_active()
            st.native.set_team(True)
            st.native.run(x, len(PROMPT))
            on = st.native.take_active().tolist()
            st.native.set_team(False)
            st.native.run(x, len(PROMPT))
            assert st.native.take_active().tolist() == on
    finally:
        torch.set_num_threads(before)


def test_the_team_step_yields_to_a_passive_wait_policy(monkeypatch):
    """The team's barriers spin, so a user who asked OpenMP's threads to sleep (OMP_WAIT_POLICY=passive) gets the
    forked step, as does PINFER_DECODE_TEAM=0."""
    monkeypatch.delenv("PINFER_DECODE_TEAM", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert cpu_step.team_enabled()
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert not cpu_step.team_enabled()
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")
    assert cpu_step.team_enabled()
    monkeypatch.setenv("PINFER_DECODE_TEAM", "0")
    assert not cpu_step.team_enabled()


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_head_facts_are_the_logits_finiteness_and_first_argmax(files, threads):
    """Transformer.head_facts: for each row of logits the step returned, whether every value is finite and the
    index of the first largest, taken by the team's threads on their own shares (joined in share order) or by the
    forked step; pi-run's and the batch's greedy sampling and finite checks read them instead of the row. Rows of
    the head made equal give every logit the same value: the first index must win across the threads' shares; a
    row of NaN makes a logit NaN. Plants (each seen failing, then restored): the later share winning ties; the
    finite flag not joined."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for case in ("random", "equal rows", "nan row"):
            m = model(files, "llama-swiglu", T.F32)
            torch.set_num_threads(threads)  # after the load, which sets its own
            tr = m.transformer
            if case != "random":
                w = tr.output.ws[0].dequantize().clone()
                if case == "equal rows":
                    w[:] = w[3]
                else:
                    w[w.shape[0] * 2 // 3] = float("nan")
                tr.output.ws = [quantize_like(w, T.F32, tr.output.ws[0].name)]
            with torch.inference_mode():
                tr.forward(torch.tensor(PROMPT), 0)
                st = tr.decode_step()
                for team in (True, False):
                    st.native.set_team(team)
                    logits = tr.forward(torch.tensor([PROMPT[1]]), len(PROMPT))
                    got = tr.head_facts()
                    ok = bool(torch.isfinite(logits).all())
                    want = [[int(ok), int(logits[0].argmax()) if ok else -1]]
                    assert got == want, (case, team, threads)
                    if case == "equal rows":
                        assert got == [[1, 0]]
                    caches = [m.new_cache() for _ in range(2)]
                    logits = m.run_rows([3, 9, 14, 2], [0, 1, 0, 2], [caches[0], caches[0], caches[1], caches[0]],
                                        [1, 2, 3])
                    ok = torch.isfinite(logits).all(dim=1).tolist()
                    want = [[int(o), int(r.argmax()) if o else -1] for o, r in zip(ok, logits, strict=True)]
                    assert m.head_facts() == want, (case, team, threads, "rows")
                tr.forward(torch.tensor(PROMPT[:3]), 0)  # a prefill's logits: the step did not compute them
                assert tr.head_facts() is None
    finally:
        torch.set_num_threads(before)
