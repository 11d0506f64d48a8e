"""PNG plots of a simulation (`stepserve simulate --plots`; needs matplotlib, the bench extra):
TTFT and e2e CDFs, the replica count over time, and per-replica KV usage and queue timelines."""

from __future__ import annotations

from pathlib import Path


def plot_result(result, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in result.requests if r["status"] == "ok"]
    paths = []
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, key, label in ((axes[0], "ttft_s", "TTFT"), (axes[1], "e2e_s", "e2e latency")):
        vals = sorted(r[key] for r in ok)
        if vals:
            ax.plot(vals, [(i + 1) / len(vals) for i in range(len(vals))])
        ax.set_xscale("log")
        ax.set_xlabel(f"{label} (s)")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    t = [x[0] for x in result.replica_count]
    axes[2].step(t, [x[1] for x in result.replica_count], where="post", label="serving")
    axes[2].step(t, [x[2] for x in result.replica_count], where="post", label="target", ls="--")
    axes[2].set_xlabel("simulated time (s)")
    axes[2].set_ylabel("replicas")
    axes[2].legend()
    fig.tight_layout()
    path = out / "latency_and_replicas.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)

    fig, axes = plt.subplots(2, 1, figsize=(12, 6), sharex=True)
    shown = list(result.timelines.items())[:16]  # a fleet of hundreds would be a blur
    for rid, rows in shown:
        if not rows:
            continue
        ts = [r[0] for r in rows]
        axes[0].plot(ts, [r[3] for r in rows], lw=0.8, label=rid)
        axes[1].plot(ts, [r[1] + r[2] for r in rows], lw=0.8)
    axes[0].set_ylabel("KV usage")
    axes[1].set_ylabel("running + waiting")
    axes[1].set_xlabel("simulated time (s)")
    if len(shown) <= 8:
        axes[0].legend(fontsize=7)
    fig.suptitle(f"per-replica timelines ({len(shown)} of {len(result.timelines)} replicas)")
    fig.tight_layout()
    path = out / "replica_timelines.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)
    return paths
