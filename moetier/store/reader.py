"""Expert reads from the slow tier: O_DIRECT, chunked, on a small thread pool with priorities.

A load is split into chunks so several reads are in flight at once (the virtio disk here reads ~0.3 GB/s at
queue depth 1 with 1 MiB requests and 2-2.7 GB/s with four 2-4 MiB requests in flight). On-demand loads go
before prefetches; a queued read can be cancelled, a running one cannot (PreScope's and HOBBIT's premise).
O_DIRECT keeps the OS page cache from silently holding "offloaded" experts; where the filesystem refuses it,
reads fall back to buffered I/O followed by posix_fadvise(DONTNEED).
A blob's first read is checked against its CRC-32 as its chunks land: each thread takes the CRC of its own
chunk while the disk reads the others, and the last combines them (zlib-ng's SIMD CRC: ~0.2 ms CPU per
12 MiB expert here; zlib 1.2's took ~3-5 ms, on 2 cores as much CPU as the layer's compute).

A linked blob (moetier/store/format.py, version 3) is read from its segments in the source's safetensors files,
which sit wherever the checkpoint put them, usually mid-page (after a header of any length). Its slot starts as
far into a page (HostSlots' slack, BlobRef.phase), so each segment's whole pages are read in place by O_DIRECT;
a piece whose file offset, length or destination is still not aligned — a segment's partial first and last page,
segments that disagree, a GPU's staging buffer — is read as the aligned span around it into the thread's own
bounce buffer and copied out (a memmove that releases the GIL). Copying whole experts that way (a 12 MiB memmove
per miss on two busy cores) was 15% slower than a copied store at a 25% cache in one round of bench/bench_linked.py
and not slower in the other; the two rounds were all it ran.
"""

from __future__ import annotations

import ctypes
import heapq
import mmap
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from zlib_ng.zlib_ng import crc32, crc32_combine

from moetier.errors import ChecksumError, MoetierError, StoreError
from moetier.portable import drop_cached, open_uncached
from moetier.store.format import ALIGN, DAMAGED, BlobRef, Manifest
from moetier.store.names import MANIFEST

# Reads in flight past what any disk queues usefully (an NVMe drive saturates at 16-32 outstanding 2 MiB reads;
# each thread holds one), and below what a container's thread limit refuses.
MAX_READER_THREADS = 64


def check_reader_threads(n: int, name: str = "--reader-threads") -> int:
    if not 1 <= n <= MAX_READER_THREADS:
        raise MoetierError(f"{name} must be between 1 and {MAX_READER_THREADS}, got {n}",
                           hint=f"more than {MAX_READER_THREADS} read threads fill no disk faster; the default is 4")
    return n

ON_DEMAND, PREFETCH = 0, 1


def read_error(store_dir: Path, blob: BlobRef, cause: str, path: str | Path | None = None) -> StoreError:
    """A read that failed (an I/O error, a file that shrank or went away): which expert, which file, why."""
    return StoreError(f"cannot read expert {blob.expert} of layer {blob.layer} ({blob.precision}) from "
                      f"{path or store_dir / blob.file}: {cause}",
                      hint="check the disk the store is on (dmesg); if the file was changed, " + DAMAGED)


def _align_down(n: int) -> int:
    return n - n % ALIGN


