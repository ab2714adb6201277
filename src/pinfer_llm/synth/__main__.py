"""python -m pinfer_llm.synth OUT.gguf --preset tiny|small|1b|7b: write a synthetic ReLU LLM with planted locality."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

from pinfer_llm.formats.errors import PinferError, report
from pinfer_llm.synth.generator import PRESETS, SynthSpec, generate

# --- CLI -------------------------------------------------------------------------------------------------------------

app = typer.Typer(add_completion=False, help="Write a synthetic ReLU LLM with planted activation locality as a "
                                             "PowerInfer GGUF.")


@app.command()
def cli(
    out: Annotated[Path, typer.Argument(help="output .gguf path")],
    preset: Annotated[str, typer.Option(help=f"base shape: {', '.join(PRESETS)}")] = "tiny",
    n_layer: Annotated[int | None, typer.Option(help="layers (overrides the preset)")] = None,
    n_embd: Annotated[int | None, typer.Option(help="embedding width")] = None,
    n_ff: Annotated[int | None, typer.Option(help="FFN neurons per layer")] = None,
    n_head: Annotated[int | None, typer.Option(help="attention heads")] = None,
    n_head_kv: Annotated[int | None, typer.Option(help="key/value heads (GQA)")] = None,
    vocab: Annotated[str, typer.Option(help="auto | smollm2 | bytes")] = "auto",
    vocab_size: Annotated[int | None, typer.Option(help="pad the byte vocabulary to this size")] = None,
    dtype: Annotated[str, typer.Option(help="f32 | f16")] = "f32",
    sparsity: Annotated[float, typer.Option(help="planted mean fraction of inactive neurons")] = 0.9,
    skew: Annotated[float, typer.Option(help="power-law exponent of neuron frequencies over rank")] = 1.0,
    gate_rank: Annotated[int | None, typer.Option(help="rank of the gate rows' shared subspace (default n_embd/32; "
                                                  "0: isotropic)")] = None,
    gate_noise: Annotated[float, typer.Option(help="share of gate-row variance outside that subspace")] = 0.1,
    variant: Annotated[str, typer.Option(help="relu (ReGLU, arch llama) | drelu (arch bamboo) | falcon (ReluFalcon) | "
                                              "opt (ReLU OPT)")] = "relu",
    seed: Annotated[int, typer.Option(help="random seed")] = 0,
    calib_tokens: Annotated[int, typer.Option(help="calibration tokens per layer")] = 2048,
    logit_std: Annotated[float, typer.Option(help="std of the logits across the vocabulary")] = 6.5,
    verbose: Annotated[bool, typer.Option(help="tracebacks on errors")] = False,
):
    console = Console(stderr=True)
    try:
        if preset not in PRESETS:
            raise PinferError(f"synth: unknown preset '{preset}' (one of {', '.join(PRESETS)})")
        base = dict(zip(("n_layer", "n_embd", "n_ff", "n_head", "n_head_kv"), PRESETS[preset], strict=True))
        given = dict(n_layer=n_layer, n_embd=n_embd, n_ff=n_ff, n_head=n_head, n_head_kv=n_head_kv)
        base.update({k: v for k, v in given.items() if v is not None})
        if n_head is not None and n_head_kv is None:
            base["n_head_kv"] = n_head
        spec = SynthSpec(**base, vocab=vocab, vocab_size=vocab_size, dtype=dtype, sparsity=sparsity, skew=skew,
                         gate_rank=gate_rank, gate_noise=gate_noise,
                         variant=variant, seed=seed, calib_tokens=calib_tokens, logit_std=logit_std)
        res = generate(out, spec, progress=lambda m: console.print(f"[dim]{m}[/dim]"))
    except BaseException as e:  # noqa: BLE001
        raise typer.Exit(report(e, verbose, prog="synth")) from None
    table = Table(title=f"{res.path} ({res.n_params / 1e6:.1f}M parameters, {spec.dtype}, "
                        f"{res.seconds:.1f} s)")
    for col in ("layer", "target sparsity", "calibration sparsity", "corr(target, calib)"):
        table.add_column(col, justify="right")
    for i in range(spec.n_layer):
        corr = np.corrcoef(res.target_freq[i], res.calib_freq[i])[0, 1]
        table.add_row(str(i), f"{1 - res.target_freq[i].mean():.3f}", f"{1 - res.calib_freq[i].mean():.3f}",
                      f"{corr:.3f}")
    Console().print(table)
    Console().print(f"mean top-1 probability {res.top1_prob:.3f}; timings "
                    + ", ".join(f"{k} {v:.1f}s" for k, v in res.timings.items()))



def main():
    app()


if __name__ == "__main__":
    main()
