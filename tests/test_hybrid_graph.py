"""Captured decode steps (runtime/gpu/graph.py, HybridTransformer._graph_step): each device layer's decode step is
captured once as a CUDA graph and replayed, under the CuPy stand-in (tests/cuda_emu/fake_cupy.py), which keeps a
capture's work unrun and replays it with the arguments it was captured with, and counts the driver calls a real CuPy
would make. Tokens under replay equal the eager path's and the CPU's; a graph that no longer matches what it was
captured over is captured again."""

import numpy as np
import pytest
import torch

from pinfer_llm.runtime import load_model
from pinfer_llm.runtime.gpu import CudaDevice
from pinfer_llm.runtime.hybrid import executor as hybrid
from tests.cuda_emu import fake_cupy
from tests.test_hybrid import logits, random_placement, relu_pwri, split_placement  # noqa: F401 (a fixture)


class Eager(CudaDevice):
    """The same kernels, every step queued launch by launch."""

    can_capture = False


def decode(m, ids, start: int) -> np.ndarray:
    """Prefill ids[:start], then decode the rest one token at a time: every position's logits."""
    return logits(m, ids, decode_from=start)


IDS = [5, 9, 200, 31, 7, 11, 40, 41, 90]


@pytest.mark.parametrize("seed", [1, 2])
def test_replayed_steps_equal_the_eager_steps_and_the_cpu(relu_pwri, seed):  # noqa: F811
    """Random placements (host and device attention, the predictor on either side, odd seeds: layers with no GPU
    neuron or all of them, the head on the GPU): every decode step after the second replays its layers' graphs, and
    the logits equal the eager path's exactly (the same kernels; attention's fixed grid sums the same chunks; one
    block per column unit of sparse_down, whose blocks' atomics otherwise meet in any order) and the CPU's. Plant:
    the captured attention given no device position (it replays the captured step's position): fails.
    (A grid sized by the capture's position is caught by test_attention_reads_the_position_from_the_device: here
    every position lies in attention's first chunk.)"""
    path, cfg = relu_pwri
    place = random_placement(cfg, seed)
    want = decode(load_model(path, ffn_mode="sparse"), IDS, 2)
    devs = Eager(cupy=fake_cupy), CudaDevice(cupy=fake_cupy)
    for dev in devs:
        dev.down_splits = 1
    eager = decode(hybrid_on(path, place, devs[0]), IDS, 2)
    fake_cupy.calls.reset()
    got = decode(hybrid_on(path, place, devs[1]), IDS, 2)
    device_layers = int(np.sum(place.attn))
    assert fake_cupy.calls["capture"] == device_layers  # once each, on the second decode step
    assert fake_cupy.calls["graph_launch"] == device_layers * (len(IDS) - 2 - 1)
    np.testing.assert_array_equal(got, eager)
    assert np.abs(got - want).max() < 1e-3 * np.abs(want).max()


def hybrid_on(path, place, dev, **kw):
    m = load_model(path, ffn_mode="sparse", **kw)
    hybrid.apply(m, place, dev)
    return m


def test_a_split_layer_costs_two_driver_calls_per_decode_step(relu_pwri):  # noqa: F811
    """Attention, predictor and half the neurons on the GPU, every layer split: a replayed decode step costs per
    layer one graph launch (the share of the layer before up, the layer's kernels, count and ids down, the event, the
    device's rows) and one event wait, and per token the position up and the head (its input up, two launches, its
    output buffer, the logits down and their event). The predictor selects nothing here, so every layer's ids fit the
    first copy. Was 20 calls per layer (12 launches, ~7 allocations, 2 copies, an event) before capture."""
    path, cfg = relu_pwri
    m = hybrid_on(path, split_placement(cfg, attn_on_gpu=True, output=True), CudaDevice(cupy=fake_cupy))
    for b in m.transformer.blocks:
        b.ffn.masker.pred.threshold = float("inf")
    steps = []
    with torch.inference_mode():
        m.transformer.forward(torch.tensor([5, 9]), 0)
        for p in range(2, 6):
            fake_cupy.calls.reset()
            m.transformer.forward(torch.tensor([IDS[p]]), p)
            steps.append(dict(fake_cupy.calls))
    L = cfg.n_layer
    assert steps[0]["launch"] > 10 * L and steps[1]["capture"] == L  # eager, then captured
    per_token = {"copy_up": 2, "launch": 2, "alloc": 1, "copy_down": 1, "event_record": 1, "event_wait": 1}
    want = {k: per_token.get(k, 0) + {"graph_launch": L, "event_wait": L}.get(k, 0)
            for k in set(per_token) | {"graph_launch"}}
    assert steps[2] == steps[3] == want, steps


