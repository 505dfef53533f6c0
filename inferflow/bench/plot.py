"""PNG charts of a benchmark result (matplotlib, the optional ``bench`` extra)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import InferflowError


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise InferflowError("--plot needs matplotlib: pip install 'inferflow[bench]'") from e
    return plt


def plot_offline(results: list[dict[str, Any]], folder: str | Path) -> list[Path]:
    """One grouped bar chart per metric (prefill, decode tok/s): batch sizes on x, one bar per system."""
    plt = _pyplot()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    systems = list(dict.fromkeys(r["system"] for r in results))
    batches = sorted({r["batch"] for r in results})
    by = {(r["system"], r["batch"]): r for r in results}
    paths = []
    for metric, title in (("decode_tps", "decode tokens/s"), ("prefill_tps", "prefill tokens/s")):
        fig, ax = plt.subplots(figsize=(7, 4))
        width = 0.8 / max(1, len(systems))
        for i, s in enumerate(systems):
            xs = [j + i * width for j, b in enumerate(batches) if (s, b) in by]
            ys = [by[(s, b)][metric] for b in batches if (s, b) in by]
            ax.bar(xs, ys, width, label=s)
        ax.set_xticks([j + width * (len(systems) - 1) / 2 for j in range(len(batches))], [str(b) for b in batches])
        ax.set_xlabel("batch size")
        ax.set_ylabel(title)
        ax.set_title(f"{title} (median of rounds)")
        ax.legend()
        fig.tight_layout()
        path = folder / f"offline_{metric}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def plot_serving(result: dict[str, Any], folder: str | Path) -> list[Path]:
    """Histograms of TTFT, TPOT and ITL, and the end-to-end latency CDF."""
    plt = _pyplot()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    per = result["per_request"]
    series = {"ttft_ms": [r["ttft_ms"] for r in per], "tpot_ms": [r["tpot_ms"] for r in per if r["tpot_ms"]],
              "itl_ms": result["itl_samples_ms"]}
    paths = []
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    for ax, (name, xs) in zip(axes, series.items()):
        ax.hist(xs or [0.0], bins=30)
        ax.set_xlabel(name)
        ax.set_ylabel("count")
    fig.tight_layout()
    paths.append(folder / "serving_latency_hist.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    lat = sorted(r["latency_ms"] for r in per) or [0.0]
    ax.plot(lat, [(i + 1) / len(lat) for i in range(len(lat))])
    ax.set_xlabel("end-to-end latency (ms)")
    ax.set_ylabel("fraction of requests")
    fig.tight_layout()
    paths.append(folder / "serving_latency_cdf.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    return paths
