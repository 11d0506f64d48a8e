"""Shared by the tests that start Ray: a free loopback port and a Ray + Serve instance sized for
a 2-core machine that is always shut down afterwards."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator

RAY_OBJECT_STORE_BYTES = 128 * 1024 * 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def loopback_serve(
    port: int, env: dict[str, str] | None = None, **ray_init_kwargs
) -> Iterator[str]:
    """Ray on 2 CPUs with a bounded object store and Serve's proxy on 127.0.0.1:`port`; yields
    the base URL, then shuts Serve and Ray down. `env` is set only while Ray starts, so the
    processes Ray launches inherit it (as a Kubernetes Secret mounted as env would be) and the
    test process does not keep it."""
    import ray
    from ray import serve

    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        ray.init(
            **{
                "num_cpus": 2,
                "object_store_memory": RAY_OBJECT_STORE_BYTES,
                "include_dashboard": False,
                **ray_init_kwargs,
            }
        )
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
