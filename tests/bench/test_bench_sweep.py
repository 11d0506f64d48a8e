"""bench/serving.py's sweeps: no rate replays another rate's prompts (a server with a prefix
cache would answer them from it and its first tokens would look faster than they are), and
bench/serving_vs_peer.py's warm-up sends none of the measured prompts."""

from __future__ import annotations

import argparse

from bench.serving import add_dataset_args, build_dataset, sweep_seed
from bench.serving_vs_peer import WARMUP_SEED

BLOCK = 16  # a KV block: the prefix cache's unit


def _args(dataset: str, num_prompts: int) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--seed", type=int, default=0)
    add_dataset_args(p)
    return p.parse_args(["--dataset", dataset, "--num-prompts", str(num_prompts)])


def _first_blocks(specs) -> set[tuple[int, ...]]:
    return {tuple(s.prompt_ids[:BLOCK]) for s in specs}


def test_each_rate_of_a_sweep_and_the_warm_up_have_prompts_of_their_own():
    for dataset in ("long-tail", "random", "heterogeneous"):
        args = _args(dataset, 40)
        seeds = [sweep_seed(0, i) for i in range(4)] + [WARMUP_SEED]
        assert len(set(seeds)) == len(seeds)
        blocks = [_first_blocks(build_dataset(args, s)) for s in seeds]
        for i in range(len(blocks)):
            for j in range(i + 1, len(blocks)):
                assert not blocks[i] & blocks[j], (dataset, seeds[i], seeds[j])


def test_same_prompts_keeps_one_set_and_a_seed_reproduces_its_set():
    args = _args("long-tail", 20)
    assert sweep_seed(5, 3, same_prompts=True) == 5
    a = build_dataset(args, sweep_seed(0, 2))
    b = build_dataset(args, sweep_seed(0, 2))
    assert [s.prompt_ids for s in a] == [s.prompt_ids for s in b]
    assert [s.prompt_ids for s in a] != [s.prompt_ids for s in build_dataset(args, 0)]
