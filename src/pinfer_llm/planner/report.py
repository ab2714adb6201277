"""What pi-plan prints: rich tables for people, plain dicts for --json. No decisions are made here."""
# ruff: noqa: E741 - l is a layer index, as in the formulation (sum over layers l)

from __future__ import annotations

from dataclasses import asdict

import numpy as np
from rich.console import Console
from rich.table import Table

from pinfer_llm.planner.baselines import Baseline
from pinfer_llm.planner.costmodel import Evaluation
from pinfer_llm.planner.hardware import GIB
from pinfer_llm.planner.plan import CPU, Plan
from pinfer_llm.planner.problem import Problem


def device(code: int, n_gpus: int) -> str:
    if code == CPU:
        return "CPU"
    return "GPU" if n_gpus == 1 else f"GPU{code}"


def _tps(b: Baseline | None) -> float | None:
    return None if b is None or b.time is None else 1.0 / b.time


def layer_rows(p: Problem, plan: Plan, ev: Evaluation) -> list[dict]:
    rows = []
    for l, lb in enumerate(p.model.layers):
        k = int(plan.n_gpu[l])
        mass = p.prefix[l][-1]
        rows.append({
            "layer": l,
            "attn": device(int(plan.attn[l]), p.n_gpus),
            "pred": device(int(plan.pred[l]), p.n_gpus) if lb.has_predictor else None,
            "gpu_neurons": k,
            "n_ff": lb.n_ff,
            "gpu_mass": float(p.prefix[l][k] / mass) if mass > 0 else 0.0,
            "split": bool(ev.split[l]),
            "c_min": int(p.c_min[l, max(int(plan.ffn_gpu[l]), 1)]) if p.n_gpus else 0,
            "time_us": float(ev.layer_time[l] * 1e6),
        })
    return rows


def plan_dict(p: Problem, sol, baselines: dict[str, Baseline], written=None, gpuidx=None, fp: str = "") -> dict:
    ev = sol.evaluation
    m = p.model
    return {
        "model": {"path": str(m.path), "name": m.name, "arch": m.arch, "quant": m.quant, "n_layer": m.n_layer,
                  "ctx_size": m.ctx_size, "skeleton": m.skeleton, "fingerprint": fp,
                  "activations": p.act.source, "activations_note": p.act.note},
        "hardware": asdict(p.hw),
        "plan": {
            "objective": sol.objective, "solver": sol.solver, "status": sol.status, "gap": sol.gap,
            "build_s": sol.build_s, "solve_s": sol.solve_s, "variables": sol.n_variables,
            "constraints": sol.n_constraints, "tokens_per_s": ev.tokens_per_s, "ms_per_token": ev.time * 1e3,
            "vram_used": [int(x) for x in ev.vram], "vram_budget": [g.budget_bytes for g in p.hw.gpus],
            "host_used": ev.host, "host_ram": int(p.hw.cpu.host_ram_gib * GIB),
            "gpu_neuron_share": ev.gpu_neurons, "hot_mass": ev.hot_mass,
            "output": device(int(sol.plan.output), p.n_gpus), "notes": sol.notes,
            "layers": layer_rows(p, sol.plan, ev),
        },
        "baselines": {name: baseline_dict(b) for name, b in baselines.items()},
        "written": str(written) if written else None,
        "gpuidx": str(gpuidx) if gpuidx else None,
    }


def baseline_dict(b: Baseline) -> dict:
    ev = b.evaluation
    return {"tokens_per_s": _tps(b), "fits": bool(ev is not None and ev.fits), "note": b.note,
            "hot_mass": ev.hot_mass if ev else None, "gpu_neuron_share": ev.gpu_neurons if ev else None,
            "vram_used": [int(x) for x in ev.vram] if ev else None}


def gap_text(gap: float | None) -> str:
    """The ILP's optimality gap as the solver bounds it (an upper bound), or "unknown" when it gives none."""
    return "unknown" if gap is None else f"<= {gap:.3%}"


def _gib(x: float) -> str:
    return f"{x / GIB:.2f}"


def print_plan(console: Console, d: dict) -> None:
    plan, model = d["plan"], d["model"]
    multi = any(r["pred"] for r in plan["layers"])
    t = Table(title=f"{model['name']}  ({model['quant']}, {model['n_layer']} layers, ctx {model['ctx_size']})",
              title_justify="left")
    t.add_column("layer", justify="right")
    t.add_column("attention")
    if multi:
        t.add_column("predictor")
    t.add_column("GPU neurons", justify="right")
    t.add_column("GPU mass", justify="right")
    t.add_column("split")
    t.add_column("C_l", justify="right")  # the paper's minimum GPU neurons when dense parts are on the CPU
    t.add_column("µs", justify="right")
    for r in plan["layers"]:
        row = [str(r["layer"]), r["attn"]] + ([r["pred"] or "-"] if multi else [])
        row += [f"{r['gpu_neurons']:,}/{r['n_ff']:,}", f"{r['gpu_mass']:.1%}", "split" if r["split"] else "",
                f"{r['c_min']:,}", f"{r['time_us']:.0f}"]
        t.add_row(*row)
    console.print(t)
    print_summary(console, d)


