"""The hybrid's GPU attention under the RoPE settings of real models: Llama-3's base 500000 and linear scaling 2
(CodeLlama's 1e6 base and the scaled long-context files take the same path). Every other hybrid test uses base
10000 and scale 1, where dropping the model's settings in the device layers would go unnoticed.
"""

from __future__ import annotations

import numpy as np
import pytest
from cuda_emu import fake_cupy

from pinfer_llm.formats.model_writer import write_llama
from pinfer_llm.runtime import load_model
from pinfer_llm.runtime.gpu import CudaDevice, ReferenceDevice
from tests.strict_device import StrictStreams
from tests.test_hybrid import hybrid_model, logits, split_placement
from tests.tiny import random_weights, tiny_config, to_powerinfer_layout


@pytest.fixture(scope="module")
def scaled_rope(tmp_path_factory):
    cfg = tiny_config(ffn_act="relu", n_layer=2, n_ff=128, rope_base=500000.0, rope_scale=2.0)
    path = tmp_path_factory.mktemp("rope") / "rope.gguf"
    write_llama(path, cfg, to_powerinfer_layout(cfg, random_weights(cfg, seed=5, scale=0.15)), powerinfer=True)
    return path, cfg


@pytest.mark.parametrize("device", ["reference", "strict", "emulated kernels"])
def test_device_attention_uses_the_models_rope_base_and_scale(scaled_rope, device):
    path, cfg = scaled_rope
    assert load_model(path).cfg.rope_base == 500000.0 and load_model(path).cfg.rope_scale == 2.0
    dev = {"reference": ReferenceDevice, "strict": StrictStreams,
           "emulated kernels": lambda: CudaDevice(cupy=fake_cupy)}[device]()
    ids = [int(t) for t in np.random.default_rng(1).integers(3, cfg.vocab_size, 24)]
    cpu = load_model(path, ffn_mode="oracle")
    hyb = hybrid_model(path, "oracle", split_placement(cfg, attn_on_gpu=True, output=True), dev)
    for decode_from in (None, 20):  # one prefill; then decode steps at positions 20-23
        want, got = logits(cpu, ids, decode_from), logits(hyb, ids, decode_from)
        assert np.abs(got - want).max() < 1e-3 * np.abs(want).max(), (device, decode_from)
