"""One step's rows grouped by adapter (LoRABatch) and the grouped product (LoRALinear): equal
to adding each row's own adapter product, whether an adapter's rows are one slice or
scattered; the runner lays each adapter's rows out side by side."""

from __future__ import annotations

import torch

from replica.lora.layer import LoRABatch, LoRAContext, LoRALinear


def test_contiguous_rows_become_one_slice_and_scattered_ones_an_index():
    batch = LoRABatch.of([2, 2, 0, 1], [3, 1, 2, 2], torch.device("cpu"))
    assert batch.groups == [(2, slice(0, 4)), (1, slice(6, 8))]
    scattered = LoRABatch.of([1, 0, 1], [2, 1, 1], torch.device("cpu"))
    ((slot, rows),) = scattered.groups
    assert slot == 1 and rows.tolist() == [0, 1, 3]
    assert LoRABatch.of([0, 0], [4, 1], torch.device("cpu")) is None


def test_grouped_product_equals_each_rows_own_adapter():
    torch.manual_seed(0)
    weights = {s: (torch.randn(r, 8), torch.randn(6, r)) for s, r in ((1, 2), (2, 4))}
    x = torch.randn(7, 8)
    base = torch.randn(7, 6)
    for slots, lens in (([1, 0, 2, 1], [2, 1, 3, 1]), ([2, 2, 1, 0], [1, 2, 3, 1])):
        context = LoRAContext()
        layer = LoRALinear(context, dict(weights))
        per_row = [s for s, n in zip(slots, lens) for _ in range(n)]
        want = base.clone()
        for row, slot in enumerate(per_row):
            if slot:
                a, b = weights[slot]
                want[row] += b @ (a @ x[row])
        out = base.clone()
        layer.apply(x, out)  # no batch: nothing added
        assert torch.equal(out, base)
        context.batch = LoRABatch.of(slots, lens, x.device)
        layer.apply(x, out)
        torch.testing.assert_close(out, want)
