"""The replica package's public surface: what the router (and any other client of a replica)
may import. Everything else under replica/ is the engine's own and may change without notice;
tests/test_import_graph.py holds the router to this module (and to replica.config, the engine
settings the router's own settings extend)."""

from __future__ import annotations

from replica.contracts import (
    ACCEPTED_NOTICE_S,
    Accepted,
    AutoscalingStats,
    Fed,
    FeedAddress,
    GenerateRequest,
    PreemptionRate,
    RoutingStats,
)
from replica.errors import (
    EngineDeadError,
    EngineOverloaded,
    FeedBroken,
    GrammarRejected,
    LoRAError,
    ReplicaDraining,
    RequestRejected,
)
from replica.hub import find_hub, get_hub
from replica.kv_events import CLEARED, REMOVED, STORED, KVEventBatch, KVSnapshot, call_hub
from replica.limits import EngineLimits
from replica.metrics import merge_expositions
from replica.request import (
    EngineRequest,
    KVFetch,
    LoRARequest,
    PoolingRequest,
    RequestOutput,
    Resume,
    extend_block_hashes,
    root_block_hash,
)
from replica.sampling_params import (
    LOGIT_BIAS_BOUND,
    MAX_LOGPROBS,
    SAMPLING_BOUNDS,
    Bound,
    SamplingParams,
    StructuredOutput,
    check_logit_bias,
)
from replica.startup import freeze_heap
from replica.structured import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, grammar_engine_loaded
from replica.tokenizer import LazyTokenizer
from replica.tracing import (
    TracingConfig,
    routing_span,
    traced_admission,
    traced_jobs,
    traced_request,
)
from replica.tracing import configure as configure_tracing

__all__ = [
    "TracingConfig",
    "configure_tracing",
    "routing_span",
    "traced_admission",
    "traced_jobs",
    "traced_request",
    "ACCEPTED_NOTICE_S",
    "Accepted",
    "AutoscalingStats",
    "Bound",
    "CLEARED",
    "EngineDeadError",
    "EngineLimits",
    "EngineOverloaded",
    "EngineRequest",
    "Fed",
    "FeedAddress",
    "FeedBroken",
    "KVFetch",
    "LoRARequest",
    "PoolingRequest",
    "Resume",
    "root_block_hash",
    "GenerateRequest",
    "GrammarRejected",
    "KVEventBatch",
    "KVSnapshot",
    "LOGIT_BIAS_BOUND",
    "LazyTokenizer",
    "MAX_LOGPROBS",
    "PreemptionRate",
    "REMOVED",
    "RequestOutput",
    "ReplicaDraining",
    "RequestRejected",
    "LoRAError",
    "RoutingStats",
    "SAMPLING_BOUNDS",
    "STORED",
    "SamplingParams",
    "StructuredOutput",
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "call_hub",
    "check_logit_bias",
    "extend_block_hashes",
    "find_hub",
    "freeze_heap",
    "get_hub",
    "grammar_engine_loaded",
    "merge_expositions",
]
