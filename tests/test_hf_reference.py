"""Our forward pass against HF transformers' LlamaForCausalLM on the same fp32 weights, through pinfer's C++ kernels
and through torch's operators alone (the fallback when no compiler is found)."""


import numpy as np
import pytest
import torch
import transformers  # the test extra: a missing reference is a failure, not a skip

from pinfer_llm.formats import constants as C
from pinfer_llm.formats.model_writer import write_llama
from pinfer_llm.runtime import load_model
from tests.tiny import tiny_config


def gguf_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter: HF's half-split rotary layout -> GGUF's adjacent pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_to_gguf(hf, cfg) -> dict[str, np.ndarray]:
    sd = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    w = {C.TOKEN_EMBD: sd["model.embed_tokens.weight"], C.OUTPUT_NORM: sd["model.norm.weight"]}
    if not cfg.tied_embeddings:
        w[C.OUTPUT] = sd["lm_head.weight"]
    for i in range(cfg.n_layer):
        p = f"model.layers.{i}."
        t = lambda name, i=i: C.tensor(name, i)  # noqa: E731
        w[t(C.ATTN_NORM)] = sd[p + "input_layernorm.weight"]
        w[t(C.ATTN_Q)] = gguf_permute(sd[p + "self_attn.q_proj.weight"], cfg.n_head)
        w[t(C.ATTN_K)] = gguf_permute(sd[p + "self_attn.k_proj.weight"], cfg.n_head_kv)
        w[t(C.ATTN_V)] = sd[p + "self_attn.v_proj.weight"]
        w[t(C.ATTN_OUT)] = sd[p + "self_attn.o_proj.weight"]
        w[t(C.FFN_NORM)] = sd[p + "post_attention_layernorm.weight"]
        w[t(C.FFN_GATE)] = sd[p + "mlp.gate_proj.weight"]
        w[t(C.FFN_UP)] = sd[p + "mlp.up_proj.weight"]
        w[t(C.FFN_DOWN)] = sd[p + "mlp.down_proj.weight"]
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in w.items()}


def make_hf(cfg, seed=0):
    rope = {"rope_type": "linear" if cfg.rope_scale != 1.0 else "default", "rope_theta": cfg.rope_base}
    if cfg.rope_scale != 1.0:
        rope["factor"] = cfg.rope_scale
    hcfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd, intermediate_size=cfg.n_ff,
        num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_head_kv,
        rms_norm_eps=cfg.norm_eps, max_position_embeddings=cfg.n_ctx_train, tie_word_embeddings=cfg.tied_embeddings,
        rope_parameters=rope, attention_bias=False, mlp_bias=False)
    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(hcfg).eval()
    with torch.no_grad():  # default init is too gentle to exercise anything: widen it, randomise the norms
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.08 if "embed" not in name else 1.0)
    return hf


CASES = {
    "mha": dict(n_head=4, n_head_kv=4),
    "gqa": dict(n_head=4, n_head_kv=2),
    "mqa_rope_base": dict(n_head=4, n_head_kv=1, rope_base=500000.0),
    "rope_linear_scaling": dict(rope_scale=4.0),
    "tied_embedding": dict(tied_embeddings=True),
}


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers(tmp_path, case, kernels):
    cfg = tiny_config(**CASES[case])
    hf = make_hf(cfg)
    path = tmp_path / "m.gguf"
    write_llama(path, cfg, hf_to_gguf(hf, cfg))
    m = load_model(path, threads=2, kv_type="f32")
    assert m.cfg.tied_embeddings == cfg.tied_embeddings
    assert m.cfg.rope_scale == cfg.rope_scale and m.cfg.n_head_kv == cfg.n_head_kv
    ids = list(np.random.default_rng(1).integers(0, cfg.vocab_size, 48))
    ours = m.forward_logits(ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float().numpy()
    assert ours.shape == ref.shape == (48, cfg.vocab_size)
    assert np.abs(ours - ref).max() < 1e-4, np.abs(ours - ref).max()
    assert np.abs(ref).max() > 0.5  # the comparison is not between two near-zero tensors


@pytest.mark.parametrize("case", ["mha", "gqa", "mqa_rope_base", "rope_linear_scaling"])
def test_decode_steps_match_transformers(tmp_path, case, kernels):
    """Token-by-token decode (fp32 models run RMSNorm and attention as runtime/cpu/csrc ops for T = 1) against HF's
    logits for the same prefix."""
    cfg = tiny_config(**CASES[case])
    hf = make_hf(cfg)
    path = tmp_path / "m.gguf"
    write_llama(path, cfg, hf_to_gguf(hf, cfg))
    m = load_model(path, threads=2, kv_type="f32")
    ids = list(np.random.default_rng(2).integers(0, cfg.vocab_size, 24))
    tr = m.transformer
    assert tr.fused == (kernels == "kernels")
    with torch.inference_mode():
        ours = torch.cat([tr.forward(torch.tensor([t]), p) for p, t in enumerate(ids)]).numpy()
        ref = hf(torch.tensor([ids])).logits[0].float().numpy()
    assert np.abs(ours - ref).max() < 1e-4, np.abs(ours - ref).max()


@pytest.mark.parametrize("case", ["gqa", "mqa_rope_base"])
def test_f16_kv_cache(tmp_path, case, kernels):
    """The default KV cache is f16 (llama.cpp's): half the bytes of f32; prefill (torch attention over the rounded
    cache) and token-by-token decode (the C++ op reading f16) round keys and values alike, so they agree as closely as
    in f32; and the rounding moves HF's logits only slightly, never the greedy token."""
    cfg = tiny_config(**CASES[case])
    hf = make_hf(cfg)
    path = tmp_path / "m.gguf"
    write_llama(path, cfg, hf_to_gguf(hf, cfg))
    m = load_model(path, threads=2)
    tr = m.transformer
    assert tr.cache.k[0].dtype == tr.cache.v[0].dtype == torch.float16
    f32 = load_model(path, threads=2, kv_type="f32").transformer.cache.k[0]
    assert tr.cache.k[0].nbytes * 2 == f32.nbytes
    ids = list(np.random.default_rng(3).integers(0, cfg.vocab_size, 40))
    with torch.inference_mode():
        prefill = m.forward_logits(ids)
        decode = torch.cat([tr.forward(torch.tensor([t]), p) for p, t in enumerate(ids)]).numpy()
        ref = hf(torch.tensor([ids])).logits[0].float().numpy()
    assert np.abs(prefill - decode).max() < 1e-4, np.abs(prefill - decode).max()
    err = np.abs(prefill - ref).max() / np.abs(ref).max()
    assert 1e-6 < err < 5e-3, err  # rounded (not an f32 cache), and only slightly
    assert (prefill.argmax(-1) == ref.argmax(-1)).all()
