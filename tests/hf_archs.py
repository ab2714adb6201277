"""Tiny HF Falcon and OPT models converted to GGUF by test code, as llama.cpp's converter (falcon) and PowerInfer's
(opt, and its PWRI files for both) lay them out: shared by tests/test_hf_archs.py and tests/test_archs_sparse.py.

The conversions here are written from the converters' documented behaviour (tensor names, metadata keys, the falcon
QKV reordering, PowerInfer's ffn_down_t), not from their code, and nothing in the runtime is used to make them.
"""

from __future__ import annotations

import numpy as np
import torch
import transformers

from pinfer_llm.formats import constants as C
from pinfer_llm.formats.model_writer import byte_vocab
from pinfer_llm.formats.writer import write_gguf

VOCAB = 300

# Falcon layouts: (new_decoder_architecture, multi_query, num_kv_heads). 7B: one multi-query KV head and one norm;
# 40B: grouped KV heads and two norms (ln_attn, ln_mlp); "mha": no KV sharing, HF's per-head [q, k, v] interleave.
FALCON_CASES = {
    "7b_mqa_gelu": dict(new_arch=False, multi_query=True, n_kv=None, act="gelu", tied=True),
    "7b_mqa_relu": dict(new_arch=False, multi_query=True, n_kv=None, act="relu", tied=False),
    "40b_gqa_relu": dict(new_arch=True, multi_query=True, n_kv=2, act="relu", tied=False, eps=1e-3),
    "40b_gqa_gelu": dict(new_arch=True, multi_query=True, n_kv=2, act="gelu", tied=True),
    "mha_relu_bias": dict(new_arch=False, multi_query=False, n_kv=4, act="relu", tied=False, bias=True),
}


