"""pinfer: LLM inference on one machine built on activation locality (hot FFN neurons on the GPU, cold ones on the
CPU, each token's active neurons predicted so that only they are computed).

    pinfer_llm.formats    GGUF / PowerInfer files: reading, writing, pinfer's section, tokenizers
    pinfer_llm.planner    neuron placement as an integer program over the hardware
    pinfer_llm.runtime    the model: forward pass, FFN operators, GPU+CPU executor, profiling, serving
    pinfer_llm.synth      planted ReLU models for tests and benchmarks
    pinfer_llm.cli        the pi-* commands
"""

__version__ = "0.2.0"
