"""The flex_attention backend (CUDA's) and decode CUDA graphs, greedy fp32 against transformers
over batching, chunked prefill, prefix hits and preemption. On CPU the backend is forced (flex's
eager path: the mask_mod alone decides) and the decode graphs run their padded, fixed-address
forward without capture; on CUDA (marked gpu) the compiled kernels and captured graphs run, and
transformers runs on the same GPU."""

from __future__ import annotations

import random

import pytest
import torch

from replica.layers.attention import flex as flex_mod
from replica.layers.attention.flex import (
    PREFILL_Q_TILE,
    FlexAttentionBackend,
    FlexMetadataBuilder,
    decode_bucket,
)
from tests.replica.test_model_parity import expected_outputs, greedy_params, mixed_prompts

BLOCK = 16  # the compiled kernel's smallest key tile; CPU runs the same layout

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
        ],
    ),
]


@pytest.fixture(params=DEVICES)
def flex_device(request, monkeypatch):
    """'cpu': flex chosen on CPU, decode graphs without capture; 'cuda': as a GPU runs."""
    device = request.param
    if device == "cpu":
        from replica.cuda_graphs import DecodeGraphs
        from replica.runner import ModelRunner

        monkeypatch.setattr(FlexAttentionBackend, "supports", classmethod(lambda cls, s: True))

        def graphs(self):
            if not self.config.cuda_graphs:
                return None
            limit = min(self.config.cuda_graph_max_batch, self.config.max_num_seqs)
            return DecodeGraphs(self, limit, capture=False)

        monkeypatch.setattr(ModelRunner, "_make_decode_graphs", graphs)
    return device


def run_flex(run_generation, model_dir, prompts, params, device, **overrides):
    """The engine on `device` with the flex backend, greedy fp32 on 16-token blocks, no drafts."""
    settings = dict(cuda_attention="flex", dtype="float32", block_size=BLOCK,
                    num_speculative_tokens=0) | overrides  # fmt: skip
    return run_generation(model_dir, prompts, params, device=device, **settings)


LENGTHS = [1, 2, 5, 17, 33, 47, 150, 3, 64, 129]  # 150 and 129: more than one query tile
MAX_TOKENS = [12, 9, 16, 20, 11, 14, 8, 18, 10, 6]


