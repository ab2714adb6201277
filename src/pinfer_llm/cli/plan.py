"""pi-plan: place a model's FFN neurons and dense blocks between GPU(s) and CPU for the fastest predicted decoding.

    pi-plan MODEL --gpu rtx4090                    plan, write it into MODEL, print the per-layer table and summary
    pi-plan compare MODEL --gpu rtx4090 --gpu t4   one row per GPU (a+b: two GPUs in one host)
    pi-plan skeleton llama2-70b -o 70b.gguf        a weightless model of a known shape with synthetic statistics
    pi-plan show MODEL | apply MODEL --from FILE | gpus | calibration
    pi-plan -m MODEL --gpu rtx4090                 -m MODEL as llama.cpp takes it, wherever MODEL is; -h on each command

The typer commands are thin: plan_model, compare_gpus and friends below are plain functions tests call directly.
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import numpy as np
import typer
from rich.console import Console

from pinfer_llm.cli import interrupts_raise
from pinfer_llm.cli.options import (
    SEED_MAX,
    U64_MAX,
    ModelOpt,
    at_least,
    pick_model,
    positive,
    print_file_warnings,
    run_app,
    version_option,
)
from pinfer_llm.formats import constants as C
from pinfer_llm.formats import reader
from pinfer_llm.formats.errors import PinferError, report
from pinfer_llm.formats.gpuidx import placement_fingerprint
from pinfer_llm.planner import report as out
from pinfer_llm.planner.activations import load_activations
from pinfer_llm.planner.baselines import Baseline, all_baselines
from pinfer_llm.planner.hardware import Hardware, gpu_table, lookup_gpu
from pinfer_llm.planner.ilp import OBJECTIVES, SOLVERS, Solution, solve
from pinfer_llm.planner.machine import resolve_hardware
from pinfer_llm.planner.memory import account, check_ctx_size
from pinfer_llm.planner.planfile import (
    copy_plan,
    export_gpuidx,
    fingerprint,
    gpuidx_path,
    plan_metadata,
    read_plan,
    sidecar_problem,
    write_plan,
)
from pinfer_llm.planner.problem import DEFAULT_GROUP, KV_TYPES, Problem, build_problem

PROG = "pi-plan"
COMMANDS = ("plan", "compare", "skeleton", "show", "apply", "gpus", "calibration")

app = typer.Typer(name=PROG, add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  context_settings={"help_option_names": ["-h", "--help"]},
                  help="Place a model's FFN neurons and dense blocks between GPU(s) and CPU for speed. "
                       "`pi-plan MODEL --gpu NAME` is `pi-plan plan MODEL --gpu NAME`.")


@app.callback()
def _group(version: version_option(PROG) = False) -> None:
    pass


# --- plain functions ----------------------------------------------------------------------------------------------

def open_gguf(path):
    """The model opened, its warnings (a damaged pinfer section ignored) said once on stderr."""
    f = reader.open_gguf(path)
    print_file_warnings(f, PROG)
    return f


@dataclass
class PlanResult:
    problem: Problem
    solution: Solution
    baselines: dict[str, Baseline]
    fingerprint: str
    written: Path | None = None
    gpuidx: Path | None = None

    def to_dict(self) -> dict:
        return out.plan_dict(self.problem, self.solution, self.baselines, self.written, self.gpuidx,
                             self.fingerprint)


def plan_model(model: str | Path, hw: Hardware, *, ctx_size: int | None = None, act_dir: str | Path | None = None,
               act_tokens: int | None = None, objective: str = "time", group: int = DEFAULT_GROUP,
               solver: str = "cbc", time_limit: float = 30.0, gap: float = 1e-3, exact: bool = False,
               output: str | Path | None = None, write: bool = True, export: bool = False, kv_type: str = "f16",
               status=contextlib.nullcontext) -> PlanResult:
    """Solve, check and (unless write=False) write a plan; everything is validated before anything is written."""
    if not hw.gpus:
        raise PinferError("no GPU given: pass --gpu NAME (see `pi-plan gpus`) or a --hw file with a [[gpu]] table")
    if objective not in OBJECTIVES:
        raise PinferError(f"unknown --objective '{objective}' (one of {', '.join(OBJECTIVES)})")
    check_ctx_size(ctx_size)
    f = open_gguf(model)
    p = build_problem(f, hw, ctx_size=ctx_size, act_dir=act_dir, act_tokens=act_tokens, group=group,
                      kv_type=kv_type)
    baselines = all_baselines(p)
    fixed = baselines["powerinfer"].plan if objective == "hot-mass" else None
    with status(f"solving the placement ILP ({p.model.n_layer} layers, {solver})"):
        sol = solve(p, objective, solver, time_limit, gap, fixed_dense=fixed, exact=exact, baselines=baselines)
    if not sol.evaluation.fits:  # the ILP's constraints make this impossible; never write such a plan
        raise PinferError(f"internal: the solved plan does not fit ({'; '.join(sol.evaluation.problems)})")
    fp = fingerprint(f)
    result = PlanResult(p, sol, baselines, fp)
    if not (write or export):
        return result
    masks, buckets = sol.plan.gpu_masks(p.order), sol.plan.gpu_buckets(p.order)
    meta = plan_metadata(p, sol.plan, objective=objective, status=sol.status, gap=sol.gap, solver=solver,
                         solve_s=sol.build_s + sol.solve_s, tokens_per_s=sol.evaluation.tokens_per_s,
                         vram_used=sol.evaluation.vram, fp=fp,
                         baselines={k: (1 / b.time if b.time else None) for k, b in baselines.items()})
    if export:  # the plan records the sidecar it goes with: a kill between the two writes leaves a detectable pair
        ffn_bytes = sum(int(lb.neuron_bytes(k)) for lb, k in zip(p.model.layers, sol.plan.n_gpu, strict=True))
        meta[C.PLAN_GPUIDX] = placement_fingerprint(masks, ffn_bytes)
    if write:
        result.written = write_plan(f, masks, buckets, meta, dest=output)
    if export:
        result.gpuidx = export_gpuidx(gpuidx_path(result.written or model), masks, buckets, ffn_bytes, fp)
    return result


def compare_gpus(model: str | Path, gpus: list[str], *, hw_options: dict | None = None,
                 ctx_size: int | None = None, act_dir: str | Path | None = None, act_tokens: int | None = None,
                 group: int = DEFAULT_GROUP, solver: str = "cbc", time_limit: float = 30.0, gap: float = 1e-3,
                 kv_type: str = "f16", progress=None) -> dict:
    """One row per GPU (or `a+b` for several GPUs in one host), all with the same CPU. Writes nothing."""
    if not gpus:
        raise PinferError("compare needs at least one --gpu NAME (see `pi-plan gpus`)")
    check_ctx_size(ctx_size)
    specs = [gpu_spec(spec) for spec in gpus]
    for names in specs:  # every name first, so a typo fails before minutes of solving
        for n in names:
            lookup_gpu(n)
    hw_options = hw_options or {}
    f = open_gguf(model)
    if kv_type not in KV_TYPES:
        raise PinferError(f"unknown --kv-type '{kv_type}' (one of {', '.join(KV_TYPES)})")
    m = account(f, ctx_size, KV_TYPES[kv_type])
    load_activations(f, m.n_ff, act_dir, act_tokens)  # bad statistics stop the comparison before any solving
    rows, cpu = [], None
    for names in specs:
        label = "+".join(names)
        if progress:
            progress(label)
        hw = resolve_hardware(names, **hw_options)
        cpu = hw.cpu
        try:
            p = build_problem(f, hw, ctx_size=ctx_size, act_dir=act_dir, act_tokens=act_tokens, group=group,
                              kv_type=kv_type)
            baselines = all_baselines(p)
            sol = solve(p, "time", solver, time_limit, gap, baselines=baselines)
            rows.append(out.compare_row(label, p, sol, baselines))
        except PinferError as exc:
            # Problems with the model or the options stop the comparison; one GPU being too small does not.
            msg = str(exc)
            if not (msg.startswith("VRAM budget") or msg.startswith("infeasible")):
                raise
            rows.append({"gpu": label, "error": msg, "vram_budget": sum(g.budget_bytes for g in hw.gpus)})
    return {"model": {"path": str(m.path), "name": m.name, "quant": m.quant, "n_layer": m.n_layer,
                      "ctx_size": m.ctx_size, "skeleton": m.skeleton},
            "cpu": f"{cpu.cores}-core CPU at {cpu.mem_bw_gbs:.0f} GB/s, {cpu.host_ram_gib:.0f} GiB"
                   + (" (calibrated)" if cpu.calibrated else ""),
            "rows": rows}


def gpu_spec(spec: str) -> list[str]:
    """`NAME` or `NAME+NAME+...` (several GPUs in one host) as a list of names; empty names are an error."""
    names = [n.strip() for n in spec.split("+")]
    if not all(names):
        raise PinferError(f"--gpu '{spec}' has an empty GPU name; write NAME, or NAME+NAME for GPUs in one host "
                          f"(see `pi-plan gpus`)")
    return names


def show_plan(model: str | Path) -> dict:
    f = open_gguf(model)
    stored = read_plan(f)
    stale = sidecar_problem(f)
    if stale:
        print(f"{PROG}: warning: {stale}", file=sys.stderr)
    meta = stored.meta
    n_gpus = max(len(meta.get("pinfer.plan.gpus", []) or []), 1)
    layers = [{"layer": b, "attn": out.device(int(stored.plan.attn[b]), n_gpus),
               "gpu_neurons": int(stored.plan.n_gpu[b]), "n_ff": int(len(stored.masks[b]))}
              for b in range(stored.plan.n_layer)]
    plain = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in meta.items()}
    return {"model": str(f.path), "meta": plain, "layers": layers}


# --- the commands -------------------------------------------------------------------------------------------------

def _console() -> Console:
    # Piped output gets 120 columns rather than rich's 80, so the tables do not wrap in logs.
    return Console(highlight=False, width=None if sys.stdout.isatty() else 120)


@contextlib.contextmanager
def _errors(verbose: bool):
    """Every failure becomes one line on stderr and a non-zero exit (a traceback only with --verbose). From here on
    Ctrl-C raises KeyboardInterrupt (reported as one line below); before, while typer parses, cli's early handler
    says `pi-plan: interrupted` (typer itself turned a KeyboardInterrupt there into a silent 130, or a traceback)."""
    try:
        interrupts_raise()
        yield
    except (typer.Exit, typer.Abort, SystemExit):  # SystemExit: SIGTERM, see main
        raise
    except BaseException as exc:  # noqa: BLE001 - the CLI boundary reports everything
        raise typer.Exit(report(exc, verbose, prog=PROG)) from None


def _status(enabled: bool):
    if not enabled:
        return contextlib.nullcontext

    def status(msg: str):
        return Console(stderr=True).status(msg)

    return status


MAX_CORES = 4096  # more is a typo: 10^9 cores made libgomp abort allocating 216 GB for its thread pool


def _solve_options(time_limit: float, act_tokens: int | None) -> None:
    positive("--time-limit", time_limit)
    at_least("--act-tokens", act_tokens, 1)


GpuOpt = Annotated[list[str] | None, typer.Option("--gpu", help="GPU from the table (repeat for several GPUs in "
                                                                    "one host); see `pi-plan gpus`")]
VramOpt = Annotated[float | None, typer.Option("--vram-budget", help="VRAM per GPU for the model, GiB "
                                                                       "(default: the card's memory less 0.5 GiB)")]
PcieOpt = Annotated[float | None, typer.Option("--pcie-bw", help="effective host<->GPU bandwidth, GB/s")]
CoresOpt = Annotated[int | None, typer.Option("--cpu-cores", help="CPU cores (default: detected)")]
CpuBwOpt = Annotated[float | None, typer.Option("--cpu-bw", help="CPU memory bandwidth, GB/s (default: "
                                                                   "measured once and cached)")]
RamOpt = Annotated[float | None, typer.Option("--host-ram", help="host RAM, GiB (default: detected)")]
KvOpt = Annotated[str, typer.Option("--kv-type", help="KV cache element type: f16 (pi-run's default, llama.cpp, "
                                                     "PowerInfer), f32 (pi-run --kv-type f32) or q8_0")]
CtxOpt = Annotated[int | None, typer.Option("--ctx-size", help="context size; its KV cache counts against "
                                                                  "memory (default: the model's)")]
HwOpt = Annotated[Path | None, typer.Option("--hw", help="TOML file describing the machine: cpu, pcie and engine "
                                                        "tables, a gpu array of tables")]
ActOpt = Annotated[Path | None, typer.Option("--activations", help="PowerInfer activation/ directory "
                                                                     "(activation_N.pt) instead of the file's "
                                                                     "statistics")]
ActTokOpt = Annotated[int | None, typer.Option("--act-tokens", help="tokens the activation counts were "
                                                                      "gathered over")]
GroupOpt = Annotated[int, typer.Option("--group", help="neurons per group in the ILP (1: every neuron)")]
SolverOpt = Annotated[str, typer.Option("--solver", help=f"MILP solver: {' or '.join(SOLVERS)}")]
TimeOpt = Annotated[float, typer.Option("--time-limit", help="solver time limit, seconds")]
GapOpt = Annotated[float, typer.Option("--gap", help="relative optimality gap to stop at")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print JSON for scripts")]
CalOpt = Annotated[bool, typer.Option("--calibration/--no-calibration",
                                      help="use this machine's cached pi-run calibration for the detected CPU")]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="traceback on errors")]


def _hw(vram_budget, pcie_bw, cpu_cores, cpu_bw, host_ram, hw_file, calibration) -> dict:
    for name, value in (("--vram-budget", vram_budget), ("--pcie-bw", pcie_bw), ("--cpu-bw", cpu_bw),
                        ("--host-ram", host_ram)):
        positive(name, value)
    at_least("--cpu-cores", cpu_cores, 1, MAX_CORES)
    return dict(vram_budget_gib=vram_budget, pcie_bw_gbs=pcie_bw, cpu_cores=cpu_cores, cpu_bw_gbs=cpu_bw,
                host_ram=host_ram, hw_file=hw_file, calibration=calibration)


def _model(help: str):
    """A command's MODEL argument: optional, as -m MODEL may give it instead."""
    return Annotated[str | None, typer.Argument(metavar="MODEL", show_default=False, help=f"{help} (or -m MODEL)")]


