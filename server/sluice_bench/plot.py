"""PNG charts across a concurrency sweep (one line per server).

matplotlib is optional: only `--plot` needs it, and without it the user gets a
clear message instead of an ImportError deep in a run.
"""

from __future__ import annotations

from pathlib import Path

from .runner import RunResult


class PlotUnavailable(RuntimeError):
    pass


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, never a window
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotUnavailable("--plot needs matplotlib: pip install matplotlib") from None
    return plt


def check_plotting() -> None:
    _pyplot()


def _x(r: RunResult) -> float:
    return r.load.get("concurrency") or r.load.get("request_rate") or 0


def plot_results(results: list[RunResult], folder: str | Path) -> list[Path]:
    """Writes latency.png (median and p99 of TTFT, TPOT, ITL, E2E) and
    throughput.png (output tok/s and requests/s) against the load level;
    returns the paths written."""
    plt = _pyplot()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    labels = list(dict.fromkeys(r.label for r in results))
    xlabel = "request rate (req/s)" if "request_rate" in results[0].load else "concurrency"
    written = []

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (key, title) in zip(axes.flat, (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2E latency"))):
        for label in labels:
            runs = sorted((r for r in results if r.label == label), key=_x)
            xs = [_x(r) for r in runs]
            for pct, style in (("median", "-o"), ("p99", "--x")):
                ys = [r.summary[key][pct] for r in runs]
                ax.plot(xs, [float("nan") if y is None else y for y in ys], style, label=f"{label} {pct}")
        ax.set_title(f"{title} (ms)")
        ax.set_xlabel(xlabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    written.append(folder / "latency.png")
    fig.savefig(written[-1], dpi=100)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (key, title) in zip(axes, (("output_throughput", "output tokens/s"), ("request_throughput", "requests/s"))):
        for label in labels:
            runs = sorted((r for r in results if r.label == label), key=_x)
            ax.plot([_x(r) for r in runs], [r.summary[key] for r in runs], "-o", label=label)
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    written.append(folder / "throughput.png")
    fig.savefig(written[-1], dpi=100)
    plt.close(fig)
    return written