def _align_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _joined(pieces: list[tuple[str, int, int, int]]) -> list[tuple[str, int, int, int]]:
    """Pieces that continue each other in the file and in the blob, together under a page, as one: a tensor's last
    partial page and the next one's first are one page of the file (gate_proj's end and up_proj's start in an HF
    checkpoint), one read in place instead of two bounced."""
    out = [pieces[0]]
    for path, offset, length, at in pieces[1:]:
        p_path, p_offset, p_length, p_at = out[-1]
        if (path == p_path and offset == p_offset + p_length and at == p_at + p_length
                and length + p_length <= ALIGN):
            out[-1] = (path, p_offset, p_length + length, p_at)
        else:
            out.append((path, offset, length, at))
    return out


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
        self.chunk_lens: list[int] = []  # each chunk's bytes, in blob order (what the CRCs combine over)

    def reset(self, blob: BlobRef, dest: memoryview, lengths: list[int], verify: bool = False) -> None:
        self.done.clear()
        self.generation += 1
        self.remaining, self.started, self.cancelled = len(lengths), 0, False
        self.error, self.blob, self.dest = None, blob, dest
        self.chunk_crcs = [0] * len(lengths) if verify else None
        self.chunk_lens = lengths

    def complete(self) -> None:
        """A load satisfied without a read (the expert was in a faster tier): done at once, and a later `cancel`
        finds it done."""
        self.generation += 1
        self.remaining, self.started, self.cancelled, self.error = 0, 0, False, None
        if not self.done.is_set():  # (set already: nobody waits, and setting takes the event's lock: a GPU's
            self.done.set()  # copy from host memory completes its slot's load this way every time)

    def held(self) -> None:
        """A load its owner completes itself, later (a copy held on the host until the link has room:
        engine/copy_queue.py): not done until `complete`."""
        self.generation += 1
        self.remaining, self.started, self.cancelled, self.error = 0, 0, False, None
        self.done.clear()

    def wait(self) -> None:
        if not self.done.is_set():  # (a done load's wait without the event's lock)
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
    index: int = field(compare=False)  # its place in the blob (the order its CRC combines in)
    bounce: bool = field(compare=False)  # O_DIRECT cannot read it in place: read the aligned span around it
    path: str = field(compare=False)


