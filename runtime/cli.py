"""pi-run: load a GGUF/PWRI model and generate text on the CPU.

    pi-run smollm2 -p "Once upon a time" -n 64
    pi-run model.gguf --chat -p "Write a haiku about caches" --temp 0.7 --seed 1
    pi-run model.gguf -p "..." --json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from formats.errors import PinferError, report

app = typer.Typer(add_completion=False, rich_markup_mode=None, pretty_exceptions_enable=False,
                  context_settings={"help_option_names": ["-h", "--help"]})


class TextStream:
    """Turns a growing token list into printable text deltas: a token may end inside a multi-byte character, so
    text ending in U+FFFD is held back until the character completes."""

    def __init__(self, tokenizer):
        self.tok, self.ids, self.sent = tokenizer, [], 0

    def push(self, tok: int) -> str:
        self.ids.append(tok)
        text = self.tok.decode(self.ids, skip_special=True)
        if text.endswith("\ufffd"):
            return ""
        delta, self.sent = text[self.sent:], len(text)
        return delta

    @property
    def text(self) -> str:
        return self.tok.decode(self.ids, skip_special=True)


def build_prompt(m, prompt: str, chat: bool, system: str | None) -> list[int]:
    from .chat import encode_chat

    if not chat:
        return m.tokenizer.encode(prompt)
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return encode_chat(m.tokenizer, messages)


def print_summary(m) -> None:
    from rich.console import Console

    st, con = m.stats, Console(stderr=True, highlight=False, soft_wrap=True)
    con.print(f"[bold]load[/]   {st.load_s:6.2f} s       {Path(m.file.path).name}, {m.cfg.n_layer} layers, "
              f"ctx {m.ctx_size}, {m.threads} threads")
    con.print(f"[bold]prompt[/] {st.prompt_tps:6.1f} tok/s   {st.prompt_tokens} tokens in {st.prompt_s:.2f} s")
    con.print(f"[bold]decode[/] {st.decode_tps:6.1f} tok/s   {st.decode_tokens} tokens in {st.decode_s:.2f} s "
              f"({st.stop_reason})")
    frac = active_fraction(m)
    if frac is not None:
        con.print(f"[bold]ffn[/]    {m.ffn_mode}: {frac:.1%} of neurons computed per token and layer")


@app.command()
def run(
    model: Annotated[str, typer.Argument(help="GGUF or PowerInfer (PWRI) model file, or 'smollm2' for the demo "
                                               "model.")],
    prompt: Annotated[str | None, typer.Option("-p", "--prompt", help="Prompt text.")] = None,
    file: Annotated[Path | None, typer.Option("-f", "--file", help="Read the prompt from a file.")] = None,
    n_predict: Annotated[int, typer.Option("-n", "--n-predict", help="Tokens to generate.")] = 128,
    threads: Annotated[int | None, typer.Option("-t", "--threads", help="CPU threads (default: all cores).")] = None,
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
    dtype: Annotated[str, typer.Option("--dtype", help="Activations and dequantised weights: f32, bf16, f16.")] = "f32",
    ffn_act: Annotated[str | None, typer.Option("--ffn-act", help="Override the FFN activation: silu, relu, drelu.")]
    = None,
    sparse: Annotated[bool, typer.Option("--sparse", help="Compute only the neurons the predictors select (the "
                                         "default when the file has predictors).")] = False,
    dense: Annotated[bool, typer.Option("--dense", help="Compute every FFN neuron.")] = False,
    oracle_masks: Annotated[bool, typer.Option("--oracle-masks", help="Sparse FFN with exact masks (ReLU: activation "
                                               "> 0; SwiGLU: the file's CATS thresholds). For debugging and "
                                               "benchmarks.")] = False,
    perplexity_file: Annotated[Path | None, typer.Option("--perplexity", help="Measure perplexity over a text file "
                                                         "(windows of --ctx-size, default 512) instead of generating.")]
    = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print text and timings as one JSON object.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", help="Show tracebacks on errors.")] = False,
) -> None:
    """Generate text with a GGUF model on the CPU."""
    try:
        mode = ffn_mode(sparse, dense, oracle_masks)
        if perplexity_file is not None:
            return run_perplexity(model, perplexity_file, threads, ctx_size, dtype, ffn_act, mode, as_json)
        if file is not None:
            if not file.exists():
                raise PinferError(f"{file}: no such prompt file")
            prompt = file.read_text(encoding="utf-8")
        sampling = dict(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty,
                        repeat_last_n=repeat_last_n, seed=seed)
        if prompt is None and chat:
            return run_chat(model, threads, ctx_size, dtype, ffn_act, mode, system, n_predict, sampling)
        if prompt is None:
            raise PinferError("no prompt: pass -p TEXT or -f FILE")
        if n_predict < 0:
            raise PinferError(f"-n must be >= 0, got {n_predict}")
        from runtime import cpu_kernels, load_model

        m = load_model(model, threads=threads, ctx_size=ctx_size, dtype=dtype, ffn_act=ffn_act, ffn_mode=mode)
        ids = build_prompt(m, prompt, chat, system)
        stream = TextStream(m.tokenizer)
        gen = m.generate(ids, max_tokens=n_predict, **sampling)
        if as_json:
            for tok in gen:
                stream.push(tok)
            print(json.dumps({"model": str(m.file.path), "prompt": prompt, "text": stream.text,
                              "tokens": stream.ids, "timings": m.stats.as_dict(), "ffn_mode": m.ffn_mode,
                              "ffn_active_fraction": active_fraction(m), "cpu_kernels": cpu_kernels.status()},
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


def run_chat(model, threads, ctx_size, dtype, ffn_act, mode: str, system, n_predict: int, sampling: dict) -> None:
    from runtime import load_model

    from .chat import chat_loop

    if n_predict < 0:
        raise PinferError(f"-n must be >= 0, got {n_predict}")
    m = load_model(model, threads=threads, ctx_size=ctx_size, dtype=dtype, ffn_act=ffn_act, ffn_mode=mode)
    if not m.tokenizer.chat_template:
        raise PinferError("this model has no tokenizer.chat_template, so it cannot chat; run without --chat")
    if sys.stdin.isatty():
        import readline  # noqa: F401 - line editing and history for input()
    chat_loop(m, system, n_predict, sampling)


def ffn_mode(sparse: bool, dense: bool, oracle: bool) -> str:
    if sum((sparse, dense, oracle)) > 1:
        raise PinferError("choose one of --sparse, --dense and --oracle-masks")
    return "sparse" if sparse else "dense" if dense else "oracle" if oracle else "auto"


def active_fraction(m) -> float | None:
    s = m.sparsity()
    return None if s is None else round(sum(s) / len(s), 4)


def run_perplexity(model, path: Path, threads, ctx_size, dtype, ffn_act, mode: str, as_json: bool) -> None:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from runtime import load_model
    from runtime.perplexity import perplexity

    if not path.exists():
        raise PinferError(f"{path}: no such text file for --perplexity")
    text = path.read_text(encoding="utf-8", errors="replace")
    window = ctx_size or 512
    m = load_model(model, threads=threads, ctx_size=window, dtype=dtype, ffn_act=ffn_act, ffn_mode=mode)
    con = Console(stderr=True)
    with Progress(TextColumn("perplexity"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=con, transient=True, disable=as_json) as bar:
        task = bar.add_task("ppl", total=None)
        res = perplexity(m, text, window, progress=lambda i, n: bar.update(task, completed=i, total=n))
    frac = active_fraction(m)
    if as_json:
        print(json.dumps({"model": str(m.file.path), "file": str(path), "ffn_mode": m.ffn_mode,
                          "ffn_active_fraction": frac} | res.as_dict()))
        return
    extra = f", FFN {m.ffn_mode}" + (f", {frac:.1%} of neurons computed" if frac is not None else "")
    print(f"perplexity: {res.ppl:.4f} +/- {res.stderr:.4f}  ({res.tokens_scored} tokens scored in {res.windows} "
          f"windows of {res.ctx}, {res.seconds:.1f} s{extra})")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
