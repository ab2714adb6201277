"""Options the pi-* commands share, defined once so that they describe them alike (llama.cpp's common/arg.cpp):
every CLI imports this module; library code never does.
"""

from __future__ import annotations

import math
import os
import signal
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
PlacementOpt = Annotated[str | None, typer.Option("--placement", help="With a GPU: plan (the default: the file's "
                                                  "plan, PowerInfer's .gpuidx, or one made now), or a baseline: "
                                                  "layers (as many whole layers as fit, as llama.cpp -ngl), "
                                                  "powerinfer, cpu, gpu.", show_default=False)]
NGpuLayers = Annotated[int | None, typer.Option("-ngl", "--n-gpu-layers", "--gpu-layers", metavar="N",
                                                help="With a GPU: N whole layers on it (the last ones), the rest "
                                                     "on the CPU, as llama.cpp's -ngl; more than the model has: all, "
                                                     "the output head too.", show_default=False)]
VramBudget = Annotated[float | None, typer.Option("--vram-budget", help="GiB of VRAM the model may use (default: "
                                                  "what is free, less 0.5 GiB).")]
KvType = Annotated[str, typer.Option("--kv-type", help="KV cache type on the CPU: f16 (as llama.cpp's default: half "
                                     "the memory and the bytes attention reads) or f32.")]
ModelArg = Annotated[str | None, typer.Argument(metavar="MODEL", show_default=False,
                                                help="GGUF or PowerInfer (PWRI) model file, or 'smollm2' for the "
                                                     "demo model (or -m MODEL).")]
ModelOpt = Annotated[str | None, typer.Option("-m", "--model", metavar="MODEL", show_default=False,
                                              help="The model, as llama.cpp takes it (instead of the MODEL "
                                                   "argument).")]


def pick_model(arg: str | None, opt: str | None) -> str:
    """The model from the MODEL argument or -m/--model: exactly one of them."""
    if arg is not None and opt is not None:
        raise PinferError(f"the model is given twice, as -m {opt} and as the argument '{arg}': pass one")
    if arg is None and opt is None:
        raise PinferError("no model: pass MODEL (a GGUF file, or 'smollm2' for the demo model) or -m MODEL")
    return arg if arg is not None else opt


def utf8(name: str, text: str | None) -> str | None:
    """A string from the command line: bytes that are not UTF-8 reach Python as lone surrogates, which the tokenizer
    cannot encode (`-p $'\\xff'` was an internal error; `pi-serve --host $'\\xff'` too)."""
    if text is not None:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            bad = text[e.start]
            shown = f"byte 0x{ord(bad) - 0xDC00:02x}" if 0xDC80 <= ord(bad) <= 0xDCFF else f"U+{ord(bad):04X}"
            raise PinferError(f"{name} is not valid UTF-8 ({shown} at character {e.start}); pass UTF-8 text") from None
    return text


def version_option(prog: str):
    """--version for `prog`: prints 'prog pinfer-llm X.Y.Z' and exits 0, whatever else is on the line."""
    def show(value: bool) -> None:
        if value:
            from pinfer_llm import __version__

            print(f"{prog} pinfer-llm {__version__}")
            raise typer.Exit()

    return Annotated[bool, typer.Option("--version", callback=show, is_eager=True, help="Print the version and exit.")]


def warn_ctx(m, ctx_size: int | None, prog: str) -> None:
    """A -c beyond the context the model was trained on: one line (llama.cpp warns too), the run goes on."""
    if ctx_size is not None and ctx_size > m.cfg.n_ctx_train:
        print(f"{prog}: warning: -c {ctx_size} is more than the {m.cfg.n_ctx_train} tokens the model was trained on "
              f"({m.cfg.arch}.context_length): quality degrades beyond them", file=sys.stderr)


def print_warnings(m, prog: str) -> None:
    """What loading could not do as asked (a GPU setting without a GPU) and what the file could not give (a damaged
    pinfer section), one line each."""
    for w in all_warnings(m):
        print(f"{prog}: warning: {w}", file=sys.stderr)


def all_warnings(m) -> list[str]:
    return [*m.file.warnings, *m.warnings]


def warn_stale_sidecar(m, prog: str) -> None:
    """PowerInfer reads <model>.generated.gpuidx: one line when it is not the placement of the model's plan."""
    from pinfer_llm.formats.gpuidx import gpuidx_path

    if gpuidx_path(m.file.path).is_file():
        from pinfer_llm.planner.planfile import sidecar_problem

        stale = sidecar_problem(m.file)
        if stale:
            print(f"{prog}: warning: {stale}", file=sys.stderr)


