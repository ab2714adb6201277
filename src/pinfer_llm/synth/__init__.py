"""Synthetic ReLU LLMs with planted activation locality (see synth/generator.py for the mechanism).

    from pinfer_llm.synth import SynthSpec, generate, reference_forward
    generate("tiny.gguf", SynthSpec(n_layer=2, n_embd=64, n_ff=256))
    python -m pinfer_llm.synth OUT.gguf --preset tiny|small|1b|7b
"""

from pinfer_llm.synth.generator import (
           PRESETS,
           SynthResult,
           SynthSpec,
           generate,
           planted_frequencies,
           power_law_frequencies,
)
from pinfer_llm.synth.reference import measure_frequencies, reference_forward, target_frequencies

__all__ = ["PRESETS", "SynthResult", "SynthSpec", "generate", "measure_frequencies", "planted_frequencies",
           "power_law_frequencies", "reference_forward", "target_frequencies"]
