"""What every benchmark writes beside its figures: the JSON file, and the machine that produced them (the CPU's
model, the instruction-set variant of the C++ kernels that ran, torch's version and threads), so that a figure is
never read without its ISA."""
from __future__ import annotations

import datetime
import json
import os
import platform


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else what the platform module says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    """The machine a benchmark ran on, and what of it the engine used."""
    import torch

    from kvcache import native
    return {"cpu": cpu_model(), "arch": platform.machine(), "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "cpu_isa": native.isa(), "cpu_kernels": native.describe(), "cpu_features": native.cpu_features(),
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
            "date": datetime.date.today().isoformat()}


def write_json(path: str, results: dict) -> None:
    """Write a benchmark's results with the machine's record (creating the folder) and say so; nothing where `path`
    is empty (--json '')."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({**results, "machine": {**machine(), **results.get("machine", {})}}, f, indent=2)
    print(f"wrote {path}")
