"""Populate the CPU KV cache's pages ahead of use, on a background thread at idle priority.

The CPU KV cache lies on fresh anonymous memory (runner.zero_pages), so start-up writes nothing and
only blocks in use become resident; but the first write to each 4 KiB page then takes a page fault
inside the step's forward (~15-20 us each on a small VM: about a fifth of a short prompt's prefill
step, docs/perf-first-token.md). `KVPrefaulter` keeps the pages of the blocks the scheduler will
hand out next already mapped: the block pool hands out never-used blocks in increasing id order (its
free queue starts 0..N-1 and freed blocks rejoin at its tail), so the pages to populate are those of
the blocks just above the highest block id a step has used. A daemon thread at SCHED_IDLE (nice 19
where that is refused) asks the kernel to map them with madvise(MADV_POPULATE_WRITE) (Linux 5.14+),
which zero-fills and maps each page without writing to it (a page the forward filled meanwhile keeps
its contents), in small pieces so that it holds the address space's lock only briefly. Resident
memory stays what is in use plus the window ahead. Without MADV_POPULATE_WRITE the pages fault in as
before (logged once)."""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading
import time

import torch

logger = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # linux/mman.h (5.14+)
PAGE = mmap.PAGESIZE
PIECE_BYTES = 256 * 1024  # one madvise call: ~64 pages, well under a millisecond

_libc = None
_unsupported = False  # the kernel refused MADV_POPULATE_WRITE once: do not ask again


def _madvise():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.restype = ctypes.c_int
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return _libc.madvise


def populate(address: int, length: int) -> bool:
    """Map the pages of [address, address + length) for writing without changing their
    contents; False where the kernel lacks MADV_POPULATE_WRITE. The range is widened to whole
    pages. Raises OSError on any other failure."""
    global _unsupported
    if _unsupported or length <= 0:
        return not _unsupported
    start = address - address % PAGE
    end = -(-(address + length) // PAGE) * PAGE
    if _madvise()(start, end - start, MADV_POPULATE_WRITE) == 0:
        return True
    err = ctypes.get_errno()
    if err == errno.EINVAL:  # unknown advice: a kernel before 5.14
        _unsupported = True
        return False
    raise OSError(err, f"madvise(MADV_POPULATE_WRITE) of {end - start} bytes: {os.strerror(err)}")


def _lower_own_priority() -> str:
    """Run the calling thread only when a CPU would otherwise idle (SCHED_IDLE; else nice 19)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: this thread
        return "SCHED_IDLE"
    except (AttributeError, OSError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        return "nice 19"
    except (AttributeError, OSError):
        return "normal priority"


class KVPrefaulter:
    """Keeps the pages of KV blocks [0, highest block used + 1 + ahead_blocks) populated.

    `tensors` are the cache's per-layer K and V tensors, each [num_blocks, ...] and contiguous
    (the runner's layout); `need(n)` says a step used blocks below n (cheap: it only moves a
    target and wakes the thread). `close()` stops the thread (the runner's shutdown)."""

    def __init__(self, tensors: list[torch.Tensor], ahead_blocks: int) -> None:
        if not tensors:
            raise ValueError("KVPrefaulter needs the KV cache's tensors")
        self.num_blocks = int(tensors[0].shape[0])
        if any(t.shape[0] != self.num_blocks or not t.is_contiguous() for t in tensors):
            raise ValueError("KV cache tensors must be contiguous with the same number of blocks")
        self.ahead_blocks = max(1, int(ahead_blocks))
        self._tensors = tensors  # keeps the mappings alive while the thread reads them
        self._ranges = [(t.data_ptr(), t[0].numel() * t.element_size()) for t in tensors]
        self._cond = threading.Condition()
        self._target = min(self.num_blocks, self.ahead_blocks)
        self._limit = self.num_blocks  # shrink() lowers it
        self.populated_blocks = 0  # blocks [0, populated_blocks) are mapped on every tensor
        self.busy_s = 0.0  # wall seconds spent in madvise
        self.priority = ""
        self.error: str | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kv-prefault", daemon=True)
        self._thread.start()

    def need(self, blocks_in_use: int) -> None:
        """A step used blocks below `blocks_in_use`: keep ahead_blocks more populated."""
        target = min(self._limit, blocks_in_use + self.ahead_blocks)
        if target > self._target:  # read without the lock: it only grows
            with self._cond:
                if target > self._target:
                    self._target = target
                    self._cond.notify()

    def shrink(self, num_blocks: int) -> None:
        """Only blocks below num_blocks are used from now on (the runner's shrink_kv_cache)."""
        with self._cond:
            self._limit = min(self._limit, num_blocks)
            self._target = min(self._target, self._limit)

    @property
    def done(self) -> bool:
        """Every block that can be used is populated (or the thread stopped)."""
        return self.populated_blocks >= self._limit or not self._thread.is_alive()

    def wait(self, blocks: int, timeout: float) -> bool:
        """Block until [0, blocks) is populated (tests); False on timeout or a stopped thread."""
        deadline = time.monotonic() + timeout
        while self.populated_blocks < min(blocks, self._limit):
            if not self._thread.is_alive() or time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self, timeout: float = 2.0) -> None:
        """Stop the thread; it lets go of the cache's tensors as it exits (not here: after a
        join that timed out it may still be inside madvise on their memory)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout)

    def _run(self) -> None:
        self.priority = _lower_own_priority()
        # blocks per madvise call on each tensor: about PIECE_BYTES of one tensor
        piece = max(1, PIECE_BYTES // max(1, self._ranges[0][1]))
        try:
            while True:
                with self._cond:
                    while not self._closed and self.populated_blocks >= self._target:
                        self._cond.wait()
                    if self._closed:
                        return
                    end = min(self._target, self.populated_blocks + piece)
                start = self.populated_blocks
                began = time.perf_counter()
                for address, block_bytes in self._ranges:
                    if not populate(address + start * block_bytes, (end - start) * block_bytes):
                        logger.info(
                            "the kernel lacks MADV_POPULATE_WRITE (Linux 5.14+): KV cache "
                            "pages fault in as steps first write them"
                        )
                        return
                self.busy_s += time.perf_counter() - began
                self.populated_blocks = end
                if end >= self._limit:
                    logger.debug(
                        "KV cache populated: %d blocks in %.2f s", self._limit, self.busy_s
                    )
        except Exception as exc:  # never take the engine down: the pages fault in instead
            self.error = f"{type(exc).__name__}: {exc}"
            logger.warning("KV cache prefault stopped (%s): pages fault in on first write", exc)
        finally:
            self._tensors = []
