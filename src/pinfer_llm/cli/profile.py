"""pi-profile: record activation statistics, calibrate CATS thresholds, train predictors, move PowerInfer files.

    pi-profile relu-model.gguf                                    # activation counts into the file (or -m MODEL)
    pi-profile relu-model.gguf --train-predictors -o with-preds.gguf
    pi-profile smollm2 --sparsity 0.3 --train-predictors -o /tmp/smollm2-cats.gguf
    pi-profile model.gguf --import-activations ReluLLaMA-7B/activation --import-predictors ReluLLaMA-7B-Predictor
    pi-profile model.gguf --export-activations out/activation

Everything is stored at the end, in one step: into the model itself (pinfer's section, formats/update.py: seconds
whatever the model's size, PowerInfer and llama.cpp load the file as before), or into a new file with -o. Whether
that write can happen is checked before any work; an error or a kill leaves the model as it was.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import sys
import time
from pathlib import Path
from typing import Annotated

import numpy as np
import typer

from pinfer_llm.cli import interrupts_raise
from pinfer_llm.cli.options import (
    SEED_MAX,
    U64_MAX,
    FfnAct,
    ModelArg,
    ModelOpt,
    at_least,
    checked_threads,
    pick_model,
    print_file_warnings,
    run_app,
    version_option,
)
from pinfer_llm.formats.errors import PinferError, report

app = typer.Typer(add_completion=False, rich_markup_mode=None, pretty_exceptions_enable=False,
                  context_settings={"help_option_names": ["-h", "--help"]})


DEFAULT_LADDER = (32, 64, 128, 256, 512, 1024, 2048)  # runtime.profiling.training's, without importing torch here


def parse_ladder(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise PinferError(f"--ladder must be comma-separated integers, got '{text}'") from None
    if not sizes or any(h < 32 or h % 32 for h in sizes):
        # a predictor's hidden width is fc2's row length: PowerInfer's quantize needs whole blocks of 32 there
        raise PinferError(f"--ladder sizes must be multiples of 32, got '{text}'")
    return sizes


class _Bar:
    """A rich progress bar on stderr (nothing when quiet)."""

    def __init__(self, quiet: bool):
        self.quiet, self.bar, self.tasks = quiet, None, {}

    def __enter__(self):
        if not self.quiet:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("{task.description:<22}"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), console=Console(stderr=True), transient=True)
            self.bar.__enter__()
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def callback(self, label: str):
        def advance(done: int, total: int):
            if self.bar is None:
                return
            if label not in self.tasks:
                self.tasks[label] = self.bar.add_task(label, total=total)
            self.bar.update(self.tasks[label], completed=done)
        return advance


def _check_options(o: dict) -> None:
    imports = o["import_activations"] or o["import_predictors"]
    if o["export_activations"] and (imports or o["train_predictors"] or o["corpus"] or o["sparsity"] is not None):
        raise PinferError("--export-activations writes the statistics already in the model and runs nothing else; "
                          "profile first, then export")
    if imports and (o["train_predictors"] or o["corpus"] or o["sparsity"] is not None):
        raise PinferError("--import-activations/--import-predictors take the data from PowerInfer files instead of "
                          "running the model; drop --corpus, --sparsity and --train-predictors")
    if o["import_predictors"] and not o["import_activations"] and o["tokens"] is not None:
        raise PinferError("--tokens with an import sets the token count of --import-activations only")
    if not 0.0 < o["recall"] < 1.0:
        raise PinferError(f"--recall must be between 0 and 1 (exclusive), got {o['recall']}")
    if not 0.0 < o["max_fraction"] <= 1.0:
        raise PinferError(f"--max-fraction must be in (0, 1], got {o['max_fraction']}")
    if o["ctx"] < 2:
        raise PinferError(f"--ctx must be at least 2, got {o['ctx']}")
    at_least("--tokens", o["tokens"], 1, U64_MAX)  # stored as a u64 (--import-activations)
    if o["store_down_t"] and o["export_activations"]:
        raise PinferError("--store-down-t writes into the model; --export-activations only reads it: run them apart")
    at_least("-t/--threads", o["threads"], 1)
    at_least("--seed", o["seed"], 0, SEED_MAX)
    at_least("--steps", o["steps"], 0)
    at_least("--sample-tokens", o["sample_tokens"], 1)
    if o["export_activations"]:
        parent = Path(o["export_activations"]).absolute().parent
        if parent.is_dir() and not os.access(parent, os.W_OK | os.X_OK):
            raise PinferError(f"cannot export into {o['export_activations']}: the directory {parent} is not writable")


def _check_sample_memory(cfg, sample: int, with_margin: bool, need: int) -> None:
    """Refuse, before the model runs, to keep more training pairs than memory holds (a 13B model's 8192 default
    tokens take ~12 GB: inputs in float32 plus int8 margins), naming the --sample-tokens that fits."""
    from pinfer_llm.runtime.profiling.counting import available_ram_bytes, sample_bytes

    avail = available_ram_bytes()
    want = sample_bytes(cfg.n_layer, cfg.n_embd, cfg.n_ff, sample, with_margin)
    if avail is None or want <= 0.7 * avail:
        return
    fits = int(sample * 0.7 * avail / want)
    least = sample_bytes(cfg.n_layer, cfg.n_embd, cfg.n_ff, need, with_margin)
    size = lambda b: f"{b / 2**30:.1f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"  # noqa: E731
    hint = (f"pass --sample-tokens {fits} (training needs at least {need})" if fits >= need else
            f"training needs at least {need} tokens ({size(least)}): free memory or use a larger machine")
    raise PinferError(f"keeping {sample} sampled tokens per layer for predictor training takes {size(want)}, more "
                      f"than 70% of the {size(avail)} available; {hint}")


def warn_kept_predictors(f, cfg) -> None:
    """Predictors the run keeps (it profiles dense, without them) that pi-run would refuse, NaN in fc2 or a shape
    that does not fit: one line, rather than copying them silently into the output (they once were, exit 0)."""
    from pinfer_llm.runtime.loader import check_predictors

    try:
        check_predictors(f, cfg)
    except PinferError as e:
        print(f"pi-profile: warning: {e}; they are kept as they are (sparse runs refuse them)", file=sys.stderr)


def run_profile(model: str, o: dict, quiet: bool) -> dict:
    """The whole command; returns the summary that is printed. Raises PinferError on bad input, before any write."""
    import torch

    from pinfer_llm.formats import constants as C
    from pinfer_llm.formats.config import config_from_gguf
    from pinfer_llm.formats.reader import open_gguf
    from pinfer_llm.formats.update import check_writable, store
    from pinfer_llm.runtime.engine import load_model, resolve_model_path
    from pinfer_llm.runtime.profiling import activity, corpus, powerinfer_dirs
    from pinfer_llm.runtime.profiling import store as profile_store
    from pinfer_llm.runtime.profiling import training as predictor_training
    from pinfer_llm.runtime.profiling.counting import profile

    _check_options(o)
    say = (lambda *a: None) if quiet else (lambda msg: print(msg, file=sys.stderr))
    path = resolve_model_path(model)
    f = open_gguf(path)
    print_file_warnings(f, "pi-profile")
    if not o["export_activations"]:
        check_writable(f, o["out"])  # before minutes of profiling, not after
    cfg = config_from_gguf(f, ffn_act=o["ffn_act"])
    profile_store.check_ffn_tensors(f, cfg)
    if not (o["train_predictors"] or o["import_predictors"] or o["export_activations"]):
        warn_kept_predictors(f, cfg)
    if o["threads"]:
        torch.set_num_threads(o["threads"])
    summary: dict = {"model": str(path), "out": None, "n_layer": cfg.n_layer, "n_ff": cfg.n_ff,
                     "ffn_act": cfg.ffn_act, "seconds": {}}

    if o["store_down_t"] and not o["export_activations"]:
        t0 = time.perf_counter()
        with _Bar(quiet) as bar:
            down = profile_store.transposed_down(f, cfg, progress=bar.callback("transposing ffn_down"))
        summary["seconds"]["store_down_t"] = round(time.perf_counter() - t0, 2)
        summary["down_t_bytes"] = int(sum(t.data.nbytes for t in down.values()))
    else:
        down = {}

    if o["export_activations"]:
        counts, tokens = profile_store.stored_counts(f, cfg)
        try:
            powerinfer_dirs.export_activations(counts, Path(o["export_activations"]))
        except OSError as e:  # a read-only filesystem, a full disk: what os.access cannot tell beforehand
            raise PinferError(f"cannot export into {o['export_activations']}: {e.strerror}") from None
        summary.update(exported=str(o["export_activations"]), tokens=tokens,
                       sparsity=(1 - counts.mean(axis=1) / max(tokens, 1)).round(6).tolist())
        return summary

    meta: dict = {}
    tensors: dict = dict(down)
    drop: list = []
    drop_tensors: list = []
    layers: list[dict] = [{"layer": i} for i in range(cfg.n_layer)]
    ffn_bytes = predictor_training.ffn_bytes_per_layer(f, cfg)

    if o["import_activations"] or o["import_predictors"]:
        if o["import_activations"]:
            counts = powerinfer_dirs.import_activations(Path(o["import_activations"]), cfg)
            tokens = o["tokens"]
            note = ""
            if tokens is None:  # PowerInfer's files do not record it; the hottest neuron's count is a lower bound
                tokens = max(int(np.ceil(counts.max())), 1)
                note = "; token count unknown, max count used (pass --tokens N)"
                say(f"pi-profile: warning: {o['import_activations']} does not record how many tokens were profiled; "
                    f"using the largest count ({tokens}), pass --tokens N if you know it")
            if counts.max() > tokens:
                raise PinferError(f"--tokens {tokens} is smaller than the largest count {int(counts.max())}")
            meta.update({C.ACT_TOKENS: np.uint64(tokens), C.ACT_DATE: _now(),
                         C.ACT_CORPUS: f"imported: PowerInfer {Path(o['import_activations']).name}/{note}",
                         C.ACT_RULE: "relu>0" if cfg.is_relu else "imported"})
            drop += [C.CATS_THRESHOLD, C.CATS_SPARSITY]
            # peaks recorded by an earlier profile describe other statistics: an outlier list that no longer matches
            # the counts would silently change which neurons sparse mode always computes
            drop_tensors += [C.tensor(C.ACT_PEAK, i) for i in range(cfg.n_layer)]
            tensors.update({C.tensor(C.ACT_COUNTS, i): counts[i].astype(np.float32) for i in range(cfg.n_layer)})
            summary["tokens"] = tokens
            for i, row in enumerate(layers):
                row["sparsity"] = float(1 - counts[i].mean() / tokens)
        if o["import_predictors"]:
            preds, thr = powerinfer_dirs.import_predictors(Path(o["import_predictors"]), cfg)
            source = f"imported: {Path(o['import_predictors']).name}"
            m, t, d = profile_store.predictor_entries(preds, thr, cfg.ffn_act, source)
            meta.update(m)
            tensors.update(t)
            drop += d
            summary["sparse_threshold"] = thr
            for p, row, fb in zip(preds, layers, ffn_bytes, strict=True):
                row.update(hidden=p.hidden, predictor_bytes=p.nbytes, bytes_pct=100 * p.nbytes / fb)
    else:
        rule = activity.activation_rule(cfg, o["sparsity"])  # refuses SwiGLU without --sparsity, before any work
        files = [Path(c) for c in o["corpus"]] or corpus.builtin_corpus()
        t0 = time.perf_counter()
        m = load_model(path, threads=o["threads"], ctx_size=o["ctx"], ffn_act=o["ffn_act"],
                       ffn_mode="dense")
        summary["seconds"]["load"] = round(time.perf_counter() - t0, 2)
        windows, desc = corpus.corpus_windows(m.tokenizer, files, o["ctx"], o["tokens"])
        n_tokens = sum(len(w) for w in windows)
        need = predictor_training.min_train_tokens(cfg.n_embd)
        sample = min(o["sample_tokens"], n_tokens) if o["train_predictors"] else 0
        if o["train_predictors"] and sample < need:
            what = f"{n_tokens} tokens in the corpus" if sample == n_tokens else f"--sample-tokens {sample}"
            raise PinferError(f"training predictors for this model needs at least {need} profiled tokens, "
                              f"{what}; pass more text with --corpus or raise --tokens")
        _check_sample_memory(cfg, sample, rule.has_margin, need)
        with _Bar(quiet) as bar:
            prof = profile(m, windows, rule, desc, sample_tokens=sample, sparsity=o["sparsity"], seed=o["seed"],
                             progress=bar.callback(f"profiling {n_tokens} tokens"))
            summary["seconds"]["profile"] = round(prof.seconds, 2)
            mm, tt, dd = profile_store.profile_entries(prof, cfg.n_layer)
            meta.update(mm)
            tensors.update(tt)
            drop += dd
            summary.update(tokens=prof.tokens, corpus=prof.corpus, rule=prof.rule.name)
            for i, row in enumerate(layers):
                row["sparsity"] = float(prof.sparsity[i])
                if prof.rule.thresholds is not None:
                    row["cats_threshold"] = float(prof.rule.thresholds[i])
            if o["train_predictors"]:
                del m  # the samples are all training needs
                t0 = time.perf_counter()
                preds, thr = predictor_training.train_predictors(
                    prof, ffn_bytes, o["recall"], o["ladder"], o["max_fraction"], o["steps"], o["seed"],
                    progress=bar.callback("training predictors"))
                summary["seconds"]["train"] = round(time.perf_counter() - t0, 2)
                mm, tt, dd = profile_store.predictor_entries(preds, thr, cfg.ffn_act, "pi-profile", o["recall"])
                meta.update(mm)
                tensors.update(tt)
                drop += dd
                summary.update(sparse_threshold=thr, recall_target=o["recall"])
                for p, row, fb in zip(preds, layers, ffn_bytes, strict=True):
                    row.update(hidden=p.hidden, predictor_bytes=p.nbytes, bytes_pct=100 * p.nbytes / fb,
                               recall=p.recall, precision=p.precision, predicted_density=p.density,
                               threshold=p.threshold)
            elif f.has(C.tensor(C.PRED_FC1, 0)) and cfg.ffn_act == "silu":
                say("pi-profile: warning: the file's predictors were kept; they were trained for the CATS "
                    "thresholds of an earlier run (retrain with --train-predictors)")

    t0 = time.perf_counter()
    dest = store(f, o["out"], set_metadata=meta, set_tensors=tensors, drop_keys=[k for k in drop if k not in meta],
                 drop_tensors=drop_tensors, progress=not quiet, close=True)
    summary["seconds"]["write"] = round(time.perf_counter() - t0, 2)
    summary["out"] = str(dest)
    summary["layers"] = layers
    summary["ffn_bytes_per_layer"] = ffn_bytes
    return summary


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def print_summary(s: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(highlight=False)
    if "exported" in s:
        con.print(f"exported {s['n_layer']} activation_N.pt files ({s['tokens']} tokens) to {s['exported']}")
        return
    rows = s["layers"]
    cols = [("layer", "layer", "{}"), ("sparsity", "sparsity", "{:.3f}"), ("CATS thr", "cats_threshold", "{:.4f}"),
            ("hidden", "hidden", "{}"), ("bytes % FFN", "bytes_pct", "{:.1f}"), ("recall", "recall", "{:.3f}"),
            ("precision", "precision", "{:.3f}"), ("predicted", "predicted_density", "{:.3f}")]
    cols = [c for c in cols if any(c[1] in r for r in rows)]
    title = f"{s['out']}: {s.get('tokens', '?')} tokens"
    if "recall_target" in s:
        title += f", recall target {s['recall_target']} (measured on held-out profiled tokens)"
    table = Table(title=title)
    for name, _, _ in cols:
        table.add_column(name, justify="right")
    for r in rows:
        table.add_row(*[fmt.format(r[key]) if key in r else "" for _, key, fmt in cols])
    con.print(table)
    if any("predictor_bytes" in r for r in rows):
        total = sum(r.get("predictor_bytes", 0) for r in rows)
        ffn = sum(s["ffn_bytes_per_layer"])
        con.print(f"predictors: {total / 2**20:.2f} MiB = {100 * total / ffn:.1f}% of the FFN weights; "
                  f"threshold {s.get('sparse_threshold')}")
    con.print("time: " + ", ".join(f"{k} {v:.1f} s" for k, v in s["seconds"].items()))


@app.command()
def run(
    model_arg: ModelArg = None,
    model_opt: ModelOpt = None,
    corpus: Annotated[list[Path] | None, typer.Option("--corpus", help="Calibration text file (repeatable); default: "
                      "the built-in corpus.")] = None,
    tokens: Annotated[int | None, typer.Option("--tokens", help="Profile at most N tokens (with "
                      "--import-activations: the token count the counts are over).")] = None,
    ctx: Annotated[int, typer.Option("--ctx", help="Tokens per window (each window is its own sequence).")] = 512,
    train_predictors: Annotated[bool, typer.Option("--train-predictors", help="Train a predictor per layer.")] = False,
    sparsity: Annotated[float | None, typer.Option("--sparsity", help="SwiGLU models: calibrate CATS thresholds for "
                        "this fraction of inactive neurons.")] = None,
    recall: Annotated[float, typer.Option("--recall", help="Fraction of active neurons the predictors must catch "
                      "on held-out tokens.")] = 0.95,
    ladder: Annotated[str, typer.Option("--ladder", help="Candidate predictor hidden sizes (multiples of 32).")]
    = ",".join(map(str, DEFAULT_LADDER)),
    max_fraction: Annotated[float, typer.Option("--max-fraction", help="Largest predictor size as a fraction of "
                            "the layer's FFN bytes.")] = 0.10,
    steps: Annotated[int, typer.Option("--steps", help="Most gradient steps refining each predictor.")] = 600,
    sample_tokens: Annotated[int, typer.Option("--sample-tokens", help="Tokens kept per layer as training pairs.")]
    = 8192,
    import_activations: Annotated[Path | None, typer.Option("--import-activations", help="PowerInfer activation/ "
                                  "directory (activation_N.pt) to store instead of profiling.")] = None,
    export_activations: Annotated[Path | None, typer.Option("--export-activations", help="Write the stored "
                                  "statistics as PowerInfer activation_N.pt files into this directory.")] = None,
    import_predictors: Annotated[Path | None, typer.Option("--import-predictors", help="PowerInfer predictor "
                                 "directory (model_N.pt) to store instead of training.")] = None,
    store_down_t: Annotated[bool, typer.Option("--store-down-t", help="Also store ffn_down transposed (neuron-major "
                            "rows, in the file's encoding) in the model, so that sparse runs of a file that has "
                            "only ffn_down (llama.cpp's layout) need not transpose it at every load.")] = False,
    out: Annotated[Path | None, typer.Option("-o", "--out", help="Write a new file instead of storing into MODEL.")]
    = None,
    threads: Annotated[int | None, typer.Option("-t", "--threads", help="CPU threads (default: all cores).")] = None,
    ffn_act: FfnAct = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed for token sampling and training.")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", help="Show tracebacks on errors.")] = False,
    version: version_option("pi-profile") = False,
) -> None:
    """Profile activations and train predictors for a model; store them in its GGUF."""
    try:
        interrupts_raise()  # here, not in main(): a Ctrl-C while typer parses is still one line
        model = pick_model(model_arg, model_opt)
        threads = checked_threads(threads, "pi-profile")  # capped to the cores, as pi-run's
        opts = dict(corpus=corpus or [], tokens=tokens, ctx=ctx, train_predictors=train_predictors,
                    sparsity=sparsity, recall=recall, ladder=parse_ladder(ladder), max_fraction=max_fraction,
                    steps=steps, sample_tokens=sample_tokens, import_activations=import_activations,
                    export_activations=export_activations, import_predictors=import_predictors, out=out,
                    threads=threads, ffn_act=ffn_act, seed=seed, store_down_t=store_down_t)
        summary = run_profile(model, opts, quiet=as_json)
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - every failure becomes one line
        raise typer.Exit(report(e, verbose, prog="pi-profile")) from None
    if as_json:
        print(json.dumps(summary))
    else:
        print_summary(summary)


def main() -> None:
    run_app(app, "pi-profile")


if __name__ == "__main__":
    main()