def test_ids_past_the_first_copy_come_in_a_second(relu_pwri, monkeypatch):  # noqa: F811
    """A decode step's copy down brings the count and the first found_cap ids; a step that selects more fetches the
    rest after its wait. With a cap of one id every split layer's step takes the second copy, and the logits still
    equal the CPU's (plant: no second copy, the ids past the cap read stale: fails)."""
    path, cfg = relu_pwri
    monkeypatch.setattr(hybrid, "found_cap", lambda n_ff: 1)
    rest = []

    class Log(CudaDevice):
        def to_host_async(self, a, out, stream=None):
            if a.dtype == np.int32:  # ids (the staging buffers' copies are bytes)
                rest.append(a.size)
            return super().to_host_async(a, out, stream)

    m = hybrid_on(path, split_placement(cfg, attn_on_gpu=True, output=False), Log(cupy=fake_cupy))
    got = decode(m, IDS, 2)
    assert len(rest) >= len(IDS) - 2 and min(rest) >= 1, rest
    want = decode(load_model(path, ffn_mode="sparse"), IDS, 2)
    assert np.abs(got - want).max() < 1e-3 * np.abs(want).max()


def test_a_longer_prompt_recaptures_the_steps(relu_pwri):  # noqa: F811
    """A second, longer prompt grows the staging buffers the captured steps copy through: the steps after it are
    captured again over the new buffers, and the logits equal the CPU's. (Plant: graphs kept across reallocated
    buffers: caught by the count of captures only. A stale graph's entry still holds views of the old buffers, so
    they stay allocated and its numbers are right; what it costs is their memory, and every later step reading
    buffers that nothing else uses.)"""
    path, cfg = relu_pwri
    place = split_placement(cfg, attn_on_gpu=True, output=True)
    m, cpu = hybrid_on(path, place, CudaDevice(cupy=fake_cupy)), load_model(path, ffn_mode="sparse")
    decode(m, IDS[:5], 2)
    fake_cupy.calls.reset()
    longer = IDS + [3, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24]
    got, want = decode(m, longer, 14), decode(cpu, longer, 14)
    assert np.abs(got - want).max() < 1e-3 * np.abs(want).max()
    assert fake_cupy.calls["capture"] == cfg.n_layer


def test_a_replan_recaptures_the_layer(relu_pwri):  # noqa: F811
    """A layer's FFN replaced by one with other GPU neurons (a replan) between decode steps: that layer's step is
    captured again, the new FFN does the host's work from then on, and the logits equal the CPU's, whose neurons are
    computed once either way (plant: the FFN left out of what a graph must match: the old split replays, device rows
    and host share both, and this fails on the new FFN's calls)."""
    path, cfg = relu_pwri
    place = split_placement(cfg, attn_on_gpu=True, output=False)
    m, cpu = hybrid_on(path, place, CudaDevice(cupy=fake_cupy)), load_model(path, ffn_mode="sparse")
    tr, ctr, calls = m.transformer, cpu.transformer, []
    with torch.inference_mode():
        got, want = [tr.forward(torch.tensor(IDS[:2]), 0)], [ctr.forward(torch.tensor(IDS[:2]), 0)]
        for p in range(2, len(IDS)):
            if p == 5:  # graphs captured and replayed by now
                old = tr.blocks[1].ffn
                bucket = np.arange(1, cfg.n_ff, 3, dtype=np.int64)
                new = hybrid.HybridFFN(old.inner, old.rows, tr.dev, tr.bus, bucket, True, tr.blocks[1].ffn_norm)
                new.host = _counted(new.host, calls)
                tr.blocks[1].ffn = new
                fake_cupy.calls.reset()
            got.append(tr.forward(torch.tensor([IDS[p]]), p))
            want.append(ctr.forward(torch.tensor([IDS[p]]), p))
    got, want = torch.cat(got).numpy(), torch.cat(want).numpy()
    assert np.abs(got - want).max() < 1e-3 * np.abs(want).max()
    assert len(calls) == len(IDS) - 5 and fake_cupy.calls["capture"] == 1


def _counted(fn, calls: list):
    def inner(*a):
        calls.append(1)
        return fn(*a)

    return inner


