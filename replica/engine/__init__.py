"""The engine, split by job:

core.py             Engine: scheduler + runner + detokenizer, stepped one batch at a time
output_processor.py detokenization and stop strings
llm.py              the offline LLM
driver.py           what both serving transports apply to an Engine between steps
streaming.py        the caller's side of a serving engine: a stream per request
async_engine.py     the engine on a thread of the replica's process
core_process.py     the engine core in a process of its own (its loop and entry point)
core_client.py      the replica's side of that process (ProcessEngine)
prestart.py         a core started before Ray, adopted by the first replica
wire.py             the typed messages between a front and its core
"""

from __future__ import annotations

from replica.engine.async_engine import AsyncEngine
from replica.engine.core import Engine, load_eos_token_ids, make_runner
from replica.engine.llm import LLM, CompletionOutput
from replica.engine.output_processor import OutputProcessor
from replica.engine.streaming import StreamingEngine
from replica.engine.wire import EngineInfo, StepReport
from replica.request import EngineDeadError, EngineOverloaded, RequestRejected

__all__ = [
    "AsyncEngine",
    "CompletionOutput",
    "Engine",
    "EngineDeadError",
    "EngineInfo",
    "EngineOverloaded",
    "LLM",
    "OutputProcessor",
    "RequestRejected",
    "StepReport",
    "StreamingEngine",
    "load_eos_token_ids",
    "make_runner",
]
