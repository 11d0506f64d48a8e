"""PNG plots of the benchmark results (matplotlib, headless). Each benchmark calls its plot at
the end; `python bench/plots.py` redraws every plot from the JSON in bench/results/."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
ROUTER_COLORS = {
    "round_robin": "#7f7f7f",
    "pow2": "#d62728",
    "load_aware": "#1f77b4",
    "load_aware+prefix": "#2ca02c",
}


def _color(name: str, i: int) -> str:
    return ROUTER_COLORS.get(name, f"C{i}")


def _plain_log_ticks(axis) -> None:
    """Label a log axis 20, 50, 100, 200 ... instead of 2x10^1; every tick (20, 30, 40 ...) when
    the axis spans less than a decade, where 1-2-5 would leave one label or none."""

    def label(value: float, _pos) -> str:
        low, high = axis.get_view_interval()
        shown = (1, 2, 5) if low <= 0 or high / low >= 10 else range(1, 10)
        mantissa = value / 10 ** np.floor(np.log10(value)) if value > 0 else 0
        return f"{value:g}" if round(mantissa) in shown else ""

    axis.set_major_formatter(matplotlib.ticker.FuncFormatter(label))
    axis.set_minor_formatter(matplotlib.ticker.FuncFormatter(label))


def plot_latency_vs_rate(sweep: dict, path: Path) -> Path:
    """sweep: {"systems": {name: [run summary with request_rate, ttft_ms, e2el_ms, ...]}}."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    panels = [
        ("ttft_ms", "TTFT (ms)", "Time to first token"),
        ("e2el_ms", "end-to-end latency (ms)", "End-to-end latency"),
        ("tpot_ms", "TPOT (ms)", "Time per output token"),
    ]
    for i, (name, runs) in enumerate(sweep["systems"].items()):
        runs = sorted(runs, key=lambda r: r["request_rate"])
        rates = [r["request_rate"] for r in runs]
        for ax, (key, _, _) in zip(axes, panels, strict=True):
            ax.plot(
                rates,
                [r[key]["median"] for r in runs],
                "o-",
                color=_color(name, i),
                label=f"{name} p50",
            )
            ax.plot(
                rates,
                [r[key]["p99"] for r in runs],
                "s--",
                color=_color(name, i),
                alpha=0.7,
                label=f"{name} p99",
            )
    for ax, (_, ylabel, title) in zip(axes, panels, strict=True):
        ax.set_xlabel("request rate (req/s, Poisson)")
        ax.set_ylabel(ylabel)
        ax.set_yscale("log")
        _plain_log_ticks(ax.yaxis)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7, ncol=2)
    fig.suptitle(sweep.get("title", "Latency vs request rate"), fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_ttft_distributions(per_workload: dict, path: Path, title: str) -> Path:
    """per_workload: {workload: {router: [TTFT seconds of each successful request]}}. Top row:
    CDFs; bottom row: the tail, as the fraction of requests slower than x (log-log)."""
    n = len(per_workload)
    fig, axes = plt.subplots(2, n, figsize=(6.8 * n, 8.4), squeeze=False)
    for col, (workload, by_router) in enumerate(per_workload.items()):
        cdf_ax, tail_ax = axes[0][col], axes[1][col]
        for i, (router, ttfts) in enumerate(by_router.items()):
            xs = np.sort(np.asarray(ttfts) * 1000.0)
            if not len(xs):
                continue
            ys = np.arange(1, len(xs) + 1) / len(xs)
            p50, p99 = np.percentile(xs, 50), np.percentile(xs, 99)
            label = f"{router}: p50 {p50:.0f} ms, p99 {p99:.0f} ms"
            cdf_ax.step(xs, ys, where="post", color=_color(router, i), label=label)
            tail_ax.step(xs, 1.0 - ys + 1.0 / len(xs), where="post", color=_color(router, i))
        name, _, rate = workload.partition("@")
        cdf_ax.set_title(f"{name}, {rate} req/s" if rate else name)
        cdf_ax.set_ylabel("fraction of requests")
        cdf_ax.legend(fontsize=8, loc="lower right")
        tail_ax.set_yscale("log")
        tail_ax.axhline(0.01, color="k", lw=0.6, ls=":")
        tail_ax.set_ylabel("fraction of requests slower (log; dotted: p99)")
        for ax in (cdf_ax, tail_ax):
            ax.set_xscale("log")
            _plain_log_ticks(ax.xaxis)
            ax.set_xlabel("TTFT (ms, log scale)")
            ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_batch_occupancy(result: dict, path: Path) -> Path:
    """One row per system, against wall time: batch slots used vs wasted per step (left) and
    tokens computed per step (right, log scale: prefill steps stand out)."""
    runs = result["runs"]
    batch = result["batch"]
    fig, axes = plt.subplots(
        len(runs),
        2,
        figsize=(14, 2.9 * len(runs)),
        sharex=True,
        gridspec_kw={"width_ratios": [3, 2]},
        squeeze=False,
    )
    for row, (name, run) in enumerate(runs.items()):
        steps = run["steps"]
        t = np.array([s["t"] for s in steps])
        used = np.array([s["seqs"] for s in steps])
        wasted = np.array([s["wasted_slots"] for s in steps])
        tokens = np.array([s["tokens"] for s in steps])
        ax, tok_ax = axes[row]
        ax.fill_between(t, 0, used, step="post", color="#1f77b4", alpha=0.8, label="slots used")
        ax.fill_between(
            t, used, used + wasted, step="post", color="#d62728", alpha=0.35, label="slots wasted"
        )
        ax.set_ylim(0, batch * 1.08)
        ax.set_ylabel(f"slots (B={batch})")
        ax.set_title(
            f"{name}: {run['wall_s']:.2f} s, {run['num_steps']} steps, slot utilization "
            f"{run['slot_utilization']:.0%}, {run['output_tokens_per_s']:.0f} output tok/s",
            fontsize=9.5,
            loc="left",
        )
        ax.legend(loc="upper right", fontsize=8)
        ax.grid(True, alpha=0.3)
        tok_ax.step(t, tokens, where="post", color="k", lw=0.7)
        tok_ax.set_yscale("log")
        tok_ax.set_ylabel("tokens / step")
        tok_ax.set_title(
            "tokens computed per step (prefill spikes, decode = sequences)",
            fontsize=9.5,
            loc="left",
        )
        tok_ax.grid(True, which="both", alpha=0.3)
    axes[-1][0].set_xlabel("wall time (s)")
    axes[-1][1].set_xlabel("wall time (s)")
    fig.suptitle(
        f"Batch occupancy: {result['num_requests']} requests queued at t=0, long-tailed output "
        f"lengths ({min(result['output_lens'])}-{max(result['output_lens'])} tokens), "
        f"{result['model']} model, B={batch}",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_overhead(result: dict, path: Path) -> Path:
    """Histograms of per-request e2e: engine alone, through HTTP + routing, and Ray Serve's
    floor for the same path shape (when measured)."""
    fig, axes = plt.subplots(1, len(result["modes"]), figsize=(5.6 * len(result["modes"]), 4.4))
    for ax, (mode, data) in zip(np.atleast_1d(axes), result["modes"].items(), strict=True):
        engine = np.asarray(data["engine_e2e_s"]) * 1000
        http = np.asarray(data["http_e2e_s"]) * 1000
        floor = np.asarray(data.get("floor_e2e_s", [])) * 1000
        lowest = min(engine.min(), http.min(), floor.min() if floor.size else np.inf)
        bins = np.linspace(lowest, np.percentile(http, 99.5), 60)
        ax.hist(
            engine, bins=bins, alpha=0.6, label=f"engine alone (median {np.median(engine):.1f} ms)"
        )
        ax.hist(
            http, bins=bins, alpha=0.6, label=f"HTTP + routing (median {np.median(http):.1f} ms)"
        )
        if floor.size:  # Ray Serve alone: the same path shape, no engine
            ax.hist(
                floor,
                bins=bins,
                alpha=0.5,
                label=f"Ray Serve floor, no engine (median {np.median(floor):.1f} ms)",
            )
        ax.set_xlabel("end-to-end latency per request (ms)")
        ax.set_ylabel("requests")
        added = data["added_ms"]
        ax.set_title(f"{mode}: added median {added['median']:.1f} ms, p99 {added['p99']:.1f} ms")
        ax.legend(fontsize=8)
        ax.grid(True, alpha=0.3)
    fig.suptitle(result.get("title", "HTTP + routing overhead"), fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_routing(data: dict, name: str) -> list[Path]:
    """The plots of one bench/routing.py result: TTFT CDFs, and latency vs rate for a sweep."""
    drawn = [
        plot_ttft_distributions(data["ttft_cdf"], RESULTS / f"{name}_ttft.png", data["plot_title"])
    ]
    if "sweep" in data:
        drawn.append(plot_latency_vs_rate(data["sweep"], RESULTS / f"{name}_latency_vs_rate.png"))
    return drawn


def plot_serving_sweeps(results: list[dict], path: Path) -> Path:
    """bench/serving.py results with several request rates, one system per result (label)."""
    systems = {r["label"]: r["runs"] for r in results}
    datasets = sorted({r["dataset"]["dataset"] for r in results})
    title = f"Latency vs request rate per system ({', '.join(datasets)} dataset, bench/serving.py)"
    return plot_latency_vs_rate({"title": title, "systems": systems}, path)


def plot_llamacpp(result: dict, path: Path) -> Path:
    """bench/llamacpp_vs_stepserve.py: tok/s of each system per kernels figure (bars) and, when
    served, output tok/s and TTFT p99 against concurrent streams."""
    panels = [k for k in ("kernels", "served") if k in result]
    count = len(panels) + ("served" in result)
    fig, axes = plt.subplots(1, count, figsize=(5.5 * count, 4.2))
    axes = np.atleast_1d(axes)
    name = Path(result["gguf"]).name
    i = 0
    if "kernels" in result:
        figures = result["kernels"]["tok_per_s"]
        tests = list(next(iter(figures.values())))
        width = 0.8 / len(figures)
        for j, (system, values) in enumerate(figures.items()):
            xs = np.arange(len(tests)) + j * width
            axes[i].bar(xs, [values[t] for t in tests], width, label=system, color=f"C{j}")
        axes[i].set_xticks(np.arange(len(tests)) + width * (len(figures) - 1) / 2, tests)
        axes[i].set_ylabel("tok/s")
        axes[i].set_title(f"{name}: prompt and single-stream decode")
        axes[i].legend(fontsize=8)
        i += 1
    if "served" in result:
        for j, (system, runs) in enumerate(result["served"].items()):
            streams = [r["concurrency"] for r in runs]
            axes[i].plot(
                streams, [r["output_tok_s"] for r in runs], "o-", label=system, color=f"C{j}"
            )
            ttft = [r["ttft_ms"]["p99"] / 1000 for r in runs]
            axes[i + 1].plot(streams, ttft, "o-", label=system, color=f"C{j}")
        axes[i].set_title(f"{name} served: output tok/s")
        axes[i + 1].set_title("TTFT p99 (s)")
        for ax in axes[i : i + 2]:
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent streams")
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def redraw_all() -> list[Path]:
    drawn = []
    serving = []
    for path in sorted(RESULTS.glob("*.json")):
        data = json.loads(path.read_text())
        kind = data.get("benchmark")
        if kind == "serving" and len(data["runs"]) > 1:
            serving.append(data)
        elif kind == "routing":
            drawn += plot_routing(data, path.stem)
        elif kind == "batching":
            drawn.append(plot_batch_occupancy(data, RESULTS / "batch_occupancy.png"))
        elif kind == "serving_vs_peer":
            sweep = {"title": data["title"], "systems": data["sweep"]["systems"]}
            drawn.append(plot_latency_vs_rate(sweep, RESULTS / f"{path.stem}_latency_vs_rate.png"))
        elif kind == "http_overhead":
            drawn.append(plot_overhead(data, RESULTS / "http_overhead.png"))
        elif kind == "llamacpp_vs_stepserve":
            drawn.append(plot_llamacpp(data, path.with_suffix(".png")))
    if serving:
        drawn.append(plot_serving_sweeps(serving, RESULTS / "serving_latency_vs_rate.png"))
    return drawn


if __name__ == "__main__":
    for p in redraw_all():
        print(f"wrote {p}")
    sys.exit(0)