def print_file_warnings(f, prog: str) -> None:
    """A file's own warnings (formats.reader: a pinfer section ignored, old type ids), one line each."""
    for w in f.warnings:
        print(f"{prog}: warning: {w}", file=sys.stderr)


def checked_threads(threads: int | None, prog: str = "pi-run") -> int | None:
    """-t: at least 1; above the cores this process may run on, capped to them with a one-line warning (torch's
    spinning OpenMP threads on a shared core are many times slower, never faster; -t 1000000000 reached libgomp,
    which aborted allocating 216 GB for its pool, or hung, and 10^20 overflowed torch's int64)."""
    if threads is None:
        return None
    if threads < 1:
        raise PinferError(f"-t/--threads must be at least 1, got {threads}")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if threads > cores:
        print(f"{prog}: warning: -t {threads} is more than the {cores} cores this process may use; using {cores}",
              file=sys.stderr)
        return cores
    return threads


def positive(name: str, value: float | None, most: float = math.inf) -> None:
    """A finite number > 0 (and at most `most`), or None: nan and inf are refused here, where the option is named,
    rather than as "cannot convert float NaN to integer" deep in the planner."""
    if value is not None and not (0 < value <= most and math.isfinite(value)):
        bound = "" if most == math.inf else f" and at most {most:g}"
        raise PinferError(f"{name} must be a finite number above 0{bound}, got {value}")


def at_least(name: str, value: int | None, least: int, most: int | None = None) -> None:
    """An integer option in [least, most], or None."""
    if value is not None and (value < least or (most is not None and value > most)):
        bound = f"from {least} to {most}" if most is not None else f"at least {least}"
        raise PinferError(f"{name} must be {bound}, got {value}")


SEED_MAX = 2**32 - 1  # numpy's and torch's seeds are 32-bit
U64_MAX = 2**64 - 1  # token counts are stored as u64


def _click_errors() -> tuple[type[BaseException], ...]:
    """What click raises for a usage error: typer >= 0.20 vendors click (typer.TyperException is its errors' base),
    older typer uses the click package."""
    kinds: list[type[BaseException]] = [typer.TyperException] if hasattr(typer, "TyperException") else []
    try:
        import click

        kinds.append(click.ClickException)
    except ImportError:
        pass
    return tuple(kinds)


def run_app(app, prog: str, args: list[str] | None = None) -> None:
    """Run a command's typer app and exit with its status. A usage error (an unknown option, `-n nan`, a missing
    argument) is one line, `PROG: error: ...; see PROG --help`, exit status 2, as every other mistake is one line:
    click's own is a usage block of 4 lines, or a 6-line box under rich (pi-plan)."""
    try:
        rc = app(args=args, prog_name=prog, standalone_mode=False)
    except _click_errors() as e:
        if type(e).__name__ == "NoArgsIsHelpError":  # `pi-plan` alone: its help, as before
            e.show()
        else:
            ctx = getattr(e, "ctx", None)
            hint = f"; see {ctx.command_path if ctx is not None else prog} --help"
            msg = " ".join(e.format_message().split()).rstrip(".")
            print(f"{prog}: error: {PinferError(msg)}{hint}", file=sys.stderr)
        rc = getattr(e, "exit_code", 2)
    except (typer.Abort, RuntimeError) as e:  # click's Abort: EOF or Ctrl-C while it parses
        if type(e).__name__ != "Abort":
            raise
        print(f"{prog}: interrupted", file=sys.stderr)
        rc = 130
    from pinfer_llm.cli import _is_a_command

    if _is_a_command():
        # The command is done and its status decided: a Ctrl-C from here on is ignored. Python resets SIGINT to its
        # default action while it finalizes (its handlers gone), so one in those last milliseconds killed a finished
        # run (hostile_pass: rc -2 after pi-profile had written its file); an ignored signal stays ignored.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(rc if isinstance(rc, int) else 0)


def ffn_mode(sparse: bool, dense: bool, oracle: bool) -> str:
    if sum((sparse, dense, oracle)) > 1:
        raise PinferError("choose one of --sparse, --dense and --oracle-masks")
    return "sparse" if sparse else "dense" if dense else "oracle" if oracle else "auto"
