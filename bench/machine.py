"""The whole machine's CPU time so far, for benchmarks that time work spread over many processes.

``/proc/stat``'s first line sums every core: a benchmark reads it before and after, and the difference
is the CPU every process used over that time (the benchmark's children, daemons they started, and any
other load), and the time the cores sat idle.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

TICKS_PER_SECOND = 100  # /proc/stat counts in USER_HZ, 1/100 s on Linux


class CpuSeconds(NamedTuple):
    busy: float  # user + nice + system + irq + softirq
    idle: float  # idle + iowait: a core with nothing to run, or waiting for the disk


def machine_cpu_seconds() -> CpuSeconds | None:
    """Busy and idle CPU seconds of all cores since boot (None where there is no /proc/stat)."""
    try:
        fields = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]]
    except (OSError, ValueError):
        return None
    user, nice, system, idle, iowait, irq, softirq = fields
    return CpuSeconds((user + nice + system + irq + softirq) / TICKS_PER_SECOND, (idle + iowait) / TICKS_PER_SECOND)


def used_between(before: CpuSeconds | None, after: CpuSeconds | None) -> CpuSeconds | None:
    """The machine's busy and idle CPU seconds from ``before`` to ``after`` (None if either is missing)."""
    if before is None or after is None:
        return None
    return CpuSeconds(after.busy - before.busy, after.idle - before.idle)