@pytest.mark.parametrize("max_num_batched_tokens", [32, 4096])
def test_flex_greedy_matches_transformers_over_chunks(
    flex_device, tiny_llama_dir, run_generation, max_num_batched_tokens
):
    prompts = mixed_prompts(0, LENGTHS)
    run = run_flex(
        run_generation,
        tiny_llama_dir,
        prompts,
        [greedy_params(n) for n in MAX_TOKENS],
        flex_device,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    assert run.runner.attn_backend is FlexAttentionBackend
    graphs = run.runner.decode_graphs
    assert graphs is not None
    assert run.outputs == expected_outputs(tiny_llama_dir, prompts, MAX_TOKENS, flex_device)
    assert graphs.runs > 0  # decode-only steps ran through the graphs' buffers
    if flex_device == "cuda":
        assert graphs.replays == graphs.runs  # as captured graphs


def test_flex_prefix_hits_and_qwen2_bias(flex_device, tiny_qwen2_dir, run_generation):
    system = mixed_prompts(1, [40])[0]  # two full blocks shared, then a partial one
    suffixes = mixed_prompts(2, [1, 4, 7, 3, 11, 2, 6, 30])
    prompts = [system + s for s in suffixes] + [system[:33]]
    max_tokens = [10] * len(prompts)
    run = run_flex(
        run_generation, tiny_qwen2_dir, prompts, greedy_params(10), flex_device,
        max_num_batched_tokens=64,
    )  # fmt: skip
    assert run.scheduler.prefix_cache_hits > 0
    assert run.outputs == expected_outputs(tiny_qwen2_dir, prompts, max_tokens, flex_device)


def test_flex_preemption_and_eager_decode_match(flex_device, tiny_qwen2_dir, run_generation):
    """A pool too small for the batch (preemptions, recomputed prefills), decode graphs off:
    decodes run eagerly, padded to their bucket on the sink block."""
    prompts = mixed_prompts(3, [14, 19, 22, 9, 17, 25, 12, 20])
    max_tokens = [16] * len(prompts)
    run = run_flex(
        run_generation, tiny_qwen2_dir, prompts, greedy_params(16), flex_device,
        num_kv_blocks=8, max_num_batched_tokens=4096, cuda_graphs=False,
    )  # fmt: skip
    assert run.runner.decode_graphs is None
    assert run.scheduler.num_preemptions_total > 0
    assert run.outputs == expected_outputs(tiny_qwen2_dir, prompts, max_tokens, flex_device)


def test_decode_buckets_pad_up():
    assert [decode_bucket(n) for n in (1, 2, 3, 5, 64, 65, 256, 257, 600)] == [
        1,
        2,
        4,
        8,
        64,
        128,
        256,
        512,
        768,
    ]


def _dense(mask_mod, b, rows, kv_len):
    q = torch.as_tensor(rows)[:, None]
    kv = torch.arange(kv_len)[None, :]
    return mask_mod(torch.tensor(b), torch.tensor(0), q, kv)


@pytest.mark.parametrize("seed", range(6))
def test_block_lists_agree_with_the_mask_mod(seed):
    """What the compiled kernel trusts: every full block is visible to every real query of its
    tile, every visible key's block is listed (full or partial), and the mask is causal over
    each request's own blocks (checked against positions computed independently)."""
    rng = random.Random(seed)
    num_blocks = 64
    builder = FlexMetadataBuilder(BLOCK, "cpu", group=2)
    builder.bind_cache(num_blocks, num_blocks, 1024)
    free = list(range(num_blocks))
    rng.shuffle(free)
    starts, lens, tables = [], [], []
    shared = [free.pop() for _ in range(2)]  # a prefix two requests share
    for i in range(rng.randint(2, 6)):
        start = rng.choice([0, 0, 5, 16, 31, 32, 40])
        n = rng.choice([1, 1, 2, 7, 16, 33, 130, 200])
        blocks = -(-(start + n) // BLOCK)
        own = shared[: min(blocks, 2)] if i < 2 and start >= 32 else []
        tables.append(own + [free.pop() for _ in range(blocks - len(own))])
        starts.append(start)
        lens.append(n)
    meta, positions = builder.build(starts, lens, tables)
    kv_len = builder.kv_len

    def visible(req: int, pos: int) -> torch.Tensor:
        want = torch.zeros(kv_len, dtype=torch.bool)
        for key in range(pos + 1):
            want[tables[req][key // BLOCK] * BLOCK + key % BLOCK] = True
        return want

    prefill = meta.prefill
    if prefill is not None:
        mask = prefill.mask
        filling = [i for i, n in enumerate(lens) if n > 1]
        row_req, row_pos = {}, {}
        for r in filling:
            base = sum(lens[:r])
            for t in range(lens[r]):
                row_req[base + t] = r
                row_pos[base + t] = starts[r] + t
        dest_of = dict(zip(prefill.rows.tolist(), prefill.dest.tolist()))
        pos_of_dest = {dest_of[row]: (row_req[row], row_pos[row]) for row in dest_of}
        kv_num, kv_idx, full_num, full_idx = (
            mask.kv_num_blocks[0, 0],
            mask.kv_indices[0, 0],
            mask.full_kv_num_blocks[0, 0],
            mask.full_kv_indices[0, 0],
        )
        for tile in range(prefill.padded_len // PREFILL_Q_TILE):
            rows = [
                d
                for d in range(tile * PREFILL_Q_TILE, (tile + 1) * PREFILL_Q_TILE)
                if d in pos_of_dest
            ]
            listed_full = set(full_idx[tile, : full_num[tile]].tolist())
            listed = listed_full | set(kv_idx[tile, : kv_num[tile]].tolist())
            if not rows:
                assert not listed_full
                continue
            dense = _dense(mask.mask_mod, 0, rows, kv_len)
            for i, d in enumerate(rows):
                req, pos = pos_of_dest[d]
                assert torch.equal(dense[i], visible(req, pos))
                for block in listed_full:
                    assert dense[i, block * BLOCK : (block + 1) * BLOCK].all()
            seen = dense.any(0).view(-1, BLOCK).any(1).nonzero()[:, 0].tolist()
            assert set(seen) <= listed
    decode = meta.decode
    if decode is not None:
        mask = decode.mask
        decoding = [i for i, n in enumerate(lens) if n == 1]
        assert decode.lanes == decode_bucket(len(decoding))
        for lane, r in enumerate(decoding):
            dense = _dense(mask.mask_mod, lane, [0], kv_len)[0]
            assert torch.equal(dense, visible(r, starts[r]))
            full = mask.full_kv_indices[lane, 0, 0, : mask.full_kv_num_blocks[lane, 0, 0]]
            last = int(mask.kv_indices[lane, 0, 0, 0])
            assert set(full.tolist()) | {last} == set(tables[r])
            for block in full.tolist():
                assert dense[block * BLOCK : (block + 1) * BLOCK].all()
        for lane in range(len(decoding), decode.lanes):  # padding lanes see the sink only
            dense = _dense(mask.mask_mod, lane, [0], kv_len)[0]
            assert dense.nonzero()[:, 0].tolist() == [num_blocks * BLOCK]
    assert positions.shape[0] == sum(lens)


def test_flex_needs_a_block_size_the_kernel_tiles():
    from replica.layers.attention.backend import AttentionSpec

    spec = dict(dtype=torch.float32, num_kv_heads=2, head_dim=16, num_heads=4)
    cuda = torch.device("cuda", 0)
    flex = dict(spec, cuda_attention="flex")
    assert flex_mod.flex_available(AttentionSpec(cuda, block_size=16, **flex)) == (
        flex_mod.flex_attention is not None
    )
    assert not flex_mod.flex_available(AttentionSpec(cuda, block_size=8, **flex))
    assert not flex_mod.flex_available(AttentionSpec(torch.device("cpu"), block_size=16, **flex))
    assert not flex_mod.flex_available(AttentionSpec(cuda, block_size=16, **spec))  # the default