def print_summary(console: Console, d: dict) -> None:
    plan, hw = d["plan"], d["hardware"]
    used = ", ".join(f"{_gib(u)} / {_gib(b)} GiB ({g['name']})"
                     for u, b, g in zip(plan["vram_used"], plan["vram_budget"], hw["gpus"], strict=True))
    cpu = hw["cpu"]
    s = Table.grid(padding=(0, 2))
    s.add_column(style="bold")
    s.add_column()
    s.add_row("VRAM used", used or "-")
    s.add_row("host RAM used", f"{_gib(plan['host_used'])} / {_gib(plan['host_ram'])} GiB")
    s.add_row("CPU", f"{cpu['cores']} cores, {cpu['mem_bw_gbs']:.1f} GB/s"
              + (" (calibrated)" if cpu.get("calibrated") else ""))
    s.add_row("on GPU", f"{plan['gpu_neuron_share']:.1%} of neurons, {plan['hot_mass']:.1%} of activation mass, "
              f"output head on {plan['output']}")
    ours = plan["tokens_per_s"]
    s.add_row("predicted", f"[bold green]{ours:.2f} tokens/s[/] ({plan['ms_per_token']:.1f} ms/token, "
              f"objective {plan['objective']})")
    for name, b in d["baselines"].items():
        if b["tokens_per_s"] is None:
            s.add_row(f"  {name}", f"n/a ({b['note']})")
        else:
            s.add_row(f"  {name}", f"{b['tokens_per_s']:.2f} tokens/s  (plan is {ours / b['tokens_per_s']:.2f}x)"
                      + (f"  [dim]{b['note']}[/]" if b["note"] else ""))
    s.add_row("solver", f"{plan['solver']}: {plan['status']}, gap {gap_text(plan['gap'])}, "
              f"{plan['build_s'] + plan['solve_s']:.2f} s ({plan['variables']:,} variables, "
              f"{plan['constraints']:,} constraints)")
    for note in plan["notes"] + ([d["model"]["activations_note"]] if d["model"]["activations_note"] else []):
        s.add_row("note", note)
    if d["written"]:
        s.add_row("written", d["written"] + (f", {d['gpuidx']}" if d["gpuidx"] else ""))
    elif d["gpuidx"]:
        s.add_row("written", d["gpuidx"])
    console.print(s)


def print_compare(console: Console, d: dict) -> None:
    m = d["model"]
    t = Table(title=f"{m['name']}  ({m['quant']}, ctx {m['ctx_size']}) on {d['cpu']}", title_justify="left",
              caption="neurons, mass: shares on the GPU(s).  x layers, x powerinfer: the plan's speed-up over "
                      "those baselines.  fits: the whole model fits.", caption_justify="left")
    for col, just in (("GPU", "left"), ("VRAM budget", "right"), ("VRAM used", "right"), ("neurons", "right"),
                      ("mass", "right"), ("tokens/s", "right"), ("x layers", "right"), ("x powerinfer", "right"),
                      ("fits", "left"), ("solve", "right")):
        t.add_column(col, justify=just, no_wrap=True)
    for r in d["rows"]:
        if r.get("error"):
            t.add_row(r["gpu"], _gib(r["vram_budget"]) if r.get("vram_budget") else "-", "-", "-", "-", "-", "-",
                      "-", "-", f"[red]{r['error']}[/]")
            continue

        def x(v):
            return f"{v:.2f}x" if v is not None else "n/a"

        t.add_row(r["gpu"], f"{_gib(r['vram_budget'])} GiB", f"{_gib(r['vram_used'])} GiB",
                  f"{r['gpu_neuron_share']:.1%}", f"{r['hot_mass']:.1%}", f"[bold]{r['tokens_per_s']:.2f}[/]",
                  x(r["speedup_layers"]), x(r["speedup_powerinfer"]), "yes" if r["fits_whole"] else "no",
                  f"{r['solve_s']:.1f} s")
    console.print(t)


def compare_row(label: str, p: Problem, sol, baselines: dict[str, Baseline]) -> dict:
    ev = sol.evaluation
    ours = ev.tokens_per_s

    def speedup(name):
        tps = _tps(baselines.get(name))
        return ours / tps if tps else None

    return {"gpu": label, "vram_budget": sum(g.budget_bytes for g in p.hw.gpus), "vram_used": int(np.sum(ev.vram)),
            "gpu_neuron_share": ev.gpu_neurons, "hot_mass": ev.hot_mass, "tokens_per_s": ours,
            "speedup_layers": speedup("layers"), "speedup_powerinfer": speedup("powerinfer"),
            "fits_whole": baselines["gpu"].time is not None, "status": sol.status, "gap": sol.gap,
            "solve_s": sol.build_s + sol.solve_s,
            "baselines": {name: _tps(b) for name, b in baselines.items()}, "error": None}
