"""The engine core's wire: every message between a replica's front and its engine core process,
as typed msgspec structs in two tagged unions (one per direction), encoded as MessagePack
arrays. Values the wire does not type (an exception, a call's result) travel pickled (`Pickled`).

  front -> core   Init, Add, Abort, Stop, Call, Shutdown
  core -> front   Adopted, Ready, Failed, Step, Idle, RequestError, Reply, Dead
"""

from __future__ import annotations

import enum
import pickle
from typing import Any

import msgspec

from replica.kv_events import KVEventBatch
from replica.request import EngineDeadError, EngineRequest, RequestOutput
from replica.scheduler import SchedulerStats


class Command(enum.IntEnum):
    INIT = 0
    ADD = 1
    ABORT = 2
    STOP = 3
    CALL = 4
    SHUTDOWN = 5


class Event(enum.IntEnum):
    ADOPTED = 0
    READY = 1
    FAILED = 2
    STEP = 3
    IDLE = 4
    REQUEST_ERROR = 5
    REPLY = 6
    DEAD = 7


class CoreOp(enum.Enum):
    """What a Call asks of the core between two steps."""

    THREADS = "threads"  # torch threads (and the pin): arg = count
    SLEEP = "sleep"  # fault injection: block the loop arg seconds
    KV_PUBLISH = "kv_publish"  # send KV event batches with the steps: arg = bool
    KV_SNAPSHOT = "kv_snapshot"
    KV_STATS = "kv_stats"
    GRAMMAR_COMPILER_READY = "grammar_compiler_ready"
    LORA_ADD = "lora_add"  # load a LoRA adapter now: arg = [name, path]
    LORA_REMOVE = "lora_remove"  # arg = name
    LORA_LIST = "lora_list"
    KV_EXPORT = "kv_export"  # blob = pickled block hashes: a kv_transfer.KVExport back
    KV_IMPORT = "kv_import"  # blob = pickled (KVExport, expected hashes): a KVImportResult
    KV_MEASURE = "kv_measure"  # kv_transfer.measure_engine: the start-up cost figures


class _Message(msgspec.Struct, array_like=True, tag_field="kind", omit_defaults=False):
    pass


# -- front -> core ------------------------------------------------------------------------------
class Init(_Message, tag=int(Command.INIT)):
    config: dict[str, Any]  # EngineConfig.model_dump(mode="json")
    kv_events: bool
    num_threads: int | None


class Add(_Message, tag=int(Command.ADD)):
    request: EngineRequest


class Abort(_Message, tag=int(Command.ABORT)):
    request_id: str


class Stop(_Message, tag=int(Command.STOP)):
    """A stop string the front found ended these requests."""

    request_ids: list[str]


class Call(_Message, tag=int(Command.CALL)):
    call_id: int
    op: CoreOp
    arg: int | float | bool | str | list[str] | None = None
    blob: bytes | None = None  # a bulk argument (KV blocks), pickled


class Shutdown(_Message, tag=int(Command.SHUTDOWN)):
    pass


# -- core -> front ------------------------------------------------------------------------------
class StepReport(msgspec.Struct, array_like=True):
    """What one engine step did, for the replica's metrics and KV events: made where the engine
    runs, observed where the metrics live (the same process, or the front of an engine core in
    its own process). Times are time.monotonic(), one clock for every process of a machine."""

    end: float
    step_time: float
    num_scheduled_tokens: int
    first_scheduled: list[tuple[str, float]]  # (request id, arrival) first scheduled this step
    finished_request_ids: list[str]
    stats: SchedulerStats
    kv_batch: KVEventBatch | None = None  # when KV events are published and blocks changed


class EngineInfo(msgspec.Struct):
    """What a replica reads of its engine once it is built (either transport)."""

    model_dir: str
    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    startup_s: dict[str, float]
    num_threads: int
    device: str
    thread_cpus: str = ""  # pinned or not (core_process.pin_compute_threads)
    prestarted: bool = False  # a core `stepserve serve` started before Ray (engine/prestart.py)
    # resident bytes of rank 0's weights (quant/weights.py weight_bytes: total, quantized, float)
    weight_bytes: dict[str, int] = {}


class Pickled(msgspec.Struct, array_like=True):
    """A value the wire does not type (an exception, a call's result: rare, never per step)."""

    data: bytes

    @classmethod
    def of(cls, value: Any) -> Pickled:
        if isinstance(value, BaseException):
            value = picklable(value)
        return cls(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))

    def load(self) -> Any:
        return pickle.loads(self.data)


class Adopted(_Message, tag=int(Event.ADOPTED)):
    pid: int


class Ready(_Message, tag=int(Event.READY)):
    info: EngineInfo
    stats: SchedulerStats
    num_free_blocks: int


class Failed(_Message, tag=int(Event.FAILED)):
    traceback: str


class Step(_Message, tag=int(Event.STEP)):
    outputs: list[RequestOutput]  # token ids only: the front detokenizes
    report: StepReport
    num_free_blocks: int
    num_request_states: int


class Idle(_Message, tag=int(Event.IDLE)):
    """The core's heartbeat while it has nothing to run (the front's liveness clock)."""

    stats: SchedulerStats
    num_free_blocks: int
    num_request_states: int


class RequestError(_Message, tag=int(Event.REQUEST_ERROR)):
    """A request the core could not take (its grammar, its shape): the front tells its caller."""

    request_id: str
    error: Pickled  # the exception


class Reply(_Message, tag=int(Event.REPLY)):
    call_id: int
    ok: bool
    value: Pickled  # the result, or the exception when not ok


class Dead(_Message, tag=int(Event.DEAD)):
    traceback: str


FrontMessage = Init | Add | Abort | Stop | Call | Shutdown
CoreMessage = Adopted | Ready | Failed | Step | Idle | RequestError | Reply | Dead


def picklable(exc: BaseException) -> BaseException:
    """`exc`, or an EngineDeadError naming it when it cannot cross a process boundary."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return EngineDeadError(repr(exc))


class Codec:
    """Encodes what one side sends and decodes what it receives (`receives`: the union)."""

    def __init__(self, receives: Any) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(receives)
        self.encode = self._encoder.encode
        self.decode = self._decoder.decode


def front_codec() -> Codec:
    return Codec(CoreMessage)


def core_codec() -> Codec:
    return Codec(FrontMessage)
