"""The hybrid executor's asynchronous copies under CUDA's timing rules (tests/strict_device.py): every result the host
reads has landed, no page-locked buffer is refilled while its copy may still read it, every copy is on the
executor's stream. ReferenceDevice copies at once, so these faults pass there and show only on a GPU."""

import numpy as np
import pytest
import torch

from pinfer_llm.planner.memory import GPU_CHUNK
from pinfer_llm.runtime import load_model
from pinfer_llm.runtime.gpu import ReferenceDevice
from pinfer_llm.runtime.hybrid import executor as hybrid
from pinfer_llm.runtime.hybrid.placement import Placement
from tests.strict_device import StreamOrderError, StrictStreams
from tests.test_hybrid import logits, random_placement, relu_pwri  # noqa: F401 (a fixture)


def test_the_strict_device_enforces_the_rules():
    dev = StrictStreams()
    s = dev.stream()
    d = dev.zeros((4,))
    h = dev.pinned((4,))
    with s:
        d.fill_(2.0)
        dev.to_host_async(d, h, s)
        assert np.isnan(h).all()  # not landed: poison
        ev = s.record()
        d.fill_(3.0)  # after the copy in stream order: not in what lands
        ev.synchronize()
        assert (h == 2.0).all()
        h[:] = 1.0
        dev.to_device_async(h, d, s)
        h[:] = 5.0  # refilled while the copy may still read it
        with pytest.raises(StreamOrderError, match="changed before the host waited"):
            s.synchronize()
        dev.to_host_async(d, h, s)
        h[0] = 0.0  # written while a copy into it is in flight
        with pytest.raises(StreamOrderError, match="wrote into its buffer"):
            dev.synchronize()
        dev.to_device_async(h, d, s)
        dev.to_host_async(d, h, s)  # a copy down over the bytes a copy up reads runs after it: allowed
        s.synchronize()
    with pytest.raises(StreamOrderError, match="other than the one"):
        dev.to_host_async(d, h, s)  # outside `with s:`


def whole_last(cfg, *, head: bool) -> Placement:
    """Attention on the GPU everywhere, every layer split but the last, which is wholly on the device: a pass ends
    with a copy up (the CPU's share of the layer before) that nothing waits for when the head is skipped."""
    L = cfg.n_layer
    buckets = [np.arange(0, cfg.n_ff, 2, dtype=np.int64)] * (L - 1) + [np.arange(cfg.n_ff, dtype=np.int64)]
    return Placement("test", np.ones(L, bool), np.ones(L, bool), buckets, head, "whole last layer")


def everything(cfg) -> Placement:
    """--placement gpu: a pass before the last sends the embeddings up and waits for nothing."""
    L = cfg.n_layer
    return Placement("test", np.ones(L, bool), np.ones(L, bool), [np.arange(cfg.n_ff, dtype=np.int64)] * L, True,
                     "everything")


PLACEMENTS = {**{f"random {s}": (lambda cfg, s=s: random_placement(cfg, s)) for s in range(4)},
              "whole last layer": lambda cfg: whole_last(cfg, head=False),
              "whole last layer, head on the GPU": lambda cfg: whole_last(cfg, head=True),
              "everything on the GPU": everything}


@pytest.mark.parametrize("mode", ["sparse", "dense", "oracle"])
@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_prompts_in_passes_and_decoding_keep_cudas_copy_order(relu_pwri, placement, mode):  # noqa: F811
    """A prompt of several passes (their heads skipped but the last's), then single tokens: the CPU's logits, with
    every copy landing before it is read and no buffer refilled under a copy."""
    path, cfg = relu_pwri
    ids = [int(t) for t in np.random.default_rng(11).integers(3, cfg.vocab_size, 2 * GPU_CHUNK + 5)]
    cpu = load_model(path, ffn_mode=mode, ctx_size=512)
    want = list(cpu.generate(ids, max_tokens=4, temperature=0.0))
    dev = StrictStreams()
    m = load_model(path, ffn_mode=mode, ctx_size=512)
    hybrid.apply(m, PLACEMENTS[placement](cfg), dev)
    assert list(m.generate(ids, max_tokens=4, temperature=0.0)) == want
    assert dev.landed["up"] and dev.landed["down"]
    # and the logits themselves, prefill and decode
    short = ids[:12]
    want_l = logits(load_model(path, ffn_mode=mode), short, decode_from=5)
    m = load_model(path, ffn_mode=mode)
    hybrid.apply(m, PLACEMENTS[placement](cfg), StrictStreams())
    got = logits(m, short, decode_from=5)
    assert np.abs(got - want_l).max() < 1e-3 * np.abs(want_l).max()


def test_the_reference_device_would_not_see_a_missing_wait(relu_pwri, monkeypatch):  # noqa: F811
    """Why the strict device exists: with the wait for a copy to the host taken out, the reference still gets the
    CPU's logits (its copies land at once); the strict device reads poison."""
    path, cfg = relu_pwri
    ids = [5, 9, 200, 31, 7, 11]
    want = logits(load_model(path, ffn_mode="sparse"), ids, decode_from=3)
    monkeypatch.setattr(hybrid.Link, "wait", lambda self: self.host)
    for dev, same in ((ReferenceDevice(), True), (StrictStreams(), False)):
        m = load_model(path, ffn_mode="sparse")
        hybrid.apply(m, random_placement(cfg, 1), dev)
        with torch.inference_mode():
            try:
                got = logits(m, ids, decode_from=3)
                ok = bool(np.abs(got - want).max() < 1e-3 * np.abs(want).max())
            except (StreamOrderError, RuntimeError, IndexError, ValueError):
                ok = False
        assert ok == same, type(dev).__name__
