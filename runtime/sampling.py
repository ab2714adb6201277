"""Token samplers, built once per generation as a closure (the mlx-lm way).

Order follows llama.cpp's default chain: repetition penalty -> top-k -> top-p -> min-p -> temperature -> draw.
temperature <= 0 is greedy (argmax after the penalty).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0  # 1.0 = off
    repeat_last_n: int = 64
    seed: int | None = None


def make_sampler(p: SamplingParams) -> Callable[[torch.Tensor, Sequence[int]], int]:
    gen = torch.Generator()
    gen.manual_seed(p.seed if p.seed is not None else torch.seed())

    def penalize(logits: torch.Tensor, history: Sequence[int]) -> torch.Tensor:
        if p.repeat_penalty == 1.0 or not history or p.repeat_last_n == 0:
            return logits
        recent = torch.tensor(sorted(set(history[-p.repeat_last_n:])), dtype=torch.long)
        vals = logits[recent]
        # llama.cpp/CTRL rule: shrink positive logits, push negative ones further down
        logits = logits.clone()
        logits[recent] = torch.where(vals > 0, vals / p.repeat_penalty, vals * p.repeat_penalty)
        return logits

    def sample(logits: torch.Tensor, history: Sequence[int] = ()) -> int:
        logits = penalize(logits.float(), history)
        if p.temperature <= 0:
            return int(torch.argmax(logits))
        if 0 < p.top_k < logits.numel():
            logits, ids = torch.topk(logits, p.top_k)
        else:
            logits, ids = torch.sort(logits, descending=True)
        probs = torch.softmax(logits, dim=-1)
        keep = torch.ones_like(probs, dtype=torch.bool)
        if p.top_p < 1.0:
            # keep the smallest prefix whose mass reaches top_p (always at least one token)
            before = torch.cumsum(probs, dim=-1) - probs
            keep &= before < p.top_p
        if p.min_p > 0.0:
            keep &= probs >= p.min_p * probs[0]
        keep[0] = True
        logits = logits[keep] / p.temperature
        choice = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen)
        return int(ids[keep][choice])

    return sample