class ExpertReader:
    def __init__(self, store_dir: Path | str, num_threads: int = 4, chunk_bytes: int = 2 << 20,
                 verify: bool = True, direct: bool = True, manifest: Manifest | None = None) -> None:
        """`manifest`: the store's, for linked blobs (where their source files are); read from `store_dir` if not
        given and there is one."""
        if chunk_bytes % ALIGN:
            raise ValueError(f"chunk_bytes must be a multiple of {ALIGN}")
        self.store_dir = Path(store_dir)
        if manifest is None and (self.store_dir / MANIFEST).exists():
            manifest = Manifest.load(self.store_dir)
        self.sources = {name: src.path for name, src in manifest.sources.items()} if manifest else {}
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

    def _fd(self, path: str, blob: BlobRef) -> tuple[int, bool]:
        entry = self._fds.get(path)
        if entry is None:
            try:  # (O_DIRECT where the OS and the filesystem take it: moetier/portable.py)
                entry = open_uncached(path, self.direct)
            except OSError as e:  # the file is gone, or its drive
                raise read_error(self.store_dir, blob, e.strerror or str(e), path) from None
            self._fds[path] = entry
        return entry

    def _pieces(self, blob: BlobRef) -> list[tuple[str, int, int, int]]:
        """(file, offset in it, length, offset in the blob) of each chunk to read, in blob order. A linked segment
        is cut at its file's page boundaries: its partial first and last pages apart, its whole pages in chunks."""
        if not blob.linked:
            path = str(self.store_dir / blob.file)
            return [(path, blob.offset + a, min(self.chunk_bytes, blob.length - a), a)
                    for a in range(0, blob.length, self.chunk_bytes)]
        pieces = []
        for seg in sorted(blob.segments, key=lambda s: s.dest):
            path, end = self.sources[seg.source], seg.offset + seg.length
            first, last = _align_up(seg.offset), _align_down(end)
            cuts = [seg.offset, *range(first, last, self.chunk_bytes), last, end] if first < last else \
                [seg.offset, end]
            cuts = sorted(set(cuts))
            pieces += [(path, a, b - a, seg.dest + a - seg.offset) for a, b in zip(cuts, cuts[1:])]
        return _joined(pieces)

    def submit(self, blob: BlobRef, dest: memoryview, completion: Completion, priority: int = ON_DEMAND) -> None:
        """Queue a read of `blob` into `dest` (blob.length bytes; ALIGN-aligned, or for a linked blob as far into a
        page as BlobRef.phase says); `completion` fires when done."""
        pieces = self._pieces(blob)
        fds = {path: self._fd(path, blob) for path in {p[0] for p in pieces}}
        verify = self.verify and (blob.layer, blob.expert, blob.precision) not in self._verified
        base = ctypes.addressof(ctypes.c_char.from_buffer(dest))  # O_DIRECT needs the memory aligned too
        completion.reset(blob, dest, [p[2] for p in pieces], verify)
        with self._cv:
            for i, (path, offset, length, at) in enumerate(pieces):
                fd, direct = fds[path]
                bounce = direct and bool(offset % ALIGN or length % ALIGN or (base + at) % ALIGN)
                self._seq += 1
                heapq.heappush(self._queue, _Chunk(priority, self._seq, completion, completion.generation, fd,
                                                   offset, dest[at:at + length], i, bounce, path))
            self._cv.notify(len(pieces))

    def _read(self, chunk: _Chunk, bounce: memoryview | None) -> int:
        """Read one chunk into its destination (through `bounce` where O_DIRECT cannot read it in place)."""
        if not chunk.bounce:
            return os.preadv(chunk.fd, [chunk.dest], chunk.file_offset)  # releases the GIL
        lo = _align_down(chunk.file_offset)
        span = _align_up(chunk.file_offset + len(chunk.dest)) - lo
        got = os.preadv(chunk.fd, [bounce[:span]], lo)
        n = min(len(chunk.dest), max(0, got - (chunk.file_offset - lo)))
        ctypes.memmove(ctypes.addressof(ctypes.c_char.from_buffer(chunk.dest)),
                       ctypes.addressof(ctypes.c_char.from_buffer(bounce)) + chunk.file_offset - lo, n)
        return n

    def _work(self) -> None:
        bounce = None  # this thread's, made on its first unaligned piece: a chunk and an aligned page either side
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
                if chunk.bounce and bounce is None:
                    bounce = memoryview(mmap.mmap(-1, self.chunk_bytes + 2 * ALIGN))  # page-aligned
                n = self._read(chunk, bounce)
                if n != len(chunk.dest):
                    raise read_error(self.store_dir, c.blob, f"the file ends early ({n} of {len(chunk.dest)} bytes "
                                                             f"at offset {chunk.file_offset}): it changed since it "
                                                             f"was written", chunk.path)
                if not self._fds[chunk.path][1]:
                    drop_cached(chunk.fd, chunk.file_offset, n)
            except BaseException as e:  # reported to the waiter, never lost in the thread
                c.error = c.error or (e if isinstance(e, StoreError) else
                                      read_error(self.store_dir, c.blob, getattr(e, "strerror", None) or repr(e),
                                                 chunk.path))
            with self._cv:
                self._running -= 1
                self._bytes_read += n
                if self._running == 0:
                    self._busy_s += time.perf_counter() - self._busy_since
            if c.chunk_crcs is not None and n:  # this thread checks its own chunk while the others read theirs
                c.chunk_crcs[chunk.index] = crc32(chunk.dest)
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
            for chunk_crc, length in zip(c.chunk_crcs[1:], c.chunk_lens[1:]):
                crc = crc32_combine(crc, chunk_crc, length)
            if crc != blob.crc32:
                where = (", ".join(sorted({self.sources[s.source] for s in blob.segments})) if blob.linked
                         else self.store_dir / blob.file)
                c.error = ChecksumError(
                    f"expert {blob.expert} of layer {blob.layer} ({blob.precision}) fails its checksum "
                    f"in {where}", hint=DAMAGED)
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
            if t is not threading.current_thread():  # (an engine's finalizer may run in a reader thread's collection)
                t.join()
        for fd, _ in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> ExpertReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