StatsModel = _model("GGUF model (or skeleton) with activation statistics")


@app.command("plan")
def plan_cmd(
    model_arg: StatsModel = None, model_opt: ModelOpt = None,
    gpu: GpuOpt = None, vram_budget: VramOpt = None, pcie_bw: PcieOpt = None, cpu_cores: CoresOpt = None,
    cpu_bw: CpuBwOpt = None, host_ram: RamOpt = None, ctx_size: CtxOpt = None, kv_type: KvOpt = "f16",
    hw: HwOpt = None, activations: ActOpt = None, act_tokens: ActTokOpt = None,
    objective: Annotated[str, typer.Option("--objective", help="time: minimum predicted time per token; hot-mass: "
                                                               "PowerInfer's objective, for comparison")] = "time",
    group: GroupOpt = DEFAULT_GROUP, solver: SolverOpt = "cbc", time_limit: TimeOpt = 30.0, gap: GapOpt = 1e-3,
    exact: Annotated[bool, typer.Option("--exact", help="a binary per neuron group instead of the continuous "
                                                       "relaxation: exact, for small models")] = False,
    output: Annotated[Path | None, typer.Option("-o", "--output", help="write the planned model here instead "
                                                                          "of rewriting MODEL")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="plan and print, write nothing")] = False,
    export_gpuidx: Annotated[bool, typer.Option("--export-gpuidx", help="also write PowerInfer's "
                                                                        "<model>.generated.gpuidx")] = False,
    json_out: JsonOpt = False, calibration: CalOpt = True, verbose: VerboseOpt = False,
):
    """Plan one machine: solve, write the plan into the GGUF, print the per-layer table and a summary."""
    with _errors(verbose):
        model = Path(pick_model(model_arg, model_opt))
        check_ctx_size(ctx_size)  # before resolve_hardware, which may measure the CPU
        _solve_options(time_limit, act_tokens)
        opts = _hw(vram_budget, pcie_bw, cpu_cores, cpu_bw, host_ram, hw, calibration)
        machine = resolve_hardware(gpu, **opts)
        result = plan_model(model, machine, ctx_size=ctx_size, act_dir=activations, act_tokens=act_tokens,
                            objective=objective, group=group, solver=solver, time_limit=time_limit, gap=gap,
                            exact=exact, output=output, write=not dry_run, export=export_gpuidx, kv_type=kv_type,
                            status=_status(not json_out and sys.stderr.isatty()))
        d = result.to_dict()
        if json_out:
            print(json.dumps(d, indent=1))
        else:
            out.print_plan(_console(), d)


