"""One step's rows grouped by adapter (LoRABatch) and the grouped product (LoRALinear): equal
to adding each row's own adapter product, whether an adapter's rows are one slice, scattered,
or bundled with other few-row adapters into one batched matmul (ranks differing, an adapter
that does not target the layer, slots left empty); the runner lays each adapter's rows out
side by side."""

from __future__ import annotations

import pytest
import torch

from replica.lora.layer import BUNDLE_MAX_ROWS, LoRABatch, LoRAContext, LoRALinear

CPU = torch.device("cpu")
BIG = BUNDLE_MAX_ROWS + 1  # rows of an adapter that gets its own slice


def test_many_rows_become_a_slice_scattered_ones_an_index_and_few_row_adapters_a_bundle():
    batch = LoRABatch.of([2, 2, 0, 1], [BIG, 1, 2, BIG], CPU)
    assert batch.groups == [(2, slice(0, BIG + 1)), (1, slice(BIG + 3, 2 * BIG + 3))]
    assert batch.bundle is None
    scattered = LoRABatch.of([1, 0, 1], [BIG, 1, 1], CPU)
    ((slot, rows),) = scattered.groups
    assert slot == 1 and rows.tolist() == [*range(BIG), BIG + 1]
    assert LoRABatch.of([0, 0], [4, 1], CPU) is None
    # decode rows of three adapters: one bundle of slots 1..3, two rows a slot, no groups
    bundled = LoRABatch.of([1, 3, 2, 1, 0, 3], [1, 1, 1, 1, 1, 2], CPU)
    assert bundled.groups == []
    bundle = bundled.bundle
    assert (bundle.num_slots, bundle.rows_per_slot) == (3, 3)
    assert bundle.index.tolist() == [0, 3, 0, 2, 0, 0, 1, 5, 6]
    assert bundle.keep.squeeze(1).tolist() == [1, 1, 0, 1, 0, 0, 1, 1, 1]
    # one small adapter alone, or small adapters in few of many slots: their own slices
    assert LoRABatch.of([1, 0], [2, 1], CPU).bundle is None
    sparse = LoRABatch.of([1, 9], [1, 1], CPU)
    assert sparse.bundle is None and [g[0] for g in sparse.groups] == [1, 9]


CASES = [
    ([1, 0, 2, 1], [2, 1, 3, 1]),  # all few-row: bundled (slot 1 scattered, padded)
    ([2, 2, 1, 0], [1, 2, 3, 1]),
    ([1, 2, 3, 0, 3], [BIG, 1, 2, 4, 1]),  # a slice next to a bundle of 2 and 3
    ([3, 1, 0, 3], [1, BIG, 2, 2]),  # slot 3 alone among the few-row: a slice
    ([1, 4, 2], [1, 1, 1]),  # slot 4 holds nothing for this layer; slot 3 empty in the step
]


@pytest.mark.parametrize("slots,lens", CASES)
def test_grouped_product_equals_each_rows_own_adapter(slots, lens):
    torch.manual_seed(0)
    # ranks differ (the bundle pads them); slot 3 has the highest; slot 4 none here
    weights = {s: (torch.randn(r, 8), torch.randn(6, r)) for s, r in ((1, 2), (2, 4), (3, 6))}
    n = sum(lens)
    x = torch.randn(n, 8)
    base = torch.randn(n, 6)
    context = LoRAContext()
    layer = LoRALinear(context)
    for slot, (a, b) in weights.items():
        layer.set(slot, a, b)
    per_row = [s for s, k in zip(slots, lens) for _ in range(k)]
    want = base.clone()
    for row, slot in enumerate(per_row):
        if slot in weights:
            a, b = weights[slot]
            want[row] += b @ (a @ x[row])
    out = base.clone()
    layer.apply(x, out)  # no batch: nothing added
    assert torch.equal(out, base)
    context.batch = LoRABatch.of(slots, lens, x.device)
    layer.apply(x, out)
    torch.testing.assert_close(out, want)


def test_the_stacks_follow_adapters_coming_and_going():
    torch.manual_seed(1)
    context = LoRAContext()
    layer = LoRALinear(context)
    a1, b1 = torch.randn(2, 8), torch.randn(6, 2)
    a2, b2 = torch.randn(3, 8), torch.randn(6, 3)
    layer.set(1, a1, b1)
    layer.set(2, a2, b2)
    x = torch.randn(2, 8)
    context.batch = LoRABatch.of([1, 2], [1, 1], CPU)
    out = torch.zeros(2, 6)
    layer.apply(x, out)
    torch.testing.assert_close(out, torch.stack([b1 @ a1 @ x[0], b2 @ a2 @ x[1]]))
    layer.drop(2)  # slot 2 emptied: its rows get nothing
    out = torch.zeros(2, 6)
    layer.apply(x, out)
    torch.testing.assert_close(out, torch.stack([b1 @ a1 @ x[0], torch.zeros(6)]))
    layer.set(2, a1, b1)  # slot 2 reused by another adapter
    out = torch.zeros(2, 6)
    layer.apply(x, out)
    torch.testing.assert_close(out, torch.stack([b1 @ a1 @ x[0], b1 @ a1 @ x[1]]))
