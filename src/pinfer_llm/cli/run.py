"""pi-run: load a GGUF/PWRI model and generate text, on the CPU or with a GPU. It reads as llama.cpp's llama-cli:

    pi-run smollm2                                   # on a terminal: the interactive chat
    pi-run -m smollm2 -p "Once upon a time" -n 64    # plain completion of the prompt
    pi-run smollm2 "Once upon a time"                # the same (a prompt after the model, as ollama takes it)
    echo "Once upon a time" | pi-run smollm2         # the prompt from stdin (so is -f -)
    pi-run -m model.gguf -cnv -sys "Be brief" -p "Hi"  # the chat, "Hi" its first message
    pi-run -m model.gguf --chat -p "Write a haiku about caches" --temp 0.7 -s 1   # one answer in the chat template
    pi-run -m model.gguf -ngl 99 -p "..."            # every layer on the GPU (without one: a warning, the CPU)
    pi-run -m model.gguf -p "Q: 2+2?" -r "Q:" -n -1  # until the end of the turn, a full context, or "Q:"
    pi-run -m model.gguf -p "..." --json

Options are checked before the model loads: a value out of range or a combination that cannot mean anything is a
one-line error naming the option. What cannot apply but leaves a sensible run (a GPU option without a GPU, -c beyond
the trained context, -t above the cores this process may use) is one warning line each, and the run goes on.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from pinfer_llm.cli import interrupts_raise
from pinfer_llm.cli.options import (
    Dense,
    FfnAct,
    Gpu,
    KvType,
    ModelArg,
    ModelOpt,
    NGpuLayers,
    OracleMasks,
    PlacementOpt,
    Sparse,
    VramBudget,
    all_warnings,
    checked_threads,
    ffn_mode,
    pick_model,
    print_warnings,
    run_app,
    utf8,
    version_option,
    warn_ctx,
    warn_stale_sidecar,
)
from pinfer_llm.cli.threads import BusyCores, fit_threads
from pinfer_llm.formats.errors import PinferError, report
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


def choose_mode(has_prompt: bool, *, chat: bool, conversation: bool, no_conversation: bool, system: bool,
                stdin_tty: bool) -> str:
    """What pi-run does with what it was given: "interactive" (the terminal chat), "chat" (one answer to the prompt
    in the chat template), "plain" (completion of the prompt) or "stdin" (no prompt given and stdin is not a
    terminal: the prompt is read from it, then as "chat" with --system, else "plain")."""
    if no_conversation and (chat or conversation):
        raise PinferError("-no-cnv asks for plain completion and --chat/-cnv for the chat: pass one")
    if no_conversation and system:
        raise PinferError("--system is the chat's system message, and -no-cnv asks for plain completion: drop one")
    if conversation or (chat and not has_prompt):
        return "interactive"
    if has_prompt:
        return "chat" if chat or system else "plain"
    if not stdin_tty:
        return "stdin"
    if no_conversation:
        raise PinferError("no prompt: pass -p TEXT or -f FILE, or pipe it in (with -no-cnv there is no chat)")
    return "interactive"  # as llama-cli and ollama on a terminal


def stdin_is_tty() -> bool:
    return sys.stdin is not None and sys.stdin.isatty()


def has_prompt(prompt: str | None, positional: str | None, file: Path | None) -> bool:
    """Whether -p, the PROMPT argument or -f gives the prompt: at most one of them may."""
    given = [n for n, v in (("-p", prompt), ("the PROMPT argument", positional), ("-f", file)) if v is not None]
    if len(given) > 1:
        raise PinferError(f"{' and '.join(given)} both give the prompt: pass one")
    return bool(given)


def prompt_text(prompt: str | None, positional: str | None, file: Path | None) -> str | None:
    """The prompt from -p, the PROMPT argument or -f (FILE, or - for stdin)."""
    if file is None:
        return prompt if prompt is not None else positional
    if str(file) == "-":
        return read_stdin()
    return chomp(read_text_file(file, "prompt file"))


def read_text_file(path: Path, what: str, strict: bool = True) -> str:
    """A text file's contents: a directory, a FIFO, a device, a binary file (NUL bytes) or, when strict, bytes that
    are not UTF-8 are one line each (formats/textfile.py; they were internal errors, hangs and exhausted memory)."""
    from pinfer_llm.formats.textfile import read_text

    return read_text(path, what, strict=strict)


def read_stdin() -> str:
    data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode()
    try:
        raw = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PinferError(f"stdin is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); pipe UTF-8 "
                          f"text") from None
    text = chomp(raw)
    if not text:
        raise PinferError("no prompt: stdin is empty; pass -p TEXT or -f FILE")
    return text


def chomp(text: str) -> str:
    """Without its one trailing newline (echo's, a text file's), as llama.cpp reads -f."""
    return text[:-2] if text.endswith("\r\n") else text[:-1] if text.endswith("\n") else text


@app.command()
def run(
    model_arg: ModelArg = None,
    prompt_arg: Annotated[str | None, typer.Argument(metavar="PROMPT", show_default=False,
                                                     help="Prompt text, as -p.")] = None,
    model_opt: ModelOpt = None,
    prompt: Annotated[str | None, typer.Option("-p", "--prompt", help="Prompt text.")] = None,
    file: Annotated[Path | None, typer.Option("-f", "--file", help="Read the prompt from a file (-: stdin).")] = None,
    n_predict: Annotated[int, typer.Option("-n", "--n-predict", help="Tokens to generate; -1: until the end of the "
                                           "turn or a full context.")] = 128,
    threads: Annotated[int | None, typer.Option("-t", "--threads", help="CPU threads (default: one per core that other "
                                                "processes leave free). More than the cores this process may use "
                                                "is capped to them, more than the free ones is warned about: "
                                                "surplus threads only wait for each other.")] = None,
    temp: Annotated[float, typer.Option("--temp", "--temperature", help="Temperature; 0 or less: greedy (as "
                                        "llama.cpp).")] = 0.8,
    top_k: Annotated[int, typer.Option("--top-k", help="Top-k sampling; 0 = off.")] = 40,
    top_p: Annotated[float, typer.Option("--top-p", help="Top-p (nucleus) sampling; 1.0 = off.")] = 0.95,
    min_p: Annotated[float, typer.Option("--min-p", help="Min-p sampling; 0 = off.")] = 0.05,
    repeat_penalty: Annotated[float, typer.Option("--repeat-penalty", help="Repetition penalty; 1.0 = off.")] = 1.0,
    repeat_last_n: Annotated[int, typer.Option("--repeat-last-n", help="Tokens the penalty looks back.")] = 64,
    seed: Annotated[int | None, typer.Option("-s", "--seed", help="RNG seed for sampling; -1 (or none): random.",
                                             show_default=False)] = None,
    ctx_size: Annotated[int | None, typer.Option("-c", "--ctx-size", help="Context length (KV cache size; default: "
                                                 "the trained one, at most 4096).", show_default=False)] = None,
    chat: Annotated[bool, typer.Option("--chat", help="Answer the prompt once, in the model's chat template; "
                                       "without a prompt, the interactive chat.")] = False,
    conversation: Annotated[bool, typer.Option("-i", "-cnv", "--interactive", "--conversation",
                                               help="The interactive chat (what pi-run MODEL on a terminal opens); "
                                                    "a prompt is its first message.")] = False,
    no_conversation: Annotated[bool, typer.Option("-no-cnv", "--no-conversation", help="Never the chat, only "
                                                  "completion (pi-run's way whenever there is a prompt).")] = False,
    system: Annotated[str | None, typer.Option("-sys", "--system", "--system-prompt", help="System message of the "
                                               "chat; with a prompt it implies --chat.")] = None,
    reverse_prompt: Annotated[list[str] | None, typer.Option("-r", "--reverse-prompt", metavar="TEXT",
                                                             help="Stop generating at TEXT, which is not printed "
                                                                  "(repeatable); in the chat it ends the answer.")]
    = None,
    ffn_act: FfnAct = None,
    sparse: Sparse = False,
    dense: Dense = False,
    oracle_masks: OracleMasks = False,
    gpu: Gpu = "auto",
    n_gpu_layers: NGpuLayers = None,
    placement: PlacementOpt = None,
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
    version: version_option("pi-run") = False,
) -> None:
    """Generate text with a GGUF model: a completion, one chat answer, or the interactive chat."""
    try:
        interrupts_raise()  # here, not in main(): a Ctrl-C while typer parses is still one line
        model = pick_model(model_arg, model_opt)
        mode = ffn_mode(sparse, dense, oracle_masks)
        threads = checked_threads(threads)
        if ctx_size is not None and ctx_size < 1:
            raise PinferError(f"-c/--ctx-size must be at least 1 token, got {ctx_size}")
        if n_predict < -1:
            raise PinferError(f"-n must be >= 0, or -1 (until the end of the turn), got {n_predict}")
        seed = None if seed == -1 else seed  # llama.cpp's -s -1: a random seed
        for name, text in (("-p", prompt), ("PROMPT", prompt_arg), ("-sys", system), *(("-r", r) for r in
                                                                                      reverse_prompt or [])):
            utf8(name, text)
        # checked before the model loads (generate checks them again)
        SamplingParams(temp, top_k, top_p, min_p, repeat_penalty, repeat_last_n, seed)
        if not 1e-3 <= repeat_penalty <= 1e3:  # 1e-300 divided the logits into inf, then NaN probabilities
            raise PinferError(f"--repeat-penalty must be from 0.001 to 1000 (1: off), got {repeat_penalty}")
        gpu_opts = dict(gpu=gpu, placement=placement, vram_budget=vram_budget, kv_type=kv_type,
                        n_gpu_layers=n_gpu_layers)
        if perplexity_file is not None:
            generating = [name for name, given in (("-p", prompt), ("PROMPT", prompt_arg), ("-f", file),
                                                   ("--chat", chat), ("-cnv", conversation), ("--system", system),
                                                   ("-r", reverse_prompt), ("--gpu-timing", gpu_timing)) if given]
            if generating:
                raise PinferError(f"--perplexity scores a text file and generates nothing: drop "
                                  f"{', '.join(generating)}")
            return run_perplexity(model, perplexity_file, threads, ctx_size, ffn_act, mode, as_json, gpu_opts)
        what = choose_mode(has_prompt(prompt, prompt_arg, file), chat=chat, conversation=conversation,
                           no_conversation=no_conversation, system=system is not None, stdin_tty=stdin_is_tty())
        if what == "interactive":
            if as_json:
                raise PinferError("--json prints one answer, and the interactive chat has many: pass a prompt "
                                  "(-p TEXT) for one")
            if file is not None and str(file) == "-":
                raise PinferError("-f - reads the prompt from stdin, where the chat reads its turns: pass the "
                                  "first message with -p")
        text = prompt_text(prompt, prompt_arg, file)
        if what == "stdin":
            text, what = read_stdin(), ("chat" if system is not None else "plain")
        from pinfer_llm.runtime import load_model
        from pinfer_llm.runtime.cpu import kernels as cpu_kernels

        say = (lambda msg: None) if as_json else (lambda msg: print(f"pi-run: {msg}", file=sys.stderr))
        cores = BusyCores()  # measured over the load
        m = load_model(model, threads=threads, ctx_size=ctx_size, ffn_act=ffn_act, ffn_mode=mode,
                       gpu_timing=gpu_timing, say=say, **gpu_opts)
        print_warnings(m, "pi-run")
        warn_stale_sidecar(m, "pi-run")
        warn_ctx(m, ctx_size, "pi-run")
        if not as_json:
            print_notices(m)
        fit_threads("pi-run", m, threads is not None, cores)
        sampling = dict(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty,
                        repeat_last_n=repeat_last_n, seed=seed)
        max_tokens = m.ctx_size if n_predict == -1 else n_predict  # the context ends it before that
        stops = reverse_prompt or []
        if what == "interactive":
            return run_chat(m, system, max_tokens, sampling, first=text, stop=stops,
                            asked=chat or conversation)
        from pinfer_llm.runtime.generation.textgen import TextGeneration

        gen = TextGeneration(m, build_prompt(m, text, what == "chat", system), stop=stops, max_tokens=max_tokens,
                             **sampling)
        if as_json:
            out = "".join(gen)
            stopped_by(m, gen)
            print(json.dumps({"model": str(m.file.path), "prompt": text, "text": out, "tokens": gen.tokens,
                              "timings": m.stats.as_dict(), "ffn_mode": m.ffn_mode,
                              "ffn_active_fraction": active_fraction(m), "cpu_kernels": cpu_kernels.status(),
                              "kv_type": m.kv_type, "ctx_size": m.ctx_size, "notices": m.notices,
                              "warnings": all_warnings(m), "hybrid": m.hybrid_report()},
                             ensure_ascii=False))
            return
        if what == "plain":
            sys.stdout.write(text)
        for delta in gen:
            sys.stdout.write(delta)
            sys.stdout.flush()
        sys.stdout.write("\n")
        stopped_by(m, gen)
        print_summary(m)
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - every failure becomes one line
        raise typer.Exit(report(e, verbose, prog="pi-run")) from None


def stopped_by(m, gen) -> None:
    """A reverse prompt that ended the text is the stop reason the summary and --json give."""
    if gen.stop_string is not None:
        m.stats.stop_reason = "reverse prompt"


def run_chat(m, system: str | None, n_predict: int, sampling: dict, first: str | None = None,
             stop: list[str] | None = None, asked: bool = True) -> None:
    from pinfer_llm.cli.chat import chat_loop

    if not m.tokenizer.chat_template:
        if not asked:  # pi-run MODEL on a terminal
            raise PinferError("this model has no chat template (tokenizer.chat_template), so there is no chat: pass "
                              "a prompt with -p TEXT")
        raise PinferError("this model has no tokenizer.chat_template, so it cannot chat; run without --chat/-cnv, "
                          "with -p TEXT")
    if stdin_is_tty():
        import readline  # noqa: F401 - line editing and history for input()
    chat_loop(m, system, n_predict, sampling, first=first, stop=stop or ())


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

    text = read_text_file(path, "text file for --perplexity", strict=False)
    window = ctx_size or 512
    say = (lambda msg: None) if as_json else (lambda msg: print(f"pi-run: {msg}", file=sys.stderr))
    m = load_model(model, threads=threads, ctx_size=window, ffn_act=ffn_act, ffn_mode=mode, say=say, **gpu_opts)
    print_warnings(m, "pi-run")
    warn_ctx(m, ctx_size, "pi-run")
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
    run_app(app, "pi-run")


if __name__ == "__main__":
    main()