def _widen(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """HF's init is too gentle to exercise anything: wider weights, norms near 1, biases that matter."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name:
                p.copy_((1 if name.endswith("weight") else 0) + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
            else:
                p.normal_(0, 1.0 if "embed" in name else 0.08)
    return model.eval()


def make_falcon(case: str, seed: int = 0, n_layer: int = 2, d: int = 64, n_head: int = 4, n_ff: int = 160):
    c = FALCON_CASES[case]
    hcfg = transformers.FalconConfig(
        vocab_size=VOCAB, hidden_size=d, num_hidden_layers=n_layer, num_attention_heads=n_head,
        num_kv_heads=c["n_kv"], new_decoder_architecture=c["new_arch"], multi_query=c["multi_query"],
        parallel_attn=True, bias=c.get("bias", False), activation=c["act"], ffn_hidden_size=n_ff,
        layer_norm_epsilon=c.get("eps", 1e-5), max_position_embeddings=256, tie_word_embeddings=c["tied"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return _widen(transformers.FalconForCausalLM(hcfg), seed)


def falcon_kv_heads(hcfg) -> int:
    """The KV heads HF's FalconAttention really uses (multi_query without the new architecture: one)."""
    return hcfg.num_kv_heads if (hcfg.new_decoder_architecture or not hcfg.multi_query) else 1


def falcon_qkv_rows(w: np.ndarray, n_head: int, n_kv: int) -> np.ndarray:
    """HF's fused rows, kv group by kv group ([q heads of the group, k, v] per group), into llama.cpp's
    [all q | all k | all v]: the 'jploski' layout its converter writes. Works for weights and biases."""
    hd = w.shape[0] // (n_head + 2 * n_kv)
    g = w.reshape(n_kv, n_head // n_kv + 2, hd, *w.shape[1:])
    q = g[:, :-2].reshape(n_head * hd, *w.shape[1:])
    k = g[:, -2].reshape(n_kv * hd, *w.shape[1:])
    v = g[:, -1].reshape(n_kv * hd, *w.shape[1:])
    return np.concatenate([q, k, v])


def _sd(model) -> dict[str, np.ndarray]:
    return {k: v.detach().float().numpy() for k, v in model.state_dict().items()}


def falcon_tensors(hf) -> dict[str, np.ndarray]:
    """GGUF tensors of a FalconForCausalLM: llama.cpp's names (ln_mlp -> attn_norm, ln_attn -> attn_norm_2)."""
    h, sd = hf.config, _sd(hf)
    n_kv = falcon_kv_heads(h)
    w = {C.TOKEN_EMBD: sd["transformer.word_embeddings.weight"], C.OUTPUT_NORM: sd["transformer.ln_f.weight"],
         C.OUTPUT_NORM_B: sd["transformer.ln_f.bias"]}
    if not h.tie_word_embeddings:
        w[C.OUTPUT] = sd["lm_head.weight"]
    for i in range(h.num_hidden_layers):
        p, t = f"transformer.h.{i}.", (lambda name, i=i: C.tensor(name, i))
        if h.new_decoder_architecture:
            w[t(C.ATTN_NORM)], w[t(C.ATTN_NORM_B)] = sd[p + "ln_mlp.weight"], sd[p + "ln_mlp.bias"]
            w[t(C.ATTN_NORM_2)], w[t(C.ATTN_NORM_2_B)] = sd[p + "ln_attn.weight"], sd[p + "ln_attn.bias"]
        else:
            w[t(C.ATTN_NORM)] = sd[p + "input_layernorm.weight"]
            w[t(C.ATTN_NORM_B)] = sd[p + "input_layernorm.bias"]
        w[t(C.ATTN_QKV)] = falcon_qkv_rows(sd[p + "self_attention.query_key_value.weight"], h.num_attention_heads, n_kv)
        w[t(C.ATTN_OUT)] = sd[p + "self_attention.dense.weight"]
        w[t(C.FFN_UP)] = sd[p + "mlp.dense_h_to_4h.weight"]
        w[t(C.FFN_DOWN)] = sd[p + "mlp.dense_4h_to_h.weight"]
        if h.bias:
            w[t(C.ATTN_QKV_B)] = falcon_qkv_rows(sd[p + "self_attention.query_key_value.bias"],
                                                 h.num_attention_heads, n_kv)
            w[t(C.ATTN_OUT_B)] = sd[p + "self_attention.dense.bias"]
            w[t(C.FFN_UP_B)] = sd[p + "mlp.dense_h_to_4h.bias"]
            w[t(C.FFN_DOWN_B)] = sd[p + "mlp.dense_4h_to_h.bias"]
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in w.items()}


def falcon_metadata(hf) -> dict:
    """llama.cpp's falcon keys (convert_hf_to_gguf.py): no rope keys (base 10000), context 2048, the 'jploski'
    QKV layout. A ReLU Falcon is told by its name (config.detect_ffn_activation), as ReluFalcon's files are."""
    h = hf.config
    a = lambda key: C.arch_key(key, "falcon")  # noqa: E731
    name = "ReluFalcon" if h.activation == "relu" else "Falcon"  # the converter names the model by its directory
    return {C.ARCHITECTURE: "falcon", C.NAME: name, a(C.CONTEXT_LENGTH): 2048,
            a(C.EMBEDDING_LENGTH): h.hidden_size, a(C.FEED_FORWARD_LENGTH): h.ffn_hidden_size,
            a(C.BLOCK_COUNT): h.num_hidden_layers, a(C.HEAD_COUNT): h.num_attention_heads,
            a(C.HEAD_COUNT_KV): falcon_kv_heads(h), a(C.LAYER_NORM_EPS): float(h.layer_norm_epsilon),
            a(C.TENSOR_DATA_LAYOUT): "jploski"}


def make_opt(seed: int = 0, n_layer: int = 2, d: int = 64, n_head: int = 4, n_ff: int = 160, max_pos: int = 256):
    hcfg = transformers.OPTConfig(vocab_size=VOCAB, hidden_size=d, num_hidden_layers=n_layer, ffn_dim=n_ff,
                                  num_attention_heads=n_head, max_position_embeddings=max_pos,
                                  word_embed_proj_dim=d, do_layer_norm_before=True, activation_function="relu")
    return _widen(transformers.OPTForCausalLM(hcfg), seed)


def opt_tensors(hf, output: bool = False) -> dict[str, np.ndarray]:
    """GGUF tensors of an OPTForCausalLM under PowerInfer's opt names (fc1 -> ffn_up, fc2 -> ffn_down); output only
    when asked (the converter writes lm_head when the checkpoint stores it; OPT ties it to token_embd)."""
    h, sd = hf.config, _sd(hf)
    p0 = "model.decoder."
    w = {C.TOKEN_EMBD: sd[p0 + "embed_tokens.weight"], C.POS_EMBD: sd[p0 + "embed_positions.weight"],
         C.OUTPUT_NORM: sd[p0 + "final_layer_norm.weight"], C.OUTPUT_NORM_B: sd[p0 + "final_layer_norm.bias"]}
    if output:
        w[C.OUTPUT] = sd["lm_head.weight"]
    names = {C.ATTN_NORM: "self_attn_layer_norm", C.ATTN_Q: "self_attn.q_proj", C.ATTN_K: "self_attn.k_proj",
             C.ATTN_V: "self_attn.v_proj", C.ATTN_OUT: "self_attn.out_proj", C.FFN_NORM: "final_layer_norm",
             C.FFN_UP: "fc1", C.FFN_DOWN: "fc2"}
    for i in range(h.num_hidden_layers):
        for ours, theirs in names.items():
            name = C.tensor(ours, i)
            w[name] = sd[f"{p0}layers.{i}.{theirs}.weight"]
            w[name.replace(".weight", ".bias")] = sd[f"{p0}layers.{i}.{theirs}.bias"]
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in w.items()}


