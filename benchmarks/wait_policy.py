"""How torch's OpenMP threads wait between parallel regions, measured: decode speed of pi-run under each wait policy,
on an idle machine and with one core kept busy by another process.

    python benchmarks/wait_policy.py                          # SmolLM2, 2 threads, 3 rounds
    python benchmarks/wait_policy.py --model m.gguf --threads 2 --tokens 96 --rounds 5 --json

torch's CPU wheels use GNU OpenMP (libgomp, shipped in torch/lib). Between two parallel regions (every matrix product
of a decode step) a libgomp thread spins GOMP_SPINCOUNT times (default 300,000, ~0.1-1 ms) before it sleeps in the
kernel; OMP_WAIT_POLICY=PASSIVE sleeps at once (no spin), ACTIVE spins forever. Spinning wins on an idle machine:
a woken thread costs a few microseconds, and a decode step has ~120 regions. It collapses when a thread shares its
core with another process: the spinner burns the time slice the thread it waits for needs.

Each policy runs in a fresh `python -m pinfer_llm.cli.run ... --json` (libgomp reads its environment when torch is
imported). A round measures every policy idle, then every policy with a busy core (a spinning Python process started
for the round, one core's worth), the order rotating; per policy and load, the result is the median over rounds of
the per-round ratio to libgomp's own default (GOMP_SPINCOUNT=300000), next to the median tok/s. Run it on an idle
machine: anything else running is part of the "idle" figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

_TREE = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(_TREE), str(_TREE / "src")]  # the checkout, without an install

# name -> environment (each also clears the variables the others set)
POLICIES = {
    "libgomp default (spin 300k)": {"GOMP_SPINCOUNT": "300000"},
    "OMP_WAIT_POLICY=PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"},
    "GOMP_SPINCOUNT=100000": {"GOMP_SPINCOUNT": "100000"},
    "GOMP_SPINCOUNT=30000": {"GOMP_SPINCOUNT": "30000"},
    "GOMP_SPINCOUNT=10000": {"GOMP_SPINCOUNT": "10000"},
    "GOMP_SPINCOUNT=1000": {"GOMP_SPINCOUNT": "1000"},
    "pinfer's default": {},
}
BASE = "libgomp default (spin 300k)"
VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "PINFER_WAIT_POLICY")


def run_once(model: str, threads: int, tokens: int, env_extra: dict, timeout: float) -> float:
    env = {k: v for k, v in os.environ.items() if k not in VARS} | env_extra
    env["PYTHONPATH"] = os.pathsep.join([str(_TREE / "src"), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "pinfer_llm.cli.run", model, "-p", "Once upon a time", "-n", str(tokens), "-t",
           str(threads), "--temp", "0", "--json"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, check=True).stdout
    except subprocess.TimeoutExpired:
        return 0.0  # a collapse that slow counts as nothing decoded in time
    return json.loads(out)["timings"]["decode_tokens_per_s"]


def busy_core() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=180, help="seconds a run may take (a collapse can be 70x slower)")
    ap.add_argument("--spin", default="", help="comma-separated GOMP_SPINCOUNT values to measure instead of the "
                    "built-in list (libgomp's default and PASSIVE are always measured)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.spin:
        for k in [k for k in POLICIES if k.startswith("GOMP_SPINCOUNT=")]:
            del POLICIES[k]
        POLICIES.update({f"GOMP_SPINCOUNT={int(s)}": {"GOMP_SPINCOUNT": str(int(s))} for s in a.spin.split(",")})
    names = list(POLICIES)
    tps = {(load, n): [] for load in ("idle", "busy") for n in names}
    for r in range(a.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for load in ("idle", "busy"):
            spinner = busy_core() if load == "busy" else None
            try:
                time.sleep(0.5 if spinner else 0)
                for n in order:
                    tps[load, n].append(run_once(a.model, a.threads, a.tokens, POLICIES[n], a.timeout))
                    print(f"round {r + 1} {load:4} {n:28} {tps[load, n][-1]:7.1f} tok/s", file=sys.stderr)
            finally:
                if spinner:
                    spinner.kill()
                    spinner.wait()
    rows = []
    for load in ("idle", "busy"):
        for n in names:
            ratios = [x / b if b else float("inf") for x, b in zip(tps[load, n], tps[load, BASE], strict=True)]
            rows.append({"load": load, "policy": n, "median_tps": round(statistics.median(tps[load, n]), 1),
                         "ratio_to_libgomp_default": round(statistics.median(ratios), 3), "tps": tps[load, n]})
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    result = {"model": a.model, "threads": a.threads, "tokens": a.tokens, "rounds": a.rounds, "cpu": cpu,
              "cores": len(os.sched_getaffinity(0)), "rows": rows}
    if a.json:
        print(json.dumps(result))
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{a.model}, -t {a.threads}, {a.tokens} tokens, {a.rounds} rounds, {cpu}")
    for col in ("load", "policy", "tok/s (median)", f"x {BASE} (median of rounds)"):
        t.add_column(col, justify="right" if "tok" in col or col.startswith("x") else "left")
    for row in rows:
        t.add_row(row["load"], row["policy"], f"{row['median_tps']:.1f}", f"{row['ratio_to_libgomp_default']:.2f}")
    Console().print(t)


if __name__ == "__main__":
    main()
