"""What ``benchmarks/gpu_check.py`` knows about where it runs and what it writes: the machine
(device, driver, CUDA and torch versions), the cluster the simulator's predictions are for,
the time budget of each section, the results file (rewritten after every item, so a run cut
short still leaves what it measured) and the table of measured against predicted figures.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from planner.cluster import Cluster
from planner.errors import OutputError
from planner.outputs import check_output_file, write_text_atomically

# The "tool" field of every results file this script writes: an existing file is replaced
# only when it carries it (or with --force), as `plan -o` replaces only plans.
RESULTS_TOOL = "soap-planner benchmarks/gpu_check.py"
SECTIONS = ("programs", "gemm", "attention", "memory", "launch")
# Share of the time left that each section gets, among the sections still to run (--only: the
# chosen ones share the whole budget).
SECTION_SHARES = {"programs": 0.45, "gemm": 0.2, "attention": 0.17, "memory": 0.12, "launch": 0.06}

# The file that marks a --work folder as this script's: only such a folder (or a new or empty
# one) is written into, since its plans, programs and cluster file replace what is there.
WORK_MARKER = ".soap-planner-gpu-check"

# H200 SXM datasheet (NVIDIA, 2024): 141 GB HBM3e at 4.8 TB/s; the same GH100 compute as the
# H100 SXM (989 TFLOP/s dense bf16), so it is the dgx-h100 preset with these two numbers.
H200_DEVICE = {"name": "H200-SXM-141GB", "memory_bytes": 141_000_000_000, "memory_bandwidth": 4.8e12}


def simulated_cluster(device_name: str, dry_run: bool) -> tuple[dict[str, Any], str]:
    """The one-device cluster file (as a dict) whose device the simulator's predictions are
    for, and why that one: the preset of the GPU named ``device_name`` (H200: the H100 preset
    with the H200's memory, see ``H200_DEVICE``), the closest one for a GPU no preset names,
    the ``cpu`` preset for a dry run."""
    name = device_name.upper()
    table: dict[str, Any] = {"count": 1, "devices": 1}
    if dry_run:
        table["preset"] = "cpu"
        reason = "dry run: the cpu preset's placeholder numbers; the figures are not meaningful"
    elif "H200" in name:
        table["preset"], table["device"] = "dgx-h100", dict(H200_DEVICE)
        reason = "H200: the dgx-h100 preset with the H200 datasheet's memory size and bandwidth"
    elif "H100" in name:
        table["preset"] = "dgx-h100"
        reason = "H100: the dgx-h100 preset (H100 SXM5)" + (
            "; this is a PCIe card, whose clocks and bandwidth are lower than the preset's" if "PCIE" in name else "")
    elif "A100" in name:
        table["preset"] = "dgx-a100-80g"
        reason = "A100: the dgx-a100-80g preset (A100 SXM4 80GB)"
    elif "V100" in name:
        table["preset"] = "p3.16xlarge"
        reason = "V100: the p3.16xlarge preset (V100 SXM2 16GB)"
    else:
        table["preset"] = "dgx-h100"
        reason = f"no preset names {device_name!r}: the dgx-h100 preset, the newest; predictions are for an H100"
    cluster = {"name": "gpu-check", "nodes": [table]}
    return cluster, reason


def load_cluster(data: dict[str, Any], folder: Path) -> tuple[Cluster, Path]:
    """Write ``data`` as a cluster file in ``folder`` and load it (plans name it by path)."""
    path = folder / "cluster.json"
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return Cluster.load(path), path


def environment(dry_run: bool) -> dict[str, Any]:
    """Device name, driver, CUDA, cuDNN, NCCL and torch versions of this machine."""
    cuda = torch.cuda.is_available()
    facts: dict[str, Any] = {
        "dry_run": dry_run,
        "device": torch.cuda.get_device_name(0) if cuda else (platform.processor() or platform.machine() or "cpu"),
        "device_memory_bytes": torch.cuda.get_device_properties(0).total_memory if cuda else None,
        "driver": _driver_version() if cuda else None,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        "torch": torch.__version__,
        "ortools": _version_of("ortools"),
        "transformers": _version_of("transformers"),
        "python": platform.python_version(),
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if cuda:
        properties = torch.cuda.get_device_properties(0)
        facts["sms"] = properties.multi_processor_count
        facts["compute_capability"] = f"{properties.major}.{properties.minor}"
    return facts


def _version_of(package: str) -> str | None:
    """The installed version of ``package``, or None when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _driver_version() -> str | None:
    """The NVIDIA driver version from nvidia-smi (torch does not expose it), or None."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = done.stdout.strip().splitlines()
    return lines[0].strip() if done.returncode == 0 and lines else None


class Budget:
    """Seconds left to one section; items that would not fit are skipped with the reason."""

    def __init__(self, section: str, seconds: float) -> None:
        self.section = section
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def allows(self, needed_s: float) -> bool:
        """Whether ``needed_s`` more seconds fit in the section's budget."""
        return self.left() >= needed_s

    def skip_reason(self) -> str:
        return (f"the {self.section} section's share of the budget ({self.seconds:.0f} s) was spent; "
                f"rerun it alone with --only {self.section}")


def work_folder(path: str) -> Path:
    """The ``--work`` folder, made if missing and marked as this script's; ``OutputError``
    (one line) for a file, or for a folder with other content that this script did not make,
    whose files the plans and programs would replace."""
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise OutputError(f"--work: '{folder}' is a file; give a folder for the plans and programs")
    if folder.is_dir() and any(folder.iterdir()) and not (folder / WORK_MARKER).is_file():
        raise OutputError(f"--work: '{folder}' holds files this script did not write, which its plans and programs "
                          f"would replace; give a new or empty folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / WORK_MARKER).write_text("plans and programs of benchmarks/gpu_check.py\n", encoding="utf-8")
    except OSError as error:
        raise OutputError(f"--work: cannot write in '{folder}' ({error.strerror}); choose another folder") from None
    return folder


def is_results_file(path: Path) -> bool:
    """Whether ``path`` holds a results file this script wrote."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(data, dict) and data.get("tool") == RESULTS_TOOL


class Results:
    """The results JSON, written atomically after every item.

    With ``keep_sections`` (``--only``), the sections of an earlier results file at ``path``
    that are not rerun are kept, so one part can be measured again into the same file."""

    def __init__(self, path: Path, facts: dict[str, Any], cluster: dict[str, Any], reason: str,
                 rerun: tuple[str, ...]) -> None:
        self.path = path
        kept = earlier_sections(path, facts["device"]) if rerun != SECTIONS else {}
        self.data: dict[str, Any] = {
            "tool": RESULTS_TOOL,
            "environment": facts,
            "simulated_cluster": cluster,
            "simulated_because": reason,
            "error_convention": "error = predicted / measured - 1 (negative: the simulator predicts too little time)",
            "sections": {name: [] if name in rerun else kept.get(name, []) for name in SECTIONS},
            "complete": False,  # true once every section ran; a run cut short leaves it false
        }
        self.write()

    def add(self, section: str, item: dict[str, Any]) -> None:
        """Record one item (measured, skipped or failed) and rewrite the file."""
        if "measured_s" in item and "predicted_s" in item and item["measured_s"]:
            item["error"] = item["predicted_s"] / item["measured_s"] - 1
        self.data["sections"][section].append(item)
        self.write()

    def finish(self, wall_s: float) -> None:
        self.data["wall_s"], self.data["complete"] = wall_s, True
        self.write()

    def write(self) -> None:
        write_text_atomically(self.path, json.dumps(self.data, indent=2, default=_plain) + "\n")


def earlier_sections(path: Path, device: str) -> dict[str, list]:
    """The sections of the results file at ``path`` when this script wrote it on ``device``
    (an --only rerun keeps them), else none."""
    if not is_results_file(path):
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    environment, sections = data.get("environment"), data.get("sections")
    earlier_device = environment.get("device") if isinstance(environment, dict) else None
    if earlier_device != device or not isinstance(sections, dict):
        why = f"are of another device ({earlier_device!r})" if earlier_device != device else "have no sections"
        say(f"the earlier results in {path} {why}: only the sections run now are written")
        return {}
    kept = {name: [item for item in items if _is_item(item)] for name, items in sections.items()
            if name in SECTIONS and isinstance(items, list)}
    dropped = sum(len(items) for name, items in sections.items() if name in kept) - sum(map(len, kept.values()))
    if dropped:
        say(f"the earlier results in {path}: {dropped} damaged item(s) left out")
    return kept


def _is_item(item: Any) -> bool:
    """Whether ``item`` is a result row as ``Results.add`` writes them: a name and either
    measured and predicted seconds or a status and its reason."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return False
    measured, predicted = item.get("measured_s"), item.get("predicted_s")
    if "measured_s" in item:
        return all(isinstance(value, (int, float)) and not isinstance(value, bool) for value in (measured, predicted))
    return isinstance(item.get("status"), str) and isinstance(item.get("reason"), str)


def check_results_path(path: str, force: bool) -> Path:
    """The results path, checked before anything runs (OutputError: one line)."""
    return check_output_file(path, what="gpu_check results file", is_ours=is_results_file, force=force)


def _plain(value: Any) -> Any:
    """JSON for what ``json`` cannot write itself (paths, numpy-like scalars)."""
    if isinstance(value, Path):
        return str(value)
    return float(value)


def say(text: str) -> None:
    """One progress line, flushed at once (the run may be cut short by its caller)."""
    print(text, flush=True)


def _seconds(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us")):
        if abs(value) >= scale or unit == "us":
            return f"{value / scale:.3g} {unit}"
    return f"{value:.3g} s"


def table(data: dict[str, Any]) -> str:
    """Measured against predicted, one row per item, section by section."""
    rows = [("section", "item", "predicted", "measured", "error", "note")]
    for section, items in data["sections"].items():
        for item in items:
            if "measured_s" in item:
                error = item.get("error")
                rows.append((section, item["name"], _seconds(item.get("predicted_s")), _seconds(item["measured_s"]),
                             f"{error:+.0%}" if error is not None else "-", item.get("note", "")))
            else:
                rows.append((section, item["name"], "-", "-", "-", f"{item['status']}: {item['reason']}"))
    widths = [max(len(row[index]) for row in rows) for index in range(5)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row[:5], widths)) + "  " + row[5] for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    header = f"{data['environment']['device']} (simulated as: {data['simulated_because']})"
    return "\n".join([header, *lines, data["error_convention"]])


__all__ = ["SECTIONS", "SECTION_SHARES", "Budget", "Results", "simulated_cluster", "load_cluster", "environment",
           "check_results_path", "is_results_file", "work_folder", "table", "say", "RESULTS_TOOL"]
