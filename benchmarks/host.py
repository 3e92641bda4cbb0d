"""What a benchmark records about the machine it ran on."""
from __future__ import annotations

import platform
import re
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), else what the platform module knows."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    m = re.search(r"^model name\s*:\s*(.+)$", text, flags=re.M)
    return m.group(1).strip() if m else platform.machine()
