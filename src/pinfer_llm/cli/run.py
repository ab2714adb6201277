"""pi-run: load a GGUF/PWRI model and generate text on the CPU.

    pi-run smollm2 -p "Once upon a time" -n 64
    pi-run model.gguf --chat -p "Write a haiku about caches" --temp 0.7 --seed 1
    pi-run model.gguf -p "..." --json

Options are checked before the model loads: a value out of range is a one-line error naming the option and its
range. -t above the cores this process may use is capped to them with a warning (surplus threads only wait).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from pinfer_llm.cli.options import (
    Dense,
    FfnAct,
    Gpu,
    KvType,
    OracleMasks,
    PlacementOpt,
    Sparse,
    VramBudget,
    checked_threads,
    ffn_mode,
)
from pinfer_llm.cli.threads import BusyCores, warn_if_busy
from pinfer_llm.formats.errors import PinferError, report
from pinfer_llm.runtime.generation.stream import TextStream
from pinfer_llm.runtime.sampling import SamplingParams

app = typer.Typer(add_completion=False, rich_markup_mode=None, pretty_exceptions_enable=False,
                  context_settings={"help_option_names": ["-h", "--help"]})




def build_prompt(m, prompt: str, chat: bool, system: str | None) -> list[int]:
    from pinfer_llm.runtime.generation.chat import encode_chat

    if not chat:
        return m.tokenizer.encode(prompt)
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return encode_chat(m.tokenizer, messages)


def load_parts(st) -> str:
    """Where the load's seconds went: Python and its imports, the CPU kernels (built on a machine's first run, else
    loaded from the cache) and the model itself (header, tokenizer, mapping the weights)."""
    kernels = f"CPU kernels {st.kernels_s:.2f} s" + (" (built, once)" if st.kernels_built else "")
    return f"import {st.import_s:.2f} s + {kernels} + model {st.load_s - st.kernels_s:.2f} s"


def print_summary(m) -> None:
    from rich.console import Console

    st, con = m.stats, Console(stderr=True, highlight=False, soft_wrap=True)
    con.print(f"[bold]load[/]   {st.import_s + st.load_s:6.2f} s       {load_parts(st)}; {Path(m.file.path).name}, "
              f"{m.cfg.n_layer} layers, ctx {m.ctx_size}, {m.threads} threads")
    con.print(f"[bold]prompt[/] {st.prompt_tps:6.1f} tok/s   {st.prompt_tokens} tokens in {st.prompt_s:.2f} s")
    con.print(f"[bold]decode[/] {st.decode_tps:6.1f} tok/s   {st.decode_tokens} tokens in {st.decode_s:.2f} s "
              f"({st.stop_reason})")
    frac = active_fraction(m)
    if frac is not None:
        con.print(f"[bold]ffn[/]    {m.ffn_mode}: {frac:.1%} of neurons computed per token and layer")
    h = m.hybrid_report()
    if h is not None:
        p, t = h["placement"], h["per_token"]
        con.print(f"[bold]gpu[/]    {h['gpu']}: {p['name']} ({p['source']}), {h['vram_bytes'] / 2**30:.2f} GiB; "
                  f"attention of {p['attention_on_gpu']} layers, {p['gpu_neurons']:,} neurons on the GPU")
        if t:
            con.print(f"[bold]split[/]  per token: CPU {t['cpu_ms']:.2f} ms, waiting for the GPU "
                      f"{t['gpu_wait_ms']:.2f} ms, copies {t['transfer_ms']:.2f} ms")
            if "gpu_compute_ms" in t:
                con.print(f"[bold]device[/] per token: computing {t['gpu_compute_ms']:.2f} ms, copying "
                          f"{t['gpu_copy_ms']:.2f} ms")




@app.command()
def run(
    model: Annotated[str, typer.Argument(help="GGUF or PowerInfer (PWRI) model file, or 'smollm2' for the demo "
                                               "model.")],
    prompt: Annotated[str | None, typer.Option("-p", "--prompt", help="Prompt text.")] = None,
    file: Annotated[Path | None, typer.Option("-f", "--file", help="Read the prompt from a file.")] = None,
    n_predict: Annotated[int, typer.Option("-n", "--n-predict", help="Tokens to generate.")] = 128,
    threads: Annotated[int | None, typer.Option("-t", "--threads", help="CPU threads (default: all cores). More than "
                                                "the cores this process may use is capped to them, with a warning: "
                                                "surplus threads only wait for each other.")] = None,
    temp: Annotated[float, typer.Option("--temp", help="Temperature; 0 = greedy.")] = 0.8,
    top_k: Annotated[int, typer.Option("--top-k", help="Top-k sampling; 0 = off.")] = 40,
    top_p: Annotated[float, typer.Option("--top-p", help="Top-p (nucleus) sampling; 1.0 = off.")] = 0.95,
    min_p: Annotated[float, typer.Option("--min-p", help="Min-p sampling; 0 = off.")] = 0.05,
    repeat_penalty: Annotated[float, typer.Option("--repeat-penalty", help="Repetition penalty; 1.0 = off.")] = 1.0,
    repeat_last_n: Annotated[int, typer.Option("--repeat-last-n", help="Tokens the penalty looks back.")] = 64,
    seed: Annotated[int | None, typer.Option("--seed", help="RNG seed for sampling.")] = None,
    ctx_size: Annotated[int | None, typer.Option("-c", "--ctx-size", help="Context length (KV cache size).")] = None,
    chat: Annotated[bool, typer.Option("--chat", help="Wrap the prompt in the model's chat template; without -p or "
                                       "-f, an interactive conversation in the terminal.")] = False,
    system: Annotated[str | None, typer.Option("--system", help="System message for --chat.")] = None,
    ffn_act: FfnAct = None,
    sparse: Sparse = False,
    dense: Dense = False,
    oracle_masks: OracleMasks = False,
    gpu: Gpu = "auto",
    placement: PlacementOpt = "plan",
    vram_budget: VramBudget = None,
    kv_type: KvType = "f16",
    gpu_timing: Annotated[bool, typer.Option("--gpu-timing", help="With a GPU: also measure its own time per token "
                                             "(computing, copying) with CUDA events; costs host time per GPU "
                                             "operation.")] = False,
    perplexity_file: Annotated[Path | None, typer.Option("--perplexity", help="Measure perplexity over a text file "
                                                         "(windows of --ctx-size, default 512) instead of generating.")]
    = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print text and timings as one JSON object.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", help="Show tracebacks on errors.")] = False,
) -> None:
    """Generate text with a GGUF model on the CPU."""
    try:
        mode = ffn_mode(sparse, dense, oracle_masks)
        threads = checked_threads(threads)
        if ctx_size is not None and ctx_size < 1:
            raise PinferError(f"-c/--ctx-size must be at least 1 token, got {ctx_size}")
        if perplexity_file is not None:
            return run_perplexity(model, perplexity_file, threads, ctx_size, ffn_act, mode, as_json,
                                  dict(gpu=gpu, placement=placement, vram_budget=vram_budget, kv_type=kv_type))
        if file is not None:
            if not file.exists():
                raise PinferError(f"{file}: no such prompt file")
            prompt = file.read_text(encoding="utf-8")
        if prompt is None and not chat:  # --chat without a prompt is the interactive chat
            raise PinferError("no prompt: pass -p TEXT or -f FILE")
        if n_predict < 0:
            raise PinferError(f"-n must be >= 0, got {n_predict}")
        # checked before the model loads (generate checks them again)
        SamplingParams(temp, top_k, top_p, min_p, repeat_penalty, repeat_last_n, seed)
        from pinfer_llm.runtime import load_model
        from pinfer_llm.runtime.cpu import kernels as cpu_kernels

        say = (lambda msg: None) if as_json else (lambda msg: print(f"pi-run: {msg}", file=sys.stderr))
        cores = BusyCores()  # measured over the load
        m = load_model(model, threads=threads, ctx_size=ctx_size, ffn_act=ffn_act, ffn_mode=mode, gpu=gpu,
                       placement=placement, vram_budget=vram_budget, kv_type=kv_type, gpu_timing=gpu_timing, say=say)
        if not as_json:
            print_notices(m)
        warn_if_busy("pi-run", m.threads, cores)
        sampling = dict(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty,
                        repeat_last_n=repeat_last_n, seed=seed)
        if prompt is None:
            return run_chat(m, system, n_predict, sampling)
        ids = build_prompt(m, prompt, chat, system)
        stream = TextStream(m.tokenizer)
        gen = m.generate(ids, max_tokens=n_predict, **sampling)
        if as_json:
            for tok in gen:
                stream.push(tok)
            print(json.dumps({"model": str(m.file.path), "prompt": prompt, "text": stream.text,
                              "tokens": stream.ids, "timings": m.stats.as_dict(), "ffn_mode": m.ffn_mode,
                              "ffn_active_fraction": active_fraction(m), "cpu_kernels": cpu_kernels.status(),
                              "kv_type": m.kv_type, "ctx_size": m.ctx_size, "notices": m.notices,
                              "hybrid": m.hybrid_report()},
                             ensure_ascii=False))
            return
        if not chat:
            sys.stdout.write(prompt)
        for tok in gen:
            sys.stdout.write(stream.push(tok))
            sys.stdout.flush()
        sys.stdout.write("\n")
        print_summary(m)
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - every failure becomes one line
        raise typer.Exit(report(e, verbose, prog="pi-run")) from None


def run_chat(m, system: str | None, n_predict: int, sampling: dict) -> None:
    from pinfer_llm.cli.chat import chat_loop

    if not m.tokenizer.chat_template:
        raise PinferError("this model has no tokenizer.chat_template, so it cannot chat; run without --chat")
    if sys.stdin.isatty():
        import readline  # noqa: F401 - line editing and history for input()
    chat_loop(m, system, n_predict, sampling)






def active_fraction(m) -> float | None:
    s = m.sparsity()
    return None if s is None else round(sum(s) / len(s), 4)


def print_notices(m) -> None:
    for n in m.notices:
        print(f"pi-run: note: {n}", file=sys.stderr)


def run_perplexity(model, path: Path, threads, ctx_size, ffn_act, mode: str, as_json: bool, gpu_opts: dict) -> None:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from pinfer_llm.runtime import load_model
    from pinfer_llm.runtime.perplexity import perplexity

    if not path.exists():
        raise PinferError(f"{path}: no such text file for --perplexity")
    text = path.read_text(encoding="utf-8", errors="replace")
    window = ctx_size or 512
    say = (lambda msg: None) if as_json else (lambda msg: print(f"pi-run: {msg}", file=sys.stderr))
    m = load_model(model, threads=threads, ctx_size=window, ffn_act=ffn_act, ffn_mode=mode, say=say, **gpu_opts)
    if not as_json:
        print_notices(m)
    con = Console(stderr=True)
    with Progress(TextColumn("perplexity"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=con, transient=True, disable=as_json) as bar:
        task = bar.add_task("ppl", total=None)
        res = perplexity(m, text, window, progress=lambda i, n: bar.update(task, completed=i, total=n))
    frac = active_fraction(m)
    if as_json:
        print(json.dumps({"model": str(m.file.path), "file": str(path), "ffn_mode": m.ffn_mode,
                          "ffn_active_fraction": frac, "notices": m.notices} | res.as_dict()))
        return
    extra = f", FFN {m.ffn_mode}" + (f", {frac:.1%} of neurons computed" if frac is not None else "")
    print(f"perplexity: {res.ppl:.4f} +/- {res.stderr:.4f}  ({res.tokens_scored} tokens scored in {res.windows} "
          f"windows of {res.ctx}, {res.seconds:.1f} s{extra})")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
