"""What every benchmark figure carries (command, machine, versions, date), JSON output, markdown tables, and
replacing a marked section of a markdown file."""
from __future__ import annotations

import datetime
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
from pathlib import Path
from typing import Any


def machine() -> dict[str, Any]:
    """CPU model and core counts (lscpu), plus the GPU when one is visible."""
    info: dict[str, Any] = {"machine": platform.machine(), "logical_cpus": os.cpu_count()}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        info["cpu"] = fields.get("Model name")
        cores, sockets = fields.get("Core(s) per socket"), fields.get("Socket(s)")
        if cores and sockets and cores.isdigit() and sockets.isdigit():
            info["physical_cores"] = int(cores) * int(sockets)
    except (OSError, subprocess.SubprocessError, ValueError):
        pass
    import torch

    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    info["torch_threads"] = torch.get_num_threads()
    return info


def versions() -> dict[str, str]:
    """Versions of inferflow, torch and the peers that are importable."""
    import importlib.metadata as md

    out = {}
    for dist in ("inferflow", "torch", "transformers", "llama_cpp_python"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    if "llama_cpp_python" not in out:
        try:
            import llama_cpp

            out["llama_cpp_python"] = llama_cpp.__version__
        except Exception:  # noqa: BLE001 - the peer is optional
            pass
    out["python"] = platform.python_version()
    return out


def header(argv: list[str], prog: str = "inferflow bench") -> dict[str, Any]:
    return {"command": prog + "".join(" " + shlex.quote(a) for a in argv), "date": datetime.datetime.now(
        datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "machine": machine(), "versions": versions()}


def summary(values: list[float]) -> dict[str, float]:
    """mean / median / p99 (nearest-rank) of a list; zeros when empty."""
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    s = sorted(values)
    return {"mean": statistics.fmean(s), "median": statistics.median(s), "p99": s[min(len(s) - 1, int(0.99 * len(s)))]}


def write_json(path: str | os.PathLike, data: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=1, default=str) + "\n", encoding="utf-8")


def md_table(header_row: list[str], rows: list[list[Any]]) -> str:
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.2f}" if abs(v) < 100 else f"{v:.1f}"
        return "–" if v is None else str(v)

    align = ["---"] + ["---:"] * (len(header_row) - 1)
    lines = ["| " + " | ".join(header_row) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def machine_line(h: dict[str, Any]) -> str:
    m, v = h["machine"], h["versions"]
    cpu = f"{m.get('cpu') or m['machine']}, {m.get('physical_cores', m['logical_cpus'])} cores"
    vs = ", ".join(f"{k} {val}" for k, val in v.items())
    return f"Machine: {cpu}{'; ' + m['gpu'] if m.get('gpu') else ''}; {m['torch_threads']} torch threads. {vs}. " \
           f"Date: {h['date']}."


def write_section(path: str | os.PathLike, body: str, marker: str) -> None:
    """Replace the text between ``<!-- marker -->`` and ``<!-- /marker -->`` (markers kept); append when absent."""
    begin, end = f"<!-- {marker} -->", f"<!-- /{marker} -->"
    block = f"{begin}\n{body.strip()}\n{end}"
    p = Path(path)
    text = p.read_text(encoding="utf-8") if p.is_file() else ""
    # markers only count on lines of their own (prose may quote them)
    pattern = re.compile(r"^" + re.escape(begin) + r"$.*?^" + re.escape(end) + r"$", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text, count=1)
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + block + "\n"
    p.write_text(text, encoding="utf-8")
