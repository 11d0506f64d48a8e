"""The adapters one replica holds: an LRU of `lora_capacity` slots. A request pins its adapter
from the moment the engine takes it until it ends; an adapter it needs that is not held is
read from disk on a background thread while the request waits (the scheduler skips it), then
installed between two steps in the least recently used slot no request pins. A failed read
ends the requests that wait for it with its LoRAError."""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from replica.config import EngineConfig
from replica.errors import LoRAError
from replica.lora.peft import PeftAdapter, read_adapter
from replica.request import LoRARequest

logger = logging.getLogger(__name__)


@dataclass
class _Held:
    name: str
    path: str
    slot: int
    info: dict
    pins: set[str] = field(default_factory=set)  # ids of the unfinished requests using it
    removing: bool = False  # remove_lora while pinned: dropped when its last request ends


@dataclass
class _Reading:
    path: str
    future: concurrent.futures.Future
    waiters: set[str] = field(default_factory=set)  # request ids waiting for it
    started: float = 0.0


class LoRAManager:
    """`runner` has lora_targets, add_lora(slot, adapter, name) and remove_lora(slot)
    (ModelRunner, TensorParallelRunner); every method runs on the engine's stepping thread."""

    def __init__(self, config: EngineConfig, runner) -> None:
        self.runner = runner
        self.capacity = config.lora_capacity
        self.max_rank = config.max_lora_rank
        self.targets = runner.lora_targets
        self._held: OrderedDict[str, _Held] = OrderedDict()  # least recently used first
        self._free_slots = list(range(self.capacity, 0, -1))  # slot 0 is the base model
        self._reading: dict[str, _Reading] = {}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.num_loads = 0  # adapters installed since start (preloads, on demand, add_lora)
        self.num_evictions = 0

    # -- the engine API --------------------------------------------------------------------
    def add(self, name: str, path: str) -> dict:
        """Read and install the adapter now (or refresh its place when held from `path`)."""
        held = self._held.get(name)
        if held is not None and held.path == path:
            held.removing = False
            self._held.move_to_end(name)
            return held.info
        if held is not None and held.pins:
            raise LoRAError(
                f"LoRA adapter {name!r} is loaded from {held.path!r} and in use by "
                f"{len(held.pins)} requests; cannot reload it from {path!r} now"
            )
        started = time.perf_counter()
        adapter = read_adapter(name, path, self.targets, self.max_rank)
        if held is not None:
            self._drop(held)
        slot = self._free_slot()
        if slot is None:
            raise LoRAError(self._full_message(name))
        return self._install(name, adapter, slot, time.perf_counter() - started)

    def remove(self, name: str) -> bool:
        """Drop the adapter now, or when its last request ends; False when not held."""
        held = self._held.get(name)
        if held is None:
            return False
        if held.pins:
            held.removing = True
        else:
            self._drop(held)
        return True

    def names(self) -> list[str]:
        """Held adapters, least recently used first."""
        return list(self._held)

    # -- requests --------------------------------------------------------------------------
    def acquire(self, request_id: str, lora: LoRARequest) -> None:
        """Pin the request's adapter; start reading it when it is not held."""
        held = self._held.get(lora.name)
        if held is not None and held.path != lora.path:
            if held.pins:
                raise LoRAError(
                    f"LoRA adapter {lora.name!r} is loaded from {held.path!r} and in use by "
                    f"{len(held.pins)} requests; the request names {lora.path!r}"
                )
            # the name was unloaded and loaded again from another path (the ingress's
            # registry): the old adapter goes, the new one is read below
            self._drop(held)
            held = None
        if held is not None:
            held.pins.add(request_id)
            self._held.move_to_end(lora.name)
            return
        reading = self._reading.get(lora.name)
        if reading is None:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(1, "lora-load")
            future = self._pool.submit(
                read_adapter, lora.name, lora.path, self.targets, self.max_rank
            )
            reading = self._reading[lora.name] = _Reading(
                lora.path, future, started=time.perf_counter()
            )
        elif reading.path != lora.path:
            raise LoRAError(
                f"LoRA adapter {lora.name!r} is loading from {reading.path!r}; the request "
                f"names {lora.path!r}"
            )
        reading.waiters.add(request_id)

    def release(self, request_id: str, lora: LoRARequest) -> None:
        """The request ended: unpin its adapter (dropped now if remove_lora asked)."""
        held = self._held.get(lora.name)
        if held is not None and request_id in held.pins:
            held.pins.discard(request_id)
            if held.removing and not held.pins:
                self._drop(held)
            return
        reading = self._reading.get(lora.name)
        if reading is not None:
            reading.waiters.discard(request_id)

    def ready(self, lora: LoRARequest) -> bool:
        """Whether the adapter is installed (a request waiting for it is not schedulable)."""
        return lora.name in self._held

    @property
    def loading(self) -> bool:
        return bool(self._reading)

    def wait(self, timeout_s: float) -> None:
        """Block up to `timeout_s` for a background read to finish (the step loop has nothing
        else to run)."""
        futures = [r.future for r in self._reading.values()]
        if futures:
            concurrent.futures.wait(
                futures, timeout_s, return_when=concurrent.futures.FIRST_COMPLETED
            )

    def poll(self) -> list[tuple[str, BaseException]]:
        """Install the adapters whose read finished (when a slot can be had); returns
        (request id, error) for each waiting request whose adapter failed to load."""
        errors = []
        for name, reading in list(self._reading.items()):
            if not reading.future.done():
                continue
            exc = reading.future.exception()
            if exc is not None:
                del self._reading[name]
                if not isinstance(exc, LoRAError):
                    exc = LoRAError(f"LoRA adapter {name!r}: loading failed: {exc}")
                errors += [(rid, exc) for rid in reading.waiters]
                continue
            if not reading.waiters:  # every request waiting for it ended meanwhile
                del self._reading[name]
                continue
            held = self._held.get(name)
            if held is not None:  # add_lora loaded it meanwhile
                del self._reading[name]
                held.pins |= reading.waiters
                continue
            slot = self._free_slot()
            if slot is None:  # every slot pinned: retried after the next step
                continue
            del self._reading[name]
            info = self._install(
                name, reading.future.result(), slot, time.perf_counter() - reading.started
            )
            self._held[name].pins |= reading.waiters
            logger.info("LoRA adapter %r loaded on demand (%s)", name, info)
        return errors

    # -- slots -----------------------------------------------------------------------------
    def _free_slot(self) -> int | None:
        """A free slot, else the least recently used unpinned adapter's; None when all pin."""
        if self._free_slots:
            return self._free_slots.pop()
        victim = next((h for h in self._held.values() if not h.pins), None)
        if victim is None:
            return None
        self._drop(victim)
        self.num_evictions += 1
        return self._free_slots.pop()

    def _install(self, name: str, adapter: PeftAdapter, slot: int, read_s: float) -> dict:
        started = time.perf_counter()
        try:
            self.runner.add_lora(slot, adapter, name)
        except BaseException:
            self._free_slots.append(slot)
            raise
        info = adapter.info(name) | {"load_s": round(read_s + time.perf_counter() - started, 6)}
        self._held[name] = _Held(name, adapter.path, slot, info)
        self.num_loads += 1
        return info

    def _drop(self, held: _Held) -> None:
        self.runner.remove_lora(held.slot)
        del self._held[held.name]
        self._free_slots.append(held.slot)

    def _full_message(self, name: str) -> str:
        return (
            f"cannot load LoRA adapter {name!r}: all {self.capacity} adapter slots "
            "(max_cpu_loras) hold adapters of unfinished requests"
        )

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
