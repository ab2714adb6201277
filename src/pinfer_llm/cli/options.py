"""Options the pi-* commands share, defined once so that they describe them alike (llama.cpp's common/arg.cpp):
every CLI imports this module; library code never does.
"""

from __future__ import annotations

import os
import sys
from typing import Annotated

import typer

from pinfer_llm.formats.errors import PinferError

FfnAct = Annotated[str | None, typer.Option("--ffn-act", help="Override the FFN activation: silu, relu, drelu; "
                                            "Falcon, OPT: relu, gelu.")]
Sparse = Annotated[bool, typer.Option("--sparse", help="Compute only the neurons the predictors select (the default "
                                      "when the file has predictors).")]
Dense = Annotated[bool, typer.Option("--dense", help="Compute every FFN neuron.")]
OracleMasks = Annotated[bool, typer.Option("--oracle-masks", help="Sparse FFN with exact masks (ReLU: activation > 0; "
                                           "SwiGLU: the file's CATS thresholds). For debugging and benchmarks.")]
Gpu = Annotated[str, typer.Option("--gpu", help="auto (a CUDA GPU when CuPy finds one), none, cuda (insist), or "
                                  "reference (the CPU stand-in for the GPU, for testing).")]
PlacementOpt = Annotated[str, typer.Option("--placement", help="With a GPU: plan (the file's plan, PowerInfer's "
                                           ".gpuidx, or one made now), or a baseline: layers (llama.cpp -ngl), "
                                           "powerinfer, cpu, gpu.")]
VramBudget = Annotated[float | None, typer.Option("--vram-budget", help="GiB of VRAM the model may use (default: "
                                                  "what is free, less 0.5 GiB).")]
KvType = Annotated[str, typer.Option("--kv-type", help="KV cache type on the CPU: f16 (as llama.cpp's default: half "
                                     "the memory and the bytes attention reads) or f32.")]


def checked_threads(threads: int | None) -> int | None:
    """-t: at least 1; above the cores this process may run on, capped to them with a one-line warning (torch's
    spinning OpenMP threads on a shared core are many times slower, never faster)."""
    if threads is None:
        return None
    if threads < 1:
        raise PinferError(f"-t/--threads must be at least 1, got {threads}")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if threads > cores:
        print(f"pi-run: warning: -t {threads} is more than the {cores} cores this process may use; using {cores}",
              file=sys.stderr)
        return cores
    return threads


def ffn_mode(sparse: bool, dense: bool, oracle: bool) -> str:
    if sum((sparse, dense, oracle)) > 1:
        raise PinferError("choose one of --sparse, --dense and --oracle-masks")
    return "sparse" if sparse else "dense" if dense else "oracle" if oracle else "auto"
