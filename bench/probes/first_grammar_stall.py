"""The pause a replica's first constrained request causes in the requests running beside it:
an engine core process (the default model, no drafts) streams one 120-token request; after its
20th token a json_object-constrained request arrives (the core's first); prints the long
stream's median and largest gap between tokens. The core prepares its grammar compiler once it
has idled a heartbeat (replica/engine/core_process.py), so the largest gap should be a step or two, not
the ~0.5-0.6 s of importing xgrammar and building its vocabulary table.

Run: .venv/bin/python bench/probes/first_grammar_stall.py
"""

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from replica.config import EngineConfig
from replica.engine.core_client import ProcessEngine
from replica.request import EngineRequest, SamplingParams, StructuredOutput


async def main():
    eng = ProcessEngine(EngineConfig(num_speculative_tokens=0))
    await asyncio.sleep(3)  # idle: with the change, the core imports xgrammar here
    stamps = []

    async def long():
        async for _out in eng.generate(
            EngineRequest(
                list(range(1000, 1060)),
                SamplingParams(max_tokens=120, temperature=0, ignore_eos=True),
                "long",
            )
        ):
            stamps.append(time.perf_counter())

    async def constrained():
        while len(stamps) < 20:
            await asyncio.sleep(0.01)
        async for _out in eng.generate(
            EngineRequest(
                list(range(2000, 2030)),
                SamplingParams(max_tokens=10, structured=StructuredOutput("json_object")),
                "c",
            )
        ):
            pass

    await asyncio.gather(long(), constrained())
    gaps = sorted(1000 * (b - a) for a, b in zip(stamps[1:], stamps[2:]))
    print(f"long stream gaps ms: median {gaps[len(gaps) // 2]:.1f} max {gaps[-1]:.1f}")
    eng.shutdown()


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__).parse_args()
    asyncio.run(main())