@app.command("compare")
def compare_cmd(
    model_arg: StatsModel = None, model_opt: ModelOpt = None,
    gpu: GpuOpt = None, vram_budget: VramOpt = None, pcie_bw: PcieOpt = None, cpu_cores: CoresOpt = None,
    cpu_bw: CpuBwOpt = None, host_ram: RamOpt = None, ctx_size: CtxOpt = None, kv_type: KvOpt = "f16",
    hw: HwOpt = None, activations: ActOpt = None, act_tokens: ActTokOpt = None, group: GroupOpt = DEFAULT_GROUP,
    solver: SolverOpt = "cbc", time_limit: TimeOpt = 30.0, gap: GapOpt = 1e-3, json_out: JsonOpt = False,
    calibration: CalOpt = True, verbose: VerboseOpt = False,
):
    """Plan the same model for each --gpu and print one row per GPU; writes nothing."""
    with _errors(verbose):
        model = Path(pick_model(model_arg, model_opt))
        _solve_options(time_limit, act_tokens)
        opts = _hw(vram_budget, pcie_bw, cpu_cores, cpu_bw, host_ram, hw, calibration)
        labels = gpu or []
        if json_out or not sys.stderr.isatty():
            d = compare_gpus(model, labels, hw_options=opts, ctx_size=ctx_size, act_dir=activations,
                             act_tokens=act_tokens, group=group, solver=solver, time_limit=time_limit, gap=gap,
                             kv_type=kv_type)
        else:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            with Progress(TextColumn("planning {task.description}"), BarColumn(), TextColumn("{task.completed}/"
                          "{task.total}"), TimeElapsedColumn(), console=Console(stderr=True),
                          transient=True) as bar:
                task = bar.add_task("", total=len(labels))
                state = {"n": 0}

                def tick(label: str):
                    bar.update(task, completed=state["n"], description=label)
                    state["n"] += 1

                d = compare_gpus(model, labels, hw_options=opts, ctx_size=ctx_size, act_dir=activations,
                                 act_tokens=act_tokens, group=group, solver=solver, time_limit=time_limit, gap=gap,
                                 kv_type=kv_type, progress=tick)
        if json_out:
            print(json.dumps(d, indent=1))
        else:
            out.print_compare(_console(), d)


