"""bench/serving_path_cpu.py's accounting: every process of the server's session by role (the
engine core apart), this process's own CPU read from /proc, medians per tree."""

from __future__ import annotations

import os

from bench.serving_path_cpu import cpu_by_role, role_of, session_cpu, summarize


def test_roles_name_each_serving_process_and_the_rest_is_other():
    assert role_of("/v/bin/python -m replica.engine.core_process --fd 5") == "engine core"
    assert role_of("ray::ServeReplica:default:LLMServer") == "front (LLMServer)"
    assert role_of("ray::ServeReplica:default:Ingress") == "ingress"
    assert role_of("/x/ray/core/src/ray/raylet/raylet --node_ip_address=1") == "gcs/raylet"
    # an agent whose flags name the raylet is not the raylet
    assert role_of("/v/bin/python -u /x/dashboard/agent.py --raylet-name=r") == "dashboard/agents"
    assert role_of("ray::HAProxyManager") == "proxy/haproxy"
    assert role_of("/usr/bin/something-else") == "other"


def test_cpu_by_role_counts_what_each_process_used_between_snapshots():
    before = {1: (100, "ray::ServeReplica:a:Ingress"), 2: (50, "ray::ServeController")}
    after = {
        1: (100 + os.sysconf("SC_CLK_TCK"), "ray::ServeReplica:a:Ingress"),  # 1 s
        2: (50, "ray::ServeController"),  # idle: not listed
        3: (os.sysconf("SC_CLK_TCK") // 2, "python -m replica.engine.core_process"),  # new
    }
    assert cpu_by_role(before, after) == {"ingress": 1.0, "engine core": 0.5}


def test_this_processs_session_is_read_from_proc():
    table = session_cpu(os.getsid(0))
    assert os.getpid() in table and table[os.getpid()][0] >= 0


def test_summary_takes_medians_per_tree():
    def run(path, ingress):
        return {
            "path_ms_per_token": path,
            "path_ms_per_token_less_idle": path / 2,
            "core_ms_per_token": 10.0,
            "by_role_ms_per_token": {"ingress": ingress},
            "by_role_ms_per_token_less_idle": {"ingress": ingress / 2},
            "idle_ms_per_s": {"ingress": 10.0, "controller": 30.0},
        }

    s = summarize({"a": [run(1.0, 0.2), run(3.0, 0.4), run(2.0, 0.3)]})["a"]
    assert s["path_ms_per_token"] == 2.0 and s["by_role_ms_per_token"] == {"ingress": 0.3}
    assert s["path_idle_ms_per_s"] == 40.0