def opt_metadata(hf, powerinfer_keys: bool = False) -> dict:
    """PowerInfer's opt keys: no head_count_kv, no layer-norm epsilon, context 2050 (the position table's rows).
    powerinfer_keys False adds what a complete file would say (head_count_kv, epsilon)."""
    h = hf.config
    a = lambda key: C.arch_key(key, "opt")  # noqa: E731
    meta = {C.ARCHITECTURE: "opt", C.NAME: "opt", a(C.CONTEXT_LENGTH): h.max_position_embeddings + 2,
            a(C.EMBEDDING_LENGTH): h.hidden_size, a(C.BLOCK_COUNT): h.num_hidden_layers,
            a(C.FEED_FORWARD_LENGTH): h.ffn_dim, a(C.HEAD_COUNT): h.num_attention_heads}
    if not powerinfer_keys:
        meta.update({a(C.HEAD_COUNT_KV): h.num_attention_heads, a(C.LAYER_NORM_EPS): 1e-5})
    return meta


def to_powerinfer(w: dict[str, np.ndarray], n_layer: int, n_embd: int, n_ff: int, rank: int = 16,
                  seed: int = 1) -> dict[str, np.ndarray]:
    """PowerInfer's converter: ffn_down -> ffn_down_t (transposed; its bias renamed along with it), plus random
    predictors fc1/fc2 (F16)."""
    rng = np.random.default_rng(seed)
    out = dict(w)
    for i in range(n_layer):
        out[C.tensor(C.FFN_DOWN_T, i)] = np.ascontiguousarray(out.pop(C.tensor(C.FFN_DOWN, i)).T)
        if C.tensor(C.FFN_DOWN_B, i) in out:
            out[C.tensor(C.FFN_DOWN_T_B, i)] = out.pop(C.tensor(C.FFN_DOWN_B, i))
        out[C.tensor(C.PRED_FC1, i)] = (rng.standard_normal((rank, n_embd)) * 0.1).astype(np.float16)
        out[C.tensor(C.PRED_FC2, i)] = (rng.standard_normal((n_ff, rank)) * 0.1).astype(np.float16)
    return out


def write(path, meta: dict, tensors: dict, *, powerinfer: bool = False, tokenizer: dict | None = None):
    write_gguf(path, {**meta, **(tokenizer or byte_vocab(VOCAB))}, tensors, powerinfer=powerinfer)
    return path


def hf_logits(hf, ids) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([list(ids)])).logits[0].float().numpy()
