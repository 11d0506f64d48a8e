"""Per-step cost of tensor parallelism on CPU (gloo): decode steps of a tiny Llama at tp=1 and
tp=2, and how much of a tp=2 step is rank 0 encoding + broadcasting the batch description.

    .venv/bin/python bench/probes/tp_step_overhead.py [--batch 8] [--steps 64]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from replica.config import EngineConfig  # noqa: E402
from replica.request import EngineRequest, Request, SamplingParams  # noqa: E402
from replica.scheduler import Scheduler  # noqa: E402


def build_model(root: Path) -> Path:
    from replica.tiny_models import build_tiny_model, build_tiny_tokenizer

    (root / "tok").mkdir()
    build_tiny_tokenizer(root / "tok")
    (root / "llama").mkdir()
    build_tiny_model(root / "llama", root / "tok", "llama", seed=1, tie_word_embeddings=False)
    return root / "llama"


def decode_steps(runner, config: EngineConfig, batch: int, steps: int) -> list[float]:
    """Seconds of runner.execute for every step in which all `batch` requests decode."""
    scheduler = Scheduler(config, config.num_kv_blocks, runner.max_model_len)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    for i in range(batch):
        prompt = [3 + (7 * i + j) % 500 for j in range(32)]
        scheduler.add_request(Request(EngineRequest(prompt, params, f"r{i}")))
    times = []
    while scheduler.has_unfinished():
        so = scheduler.schedule()
        t0 = time.perf_counter()
        out = runner.execute(so)
        elapsed = time.perf_counter() - t0
        if len(so.scheduled) == batch and all(s.num_tokens == 1 for s in so.scheduled):
            times.append(elapsed)
        scheduler.update_from_output(so, out.sampled, out.logprobs)
    return times


def summary(times: list[float]) -> str:
    ordered = sorted(times)
    p90 = ordered[int(0.9 * (len(ordered) - 1))]
    return (
        f"min {ordered[0] * 1e3:.2f} ms, median {statistics.median(times) * 1e3:.2f} ms, "
        f"p90 {p90 * 1e3:.2f} ms (n={len(times)})"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=64)
    args = parser.parse_args()
    import torch

    import replica.parallel as parallel
    from replica.runner import ModelRunner

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp))
        fields = {"device": "cpu", "block_size": 16, "num_kv_blocks": 256}
        config1 = EngineConfig(model=str(model_dir), **fields)
        runner1 = ModelRunner(config1, model_dir)
        threads = torch.get_num_threads()
        decode_steps(runner1, config1, args.batch, 8)  # warm-up
        tp1 = decode_steps(runner1, config1, args.batch, args.steps)
        torch.set_num_threads(1)
        tp1_one_thread = decode_steps(runner1, config1, args.batch, args.steps)
        torch.set_num_threads(threads)
        runner1.shutdown()

        config2 = EngineConfig(model=str(model_dir), tensor_parallel_size=2, **fields)
        runner2 = parallel.TensorParallelRunner(config2, model_dir)
        sends: list[float] = []
        sizes: list[int] = []
        send = runner2.channel.send

        def timed_send(command: int, payload: list[int]) -> None:
            t0 = time.perf_counter()
            send(command, payload)
            sends.append(time.perf_counter() - t0)
            sizes.append(len(payload))

        runner2.channel.send = timed_send
        encode = parallel.encode_batch
        encodes: list[float] = []

        def timed_encode(batch):
            t0 = time.perf_counter()
            flat = encode(batch)
            encodes.append(time.perf_counter() - t0)
            return flat

        parallel.encode_batch = timed_encode
        try:
            decode_steps(runner2, config2, args.batch, 8)
            sends.clear(), encodes.clear(), sizes.clear()
            tp2 = decode_steps(runner2, config2, args.batch, args.steps)
        finally:
            runner2.shutdown()
    n = len(tp2)
    print(f"decode step, batch {args.batch}, tiny Llama (2 layers, hidden 64), CPU")
    print(f"  tp=1 ({threads} threads)            {summary(tp1)}")
    print(f"  tp=1 (1 thread)             {summary(tp1_one_thread)}")
    print(f"  tp=2 (gloo, 1 thread/rank)  {summary(tp2)}")
    print(f"  tp=2 batch encode           {summary(encodes[-n:])}")
    print(f"  tp=2 batch broadcast        {summary(sends[-n:])}, {max(sizes)} ints")


if __name__ == "__main__":
    main()