@app.command("skeleton")
def skeleton_cmd(
    shape: Annotated[str, typer.Argument(help="llama2-7b, llama2-13b, llama2-70b, falcon-40b, opt-30b, bamboo-7b, "
                                              "smollm2-135m")],
    output: Annotated[Path, typer.Option("-o", "--output", help="file to write")],
    quant: Annotated[str, typer.Option("--quant", help="f16, q8_0, q4_0 or q4_k")] = "q4_0",
    predictors: Annotated[bool | None, typer.Option("--predictors/--no-predictors",
                                                       help="PowerInfer predictors (default: as the shape)")] = None,
    seed: Annotated[int, typer.Option("--seed", help="seed of the synthetic statistics")] = 0,
    tokens: Annotated[int, typer.Option("--tokens", help="tokens the synthetic counts stand for")] = 1_000_000,
    sparsity: Annotated[float | None, typer.Option("--sparsity", help="mean inactive share (default: the "
                                                                         "paper's for the shape)")] = None,
    hot_share: Annotated[float | None, typer.Option("--hot-share", help="share of neurons carrying 80% of the "
                                                                           "activations")] = None,
    verbose: VerboseOpt = False,
):
    """Write a skeleton GGUF: a known shape's metadata and tensor shapes with synthetic power-law statistics."""
    with _errors(verbose):
        from pinfer_llm.planner.skeleton import make_skeleton

        at_least("--seed", seed, 0, SEED_MAX)
        at_least("--tokens", tokens, 1, U64_MAX)  # stored as a u64
        path = make_skeleton(shape, output, quant=quant, predictors=predictors, seed=seed, tokens=tokens,
                             sparsity=sparsity, hot_share=hot_share)
        print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB)")


