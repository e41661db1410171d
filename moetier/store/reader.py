"""Expert reads from the slow tier: O_DIRECT, chunked, on a small thread pool with priorities.

A load is split into chunks so several reads are in flight at once (the virtio disk here reads ~0.3 GB/s at
queue depth 1 with 1 MiB requests and 2-2.7 GB/s with four 2-4 MiB requests in flight). On-demand loads go
before prefetches; a queued read can be cancelled, a running one cannot (PreScope's and HOBBIT's premise).
O_DIRECT keeps the OS page cache from silently holding "offloaded" experts; where the filesystem refuses it,
reads fall back to buffered I/O followed by posix_fadvise(DONTNEED).
A blob's first read is checked against its CRC-32 as its chunks land: each thread takes the CRC of its own
chunk while the disk reads the others, and the last combines them (zlib-ng's SIMD CRC: ~0.2 ms CPU per
12 MiB expert here; zlib 1.2's took ~3-5 ms, on 2 cores as much CPU as the layer's compute).
"""

from __future__ import annotations

import heapq
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from zlib_ng.zlib_ng import crc32, crc32_combine

from moetier.errors import ChecksumError, MoetierError, StoreError
from moetier.store.format import ALIGN, DAMAGED, BlobRef

# Reads in flight past what any disk queues usefully (an NVMe drive saturates at 16-32 outstanding 2 MiB reads;
# each thread holds one), and below what a container's thread limit refuses.
MAX_READER_THREADS = 64


def check_reader_threads(n: int, name: str = "--reader-threads") -> int:
    if not 1 <= n <= MAX_READER_THREADS:
        raise MoetierError(f"{name} must be between 1 and {MAX_READER_THREADS}, got {n}",
                           hint=f"more than {MAX_READER_THREADS} read threads fill no disk faster; the default is 4")
    return n

ON_DEMAND, PREFETCH = 0, 1


def read_error(store_dir: Path, blob: BlobRef, cause: str) -> StoreError:
    """A read that failed (an I/O error, a file that shrank or went away): which expert, which file, why."""
    return StoreError(f"cannot read expert {blob.expert} of layer {blob.layer} ({blob.precision}) from "
                      f"{store_dir / blob.file}: {cause}",
                      hint="check the disk the store is on (dmesg); if the file was changed, " + DAMAGED)


