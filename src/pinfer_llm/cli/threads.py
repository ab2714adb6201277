"""Threads on a machine that is not ours alone: a warning when -t asks for more threads than other processes leave
cores free. torch's OpenMP threads spin while they wait for each other, so a thread without a core of its own slows
every step of the others."""

from __future__ import annotations

import os
import sys
import time


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
