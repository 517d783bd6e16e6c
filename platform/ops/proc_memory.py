"""This process's memory as Linux reports it (/proc/self), for the benchmarks' peak-memory numbers."""
from __future__ import annotations


def status_kb(field: str) -> int:
    """A /proc/self/status field in kB (VmRSS, VmHWM, ...); 0 where the field is absent."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def reset_peak() -> bool:
    """Reset VmHWM, the peak RSS, to the current RSS (Linux: writing 5 to clear_refs); False
    where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