@app.command("show")
def show_cmd(model_arg: _model("a planned GGUF") = None, model_opt: ModelOpt = None, json_out: JsonOpt = False,
             verbose: VerboseOpt = False):
    """Print the plan stored in a GGUF (refused if it was made for another model)."""
    with _errors(verbose):
        model = Path(pick_model(model_arg, model_opt))
        d = show_plan(model)
        if json_out:
            print(json.dumps(d, indent=1))
            return
        from rich.table import Table

        meta = d["meta"]
        t = Table(title=f"{Path(d['model']).name}: plan for {'+'.join(meta.get('pinfer.plan.gpus', []))}",
                  title_justify="left")
        for col in ("layer", "attention", "GPU neurons"):
            t.add_column(col)
        for r in d["layers"]:
            t.add_row(str(r["layer"]), r["attn"], f"{r['gpu_neurons']:,} / {r['n_ff']:,}")
        c = _console()
        c.print(t)
        for key in ("objective", "predicted_tokens_per_s", "solver_status", "gap", "vram_budget", "ctx_size",
                    "fingerprint"):
            if f"pinfer.plan.{key}" in meta:
                c.print(f"{key}: {meta[f'pinfer.plan.{key}']}")
            elif key == "gap" and "pinfer.plan.solver_status" in meta:
                c.print("gap: unknown")


