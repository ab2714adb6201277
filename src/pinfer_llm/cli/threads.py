"""Threads on a machine that is not ours alone.

torch's CPU wheels use GNU OpenMP (libgomp). Between two parallel regions (a decode step has ~120) a libgomp thread
spins GOMP_SPINCOUNT times before it sleeps. On an idle machine spinning is what makes a step fast; when a core is
busy with another process, a spinning thread burns the time slice that the thread it waits for needs, and decoding
collapses. So the CLI sets a short spin by default (default_wait_policy), gives each free core one thread when -t is
not given, and warns when -t asks for more threads than other processes leave cores free (fit_threads)."""

from __future__ import annotations

import os
import sys
import time

# GOMP_SPINCOUNT where the user set neither it nor OMP_WAIT_POLICY (benchmarks/wait_policy.py; docs/running.md).
SPINCOUNT = "5000"


def default_wait_policy() -> None:
    """How long torch's OpenMP threads spin before they sleep, set before torch is imported (libgomp reads its
    environment once, when torch loads it). libgomp's default spin (300,000) is fastest on an idle machine and
    collapses beside one busy core; OMP_WAIT_POLICY=PASSIVE never collapses but is slow idle; a short spin is near
    the first idle and far from its collapse."""
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = SPINCOUNT


def usable_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def _cpu_ticks(cpus: list[int]) -> tuple[int, int]:
    """(busy, total) clock ticks of the given CPUs since boot, from /proc/stat."""
    busy = total = 0
    want = {f"cpu{c}" for c in cpus}
    with open("/proc/stat") as f:
        for line in f:
            name, *vals = line.split()
            if name in want:
                v = [int(x) for x in vals[:8]]  # user nice system idle iowait irq softirq steal
                busy += v[0] + v[1] + v[2] + v[5] + v[6] + v[7]
                total += sum(v)
    return busy, total


def _own_ticks() -> int:
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime, stime: every thread of this process


class BusyCores:
    """How many of this process's cores other processes keep busy, measured between construction and free(): the
    time the model takes to load is the window, and this process's own CPU time in it is left out."""

    MIN_WINDOW_S = 0.1

    def __init__(self):
        self.cpus = usable_cores()
        self.t0 = time.monotonic()
        try:
            self.start = (*_cpu_ticks(self.cpus), _own_ticks())
        except (OSError, ValueError, IndexError):
            self.start = None

    def free(self) -> float | None:
        """Cores free of other processes' work (fractional), or None where /proc cannot say."""
        if self.start is None:
            return None
        time.sleep(max(0.0, self.MIN_WINDOW_S - (time.monotonic() - self.t0)))
        try:
            (busy, total), own = _cpu_ticks(self.cpus), _own_ticks()
        except (OSError, ValueError, IndexError):
            return None
        b0, t0, o0 = self.start
        if total <= t0:
            return None
        n = len(self.cpus)
        others = max(0.0, (busy - b0) - (own - o0)) * n / (total - t0)
        return max(0.0, n - others)


def warn_if_busy(prog: str, threads: int, sample: BusyCores) -> None:
    """One line when the threads outnumber the cores other processes leave free: with them each step waits for a
    thread that has no core. Does not change the thread count (a busy moment may pass)."""
    free = sample.free()
    if free is None or threads <= round(free):
        return
    n = len(sample.cpus)
    print(f"{prog}: warning: {threads} threads, but other processes keep {n - free:.1f} of {n} cores busy: "
          f"-t {max(1, round(free))} may be faster", file=sys.stderr)


def fit_threads(prog: str, m, explicit: bool, sample: BusyCores) -> None:
    """Threads for the cores that are free: with -t, a warning when they outnumber them (warn_if_busy); without -t
    (default: every core) and with other processes keeping cores busy, one thread per free core, said in one line.
    Measured (benchmarks/wait_policy.py, SmolLM2, 2-core Xeon, one core kept busy): 2 threads decode at 5-40 tok/s
    depending on the wait policy, 1 thread at 78."""
    import torch

    if explicit:
        return warn_if_busy(prog, m.threads, sample)
    free = sample.free()
    if free is None or m.threads <= round(free):
        return
    n, total = max(1, round(free)), len(sample.cpus)
    torch.set_num_threads(n)
    m.threads = n
    print(f"{prog}: other processes keep {total - free:.1f} of {total} cores busy: using {n} "
          f"thread{'s' if n > 1 else ''} (-t {total} to use every core anyway)", file=sys.stderr)
