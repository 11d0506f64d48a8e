"""bench/probes/ttft_decompose.py's split of a served first token, on a hand-made trace: two requests
sent out of their arrival order at the core, one whose first text came with its second token."""

from __future__ import annotations

from bench.probes.ttft_decompose import decompose, summarize


def test_each_part_of_a_first_token_and_the_token_its_text_came_with():
    trace = [
        {"ev": "add", "t": 100.012, "rid": "b", "arrival": 100.011},
        {"ev": "add", "t": 100.013, "rid": "a", "arrival": 100.012},
        # b's and a's prompts in one step, then a decode step, then another
        {"ev": "step", "t": 100.100, "dur": 0.080, "reqs": [["b", 0, 7, 0, 7], ["a", 0, 5, 0, 5]]},
        {"ev": "step", "t": 100.130, "dur": 0.030, "reqs": [["b", 7, 1, 0, 7], ["a", 5, 1, 0, 5]]},
        {"ev": "step", "t": 100.160, "dur": 0.030, "reqs": [["b", 8, 1, 0, 7], ["a", 6, 1, 0, 5]]},
    ]
    # the client sent a (5 tokens) first and b (7 tokens) 1 ms later; b's text came with its
    # first token, a's only with its second
    requests = {
        "sent_at": [100.000, 100.001],
        "prompt_len": [5, 7],
        "success": [True, True],
        "ttft_s": [0.140, 0.105],
    }
    rows = {r["prompt_len"]: r for r in decompose(trace, requests)}
    a, b = rows[5], rows[7]
    assert a == {"ttft": 140.0, "in": 12.0, "wait": 8.0, "prefill": 80.0, "extra": 30.0,
                 "out": 10.0, "text_token": 2, "prompt_len": 5}  # fmt: skip
    assert b["in"] == 10.0 and b["wait"] == 9.0 and b["extra"] == 0.0 and b["out"] == 6.0
    assert b["text_token"] == 1
    summary = summarize(list(rows.values()))
    assert summary["requests"] == 2 and summary["first_text_at_token"] == {"1": 1, "2": 1}