@app.command("apply")
def apply_cmd(source: Annotated[Path, typer.Option("--from", help="planned model, skeleton or .gpuidx holding "
                                                                  "the plan")],
              model_arg: _model("GGUF model to put the plan into") = None, model_opt: ModelOpt = None,
              output: Annotated[Path | None, typer.Option("-o", "--output", help="write here instead of "
                                                                                    "rewriting MODEL")] = None,
              verbose: VerboseOpt = False):
    """Copy a plan made elsewhere into MODEL; refused unless it was made for the same tensors."""
    with _errors(verbose):
        model = Path(pick_model(model_arg, model_opt))
        path = copy_plan(source, open_gguf(model), output)
        print(f"wrote {path}")


@app.command("gpus")
def gpus_cmd(json_out: JsonOpt = False):
    """The built-in GPU table."""
    table = gpu_table()
    if json_out:
        print(json.dumps(table, indent=1))
        return
    from rich.table import Table

    t = Table(title="GPUs (planner/gpus.toml)", title_justify="left")
    for col in ("name", "VRAM GiB", "bandwidth GB/s", "PCIe", "host link GB/s", "FP16 TFLOPS"):
        t.add_column(col, justify="left" if col == "name" else "right")
    for name in table:
        g = lookup_gpu(name)
        t.add_row(name, f"{g.vram_gib:g}", f"{g.mem_bw_gbs:g}", f"gen{g.pcie_gen} x{g.pcie_lanes}",
                  f"{g.pcie_gbs:.1f}", f"{g.fp16_tflops:g}")
    _console().print(t)


@app.command("calibration")
def calibration_cmd(reset: Annotated[bool, typer.Option("--reset", help="forget this machine's calibration")] = False,
                    json_out: JsonOpt = False, verbose: VerboseOpt = False):
    """This machine's CPU calibration (fitted from pi-run timings by benchmarks/plan_calibration.py)."""
    with _errors(verbose):
        from pinfer_llm.planner.machine import forget_calibration, load_calibration, this_cpu_key

        key = this_cpu_key()
        if reset:
            forget_calibration(key)
            print(f"forgot the calibration of {key}")
            return
        cal = load_calibration(key)
        if cal is None:
            print(f"no calibration for {key}; run benchmarks/plan_calibration.py")
            return
        print(json.dumps(cal.to_dict(), indent=1) if json_out else
              f"{key}: effective bandwidth {cal.bw_gbs:.2f} GB/s, {cal.op_us:.1f} us per operator, "
              f"{cal.token_us:.0f} us per token (from {len(cal.samples)} samples, fitted {cal.date})")


def normalize_argv(argv: list[str]) -> list[str]:
    """`pi-plan MODEL ...` (or `pi-plan -m MODEL ...`, `pi-plan --gpu NAME MODEL`) means `pi-plan plan ...`; only
    -h/--help and --version are pi-plan's own."""
    if argv and argv[0] not in COMMANDS and argv[0] not in ("-h", "--help", "--version"):
        return ["plan", *argv]
    return argv


def _terminated(signum, frame):
    """SIGTERM becomes an exception, so that what is being written or solved is cleaned up on the way out (the
    solver's temporary files, a half-written GGUF); a second SIGTERM ends the process at once."""
    signal.signal(signum, signal.SIG_DFL)
    print(f"{PROG}: terminated", file=sys.stderr)
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> None:
    args = normalize_argv(list(sys.argv[1:] if argv is None else argv))
    signal.signal(signal.SIGTERM, _terminated)
    run_app(app, PROG, args)


if __name__ == "__main__":
    main()