def test_the_fake_cupy_captures_and_replays():
    """What the tests above rely on: a captured launch and copy run only when the graph is launched, each time with
    the host buffer's bytes of that moment; a plain event recorded in a capture cannot be waited on, an external one
    fires at each replay; a stream that captures cannot be synchronised."""
    dev = CudaDevice(cupy=fake_cupy)
    s = dev.stream()
    host = dev.pinned((4,))
    a, out = dev.zeros((4,)), dev.zeros((4,))
    with s:
        dev.begin_capture(s)
        dev.to_device_async(host, a, s)
        dev.add(a, a, out=out)
        ev = dev.graph_event(s)
        with pytest.raises(fake_cupy.CaptureError):
            s.synchronize()
        with pytest.raises(fake_cupy.CaptureError):
            s.record()
        g = dev.end_capture(s)
        with pytest.raises(fake_cupy.CaptureError):
            ev.synchronize()  # not replayed yet
        assert not out.any()
        for v in (1.0, 2.5):
            host[...] = v
            dev.launch_graph(g, s)
            ev.synchronize()
            np.testing.assert_array_equal(out, 2 * v)


def test_attention_reads_the_position_from_the_device():
    """attention(pos_at=): the kernels read the position from device memory and the grid covers the whole cache;
    the result equals the same step given the position as an argument, bit for bit, at every position (so a step
    captured at one position replays right at another). Plants: the grid sized by pos, a chunk length that follows
    pos (other sums than the fixed grid's), rope_kv_store reading the argument: each fails."""
    dev = CudaDevice(cupy=fake_cupy)
    rng = np.random.default_rng(0)
    n_head, n_kv, hd, ctx = 4, 2, 32, 600
    kc0 = rng.standard_normal((n_kv, ctx, hd)).astype(np.float16)
    vc0 = rng.standard_normal((n_kv, ctx, hd)).astype(np.float16)
    dev.attn_chunk = 4  # below 600 / ATTN_MAX_CHUNKS: the chunk length is set by the cache
    for pos in (0, 70, 599):
        q, k, v = (rng.standard_normal((1, n, hd)).astype(np.float32) for n in (n_head, n_kv, n_kv))
        outs = []
        for at in (None, dev.asarray(np.array([pos], np.int32))):
            kc, vc = dev.asarray(kc0), dev.asarray(vc0)
            outs.append((dev.to_numpy(dev.attention(dev.asarray(q), dev.asarray(k), dev.asarray(v), kc, vc,
                                                    0 if at is not None else pos, pos_at=at, base=500000.0)),
                         dev.to_numpy(kc)))
        np.testing.assert_array_equal(outs[0][0], outs[1][0])
        np.testing.assert_array_equal(outs[0][1], outs[1][1])


def test_rope_in_fp32_matches_float64_at_large_positions():
    """attention.cu's RoPE runs in fp32 (a two-float angle, reduced by 2 pi in three parts) and stays within 1e-6 of
    the float64 rotation at positions up to 1e6 for bases up to 1e6 and linear scaling 2 (largest error seen:
    7.4e-7 on values of |x| <= 4). Plants: the angle as one float product (off by ~0.06 rad at 1e6), the product's
    low part dropped: each fails."""
    dev = CudaDevice(cupy=fake_cupy)
    rng = np.random.default_rng(0)
    n_head, n_kv, hd, ctx = 2, 1, 32, 1_000_001
    kc, vc = dev.zeros((n_kv, ctx, hd), np.float16), dev.zeros((n_kv, ctx, hd), np.float16)
    worst = 0.0
    for base in (10000.0, 500000.0, 1e6):
        for scale in (1.0, 2.0):
            for pos in (4095, 123457, 1_000_000):
                q = rng.standard_normal((1, n_head, hd)).astype(np.float32)
                k = rng.standard_normal((1, n_kv, hd)).astype(np.float32)
                qd = dev.asarray(q)
                dev._launch("attention", "rope_kv_store", (n_head + n_kv, 1), (64,),
                            (qd, dev.asarray(k), dev.asarray(k), kc.view(np.uint16), vc.view(np.uint16),
                             np.int32(pos), np.uint64(0), np.int32(n_head), np.int32(n_kv), np.int32(hd),
                             np.int32(hd), np.int32(0), dev._rope_table(base, hd), np.float32(1 / scale),
                             np.int32(ctx)))
                th = pos * np.float64(np.float32(1 / scale)) * base ** (-2 * np.arange(hd // 2) / hd)
                a, b = q[..., 0::2].astype(np.float64), q[..., 1::2].astype(np.float64)
                got = np.asarray(qd, np.float64)
                err = max(np.abs(got[..., 0::2] - (a * np.cos(th) - b * np.sin(th))).max(),
                          np.abs(got[..., 1::2] - (a * np.sin(th) + b * np.cos(th))).max())
                worst = max(worst, err / max(1.0, np.abs(q).max()))
    assert worst < 1e-6, worst