class Completion:
    """Reusable completion state of one load (one per cache slot: no allocation per load)."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.done.set()
        self.lock = threading.Lock()
        self.remaining = 0
        self.generation = 0  # bumped per load, so chunks of a cancelled earlier load are recognised as stale
        self.started = 0  # chunks a reader thread has taken; once one has, the load can no longer be cancelled
        self.cancelled = False
        self.error: BaseException | None = None
        self.blob: BlobRef | None = None
        self.dest: memoryview | None = None
        self.chunk_crcs: list[int] | None = None  # when the blob is checked: each chunk's crc32, as it lands

    def reset(self, blob: BlobRef, dest: memoryview, chunks: int, verify: bool = False) -> None:
        self.done.clear()
        self.generation += 1
        self.remaining, self.started, self.cancelled = chunks, 0, False
        self.error, self.blob, self.dest = None, blob, dest
        self.chunk_crcs = [0] * chunks if verify else None

    def wait(self) -> None:
        self.done.wait()
        if self.error is not None:
            raise self.error


@dataclass(order=True)
class _Chunk:
    priority: int
    seq: int
    completion: Completion = field(compare=False)
    generation: int = field(compare=False)
    fd: int = field(compare=False)
    file_offset: int = field(compare=False)
    dest: memoryview = field(compare=False)


class ExpertReader:
    def __init__(self, store_dir: Path | str, num_threads: int = 4, chunk_bytes: int = 2 << 20,
                 verify: bool = True, direct: bool = True) -> None:
        if chunk_bytes % ALIGN:
            raise ValueError(f"chunk_bytes must be a multiple of {ALIGN}")
        self.store_dir = Path(store_dir)
        self.chunk_bytes = chunk_bytes
        self.verify = verify
        self.direct = direct
        self._fds: dict[str, tuple[int, bool]] = {}
        self._verified: set[tuple[int, int, str]] = set()  # checksums are checked on a blob's first read
        self._queue: list[_Chunk] = []
        self._cv = threading.Condition()
        self._seq = 0
        self._closed = False
        # Disk activity, for benchmarks: time with at least one read running, and the bytes those reads brought.
        self._running, self._busy_since, self._busy_s, self._bytes_read = 0, 0.0, 0.0, 0
        self._threads = [threading.Thread(target=self._work, name=f"moetier-reader-{i}", daemon=True)
                         for i in range(num_threads)]
        for t in self._threads:
            t.start()

    def _fd(self, blob: BlobRef) -> tuple[int, bool]:
        entry = self._fds.get(blob.file)
        if entry is None:
            path = str(self.store_dir / blob.file)
            try:
                entry = (os.open(path, os.O_RDONLY | os.O_DIRECT), True) if self.direct else None
            except OSError:  # e.g. tmpfs: no O_DIRECT
                entry = None
            if entry is None:
                try:
                    entry = (os.open(path, os.O_RDONLY), False)
                except OSError as e:  # the file is gone, or its drive
                    raise read_error(self.store_dir, blob, e.strerror or str(e)) from None
            self._fds[blob.file] = entry
        return entry

    def submit(self, blob: BlobRef, dest: memoryview, completion: Completion, priority: int = ON_DEMAND) -> None:
        """Queue a read of `blob` into `dest` (ALIGN-aligned, blob.length bytes); `completion` fires when done."""
        fd, _ = self._fd(blob)
        n = (blob.length + self.chunk_bytes - 1) // self.chunk_bytes
        verify = self.verify and (blob.layer, blob.expert, blob.precision) not in self._verified
        completion.reset(blob, dest, n, verify)
        with self._cv:
            for i in range(n):
                a = i * self.chunk_bytes
                b = min(a + self.chunk_bytes, blob.length)
                self._seq += 1
                heapq.heappush(self._queue, _Chunk(priority, self._seq, completion, completion.generation, fd,
                                                   blob.offset + a, dest[a:b]))
            self._cv.notify(n)

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                chunk = heapq.heappop(self._queue)
                c = chunk.completion
                if c.cancelled or chunk.generation != c.generation:
                    continue  # dropped lazily: cancel() already reported that load as done
                c.started += 1
                if self._running == 0:
                    self._busy_since = time.perf_counter()
                self._running += 1
            n = 0
            try:
                n = os.preadv(chunk.fd, [chunk.dest], chunk.file_offset)  # releases the GIL
                if n != len(chunk.dest):
                    raise read_error(self.store_dir, c.blob, f"the file ends early ({n} of {len(chunk.dest)} bytes "
                                                             f"at offset {chunk.file_offset}): it changed since it "
                                                             f"was written")
                if not self._fds[c.blob.file][1]:
                    os.posix_fadvise(chunk.fd, chunk.file_offset, n, os.POSIX_FADV_DONTNEED)
            except BaseException as e:  # reported to the waiter, never lost in the thread
                c.error = c.error or (e if isinstance(e, StoreError) else
                                      read_error(self.store_dir, c.blob, getattr(e, "strerror", None) or repr(e)))
            with self._cv:
                self._running -= 1
                self._bytes_read += n
                if self._running == 0:
                    self._busy_s += time.perf_counter() - self._busy_since
            if c.chunk_crcs is not None and n:  # this thread checks its own chunk while the others read theirs
                c.chunk_crcs[(chunk.file_offset - c.blob.offset) // self.chunk_bytes] = crc32(chunk.dest)
            with c.lock:
                c.remaining -= 1
                last = c.remaining == 0
            if last:
                self._finish(c)

    def activity(self) -> tuple[float, int]:
        """(seconds during which at least one read was running, bytes read) since the reader started: the disk's
        busy time, so a benchmark can tell a disk that was slow from one that sat idle."""
        with self._cv:
            busy = self._busy_s + (time.perf_counter() - self._busy_since if self._running else 0.0)
            return busy, self._bytes_read

    def promote(self, completion: Completion) -> None:
        """A queued load is needed now: its chunks not yet taken move to on-demand priority, keeping their place
        among on-demand chunks by submission order (so ahead of on-demand loads submitted after it)."""
        with self._cv:
            changed = False
            for chunk in self._queue:  # a few dozen chunks at most
                if chunk.completion is completion and chunk.generation == completion.generation \
                        and chunk.priority != ON_DEMAND:
                    chunk.priority, changed = ON_DEMAND, True
            if changed:
                heapq.heapify(self._queue)

    def cancel(self, completion: Completion) -> bool:
        """Cancel a queued load. True if none of its reads had started (the slot was never written);
        False if a read is running or done — a running read is never interrupted."""
        with self._cv:
            if completion.done.is_set() or completion.started:
                return False
            completion.cancelled = True
            completion.done.set()
            return True

    def _finish(self, c: Completion) -> None:
        blob = c.blob
        key = (blob.layer, blob.expert, blob.precision)
        if c.error is None and c.chunk_crcs is not None:
            crc = c.chunk_crcs[0]
            for i, chunk_crc in enumerate(c.chunk_crcs[1:], 1):
                crc = crc32_combine(crc, chunk_crc, min(self.chunk_bytes, blob.length - i * self.chunk_bytes))
            if crc != blob.crc32:
                c.error = ChecksumError(
                    f"expert {blob.expert} of layer {blob.layer} ({blob.precision}) fails its checksum "
                    f"in {self.store_dir / blob.file}", hint=DAMAGED)
            else:
                self._verified.add(key)
        c.done.set()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            for chunk in self._queue:  # nobody waits forever on a load that will never run
                chunk.completion.error = StoreError("the expert reader was closed before this load ran")
                chunk.completion.done.set()
            self._queue.clear()
            self._cv.notify_all()
        for t in self._threads:
            t.join()
        for fd, _ in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> ExpertReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
