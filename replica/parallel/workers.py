"""Ranks 1..tp-1 as seen from rank 0: local worker processes (without Ray) or Ray actors in the
replica's placement group; started, watched for death and stopped alike."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from replica.parallel.worker import RankSpec, RayRankWorker


class _LocalWorkers:
    def __init__(self, specs: list[RankSpec]) -> None:
        root = str(Path(__file__).resolve().parents[2])  # the repository, for `import replica`
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self.procs: dict[int, subprocess.Popen] = {}
        for spec in specs:
            env["OMP_NUM_THREADS"] = str(spec.num_threads)
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    "from replica.parallel import _local_worker_entry as m; m()",
                ],
                stdin=subprocess.PIPE,
                env=env,
                text=True,
            )
            proc.stdin.write(json.dumps(asdict(spec)) + "\n")
            proc.stdin.flush()
            self.procs[spec.rank] = proc

    @property
    def pids(self) -> dict[int, int]:
        return {rank: proc.pid for rank, proc in self.procs.items()}

    def first_death(self) -> str | None:
        for rank, proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                return (
                    f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with code {code}"
                )
        return None

    def wait_any_death(self, on_death) -> None:
        """Call on_death(reason) from a watcher thread when a worker exits."""
        for rank, proc in self.procs.items():

            def watch(rank=rank, proc=proc) -> None:
                code = proc.wait()
                on_death(
                    f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with code {code}"
                )

            threading.Thread(target=watch, name=f"tp-watch-{rank}", daemon=True).start()

    def stop(self, grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()  # SIGKILL: also ends a stopped or hung worker
                proc.wait()
            if proc.stdin is not None:
                try:
                    proc.stdin.close()
                except OSError:
                    pass


class _RayWorkers:
    def __init__(self, specs: list[RankSpec], placement_group: Any) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray = ray
        actor_class = ray.remote(RayRankWorker)
        self.actors: dict[int, Any] = {}
        self.runs: dict[int, Any] = {}
        for spec in specs:
            bundle = placement_group.bundle_specs[spec.rank]
            actor = actor_class.options(
                num_cpus=bundle.get("CPU", 0),
                num_gpus=bundle.get("GPU", 0),
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=placement_group, placement_group_bundle_index=spec.rank
                ),
            ).remote()
            self.actors[spec.rank] = actor
            self.runs[spec.rank] = actor.run.remote(asdict(spec))

    def _reason(self, rank: int) -> str:
        try:
            self._ray.get(self.runs[rank], timeout=1)
            detail = "returned"
        except Exception as exc:
            detail = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
        return f"tensor-parallel worker rank {rank} (Ray actor) ended: {detail}"

    def first_death(self) -> str | None:
        refs = list(self.runs.values())
        done, _ = self._ray.wait(refs, num_returns=1, timeout=0)
        if not done:
            return None
        rank = next(r for r, ref in self.runs.items() if ref == done[0])
        return self._reason(rank)

    def wait_any_death(self, on_death) -> None:
        def watch() -> None:
            try:
                done, _ = self._ray.wait(list(self.runs.values()), num_returns=1)
                rank = next(r for r, ref in self.runs.items() if ref == done[0])
                on_death(self._reason(rank))
            except Exception as exc:  # Ray itself is going away
                on_death(f"lost track of the tensor-parallel workers: {exc}")

        threading.Thread(target=watch, name="tp-watch", daemon=True).start()

    def stop(self, grace_s: float) -> None:
        self._ray.wait(list(self.runs.values()), num_returns=len(self.runs), timeout=grace_s)
        for actor in self.actors.values():
            self._ray.kill(actor, no_restart=True)
