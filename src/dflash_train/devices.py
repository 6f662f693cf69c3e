"""Device handling in one place: parsing device lists, dtypes, per-thread set-up."""

from __future__ import annotations

import contextlib
import os
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_devices(spec: str | list[str], what: str) -> list[torch.device]:
    """'cuda:0,cuda:1' or ['cpu', 'cpu'] -> devices; checks that each one exists."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    items = [s.strip() for s in items if s.strip()]
    if not items:
        raise ValueError(f"{what}: at least one device is needed")
    devices = []
    for s in items:
        try:
            d = torch.device(s)
        except RuntimeError as e:
            raise ValueError(f"{what}: {s!r} is not a device name ({e})") from None
        if d.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"{what}: {s} requested but CUDA is not available")
            idx = 0 if d.index is None else d.index
            if idx >= torch.cuda.device_count():
                raise ValueError(
                    f"{what}: {s} requested but only {torch.cuda.device_count()} CUDA devices exist"
                )
            d = torch.device("cuda", idx)
        elif d.type != "cpu":
            raise ValueError(f"{what}: only cpu and cuda devices are supported, got {s!r}")
        devices.append(d)
    return devices


def parse_dtype(name: str) -> torch.dtype:
    """'float32', 'bfloat16' or 'float16' -> the torch dtype (the keys of `DTYPES`)."""
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' is bfloat16 on CUDA and float32 on CPU (bf16 is several times slower on most CPUs);
    any other name as `parse_dtype` reads it."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return parse_dtype(name)
    except ValueError:
        raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, got {name!r}") from None


class Mark:
    """A point in one thread's queued device work: whatever it queued before the mark.

    On CPU work is done when the call that queues it returns, so a mark is always reached and
    `wait_here` does nothing. On CUDA it is an event recorded on the thread's own stream.
    """

    def __init__(self, device: torch.device, event: torch.cuda.Event | None = None) -> None:
        self.device, self.event = device, event

    def wait_here(self) -> None:
        """Queue the calling thread's later work on the mark's device after the mark: its
        current stream of that device waits for the event (no host wait)."""
        if self.event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.event)

    def wait_host(self) -> None:
        """The calling thread waits until the device has reached the mark: only where the host
        itself needs what was computed (bytes to write), and nothing queued after the mark."""
        if self.event is not None:
            self.event.synchronize()


class Lane:
    """Where one worker thread queues its device work.

    CUDA: a stream of its own, made the thread's current stream of its device by `enter`, so
    the target forward, the drafter steps and the gradient sums of different threads overlap
    instead of queueing behind each other on one default stream. Work of two lanes is ordered
    only through marks: a producer `mark()`s after its kernels, a consumer `wait_here()`s before
    it reads (see `handover`, and the rendezvous for gradients). CPU: the calling thread itself
    (marks are always reached).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def enter(self) -> None:
        if self.stream is not None:
            torch.cuda.set_device(self.device)
            torch.cuda.set_stream(self.stream)  # thread-local: other threads keep theirs

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The calling thread queues its work on this lane inside the block (a side lane: a
        copy that must not sit on the thread's own stream); its own stream after."""
        if self.stream is None:
            yield
            return
        with torch.cuda.stream(self.stream):
            yield

    def mark(self) -> Mark:
        """A mark after everything this lane has queued so far."""
        if self.stream is None:
            return Mark(self.device)
        event = torch.cuda.Event()
        event.record(self.stream)
        return Mark(self.device, event)


def enter_worker_thread(device: torch.device) -> Lane:
    """First thing in every worker thread: select its device and give the thread its own lane
    (stream) there. Returns the lane, whose marks order other threads' reads after its work."""
    lane = Lane(device)
    lane.enter()
    return lane


def marks_here(devices: list[torch.device]) -> list[Mark]:
    """Marks after the calling thread's queued work on each of `devices` (its current streams),
    for threads that use what it just computed there."""
    out = []
    for device in dict.fromkeys(devices):
        event = None
        if device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
        out.append(Mark(device, event))
    return out


def wait_for(marks: list[Mark], device: torch.device | None = None) -> None:
    """The calling thread's later work waits for `marks` (only those on `device` if given)."""
    for mark in marks:
        if device is None or mark.device == device:
            mark.wait_here()


@runtime_checkable
class HostStaged(Protocol):
    """Features a worker left in host memory in a compact form (`store.codec.StagedRows`: a
    store's bytes), which the thread that uses them copies to its device and expands there."""

    @property
    def nbytes(self) -> int: ...

    def to_device(self, device: torch.device) -> torch.Tensor: ...


CPU_ALLOCATOR_FAILED = "DefaultCPUAllocator: can't allocate memory"
"""What torch's host allocator says when an allocation fails: it raises a plain RuntimeError, not
`torch.OutOfMemoryError`, for host memory."""


def is_out_of_memory(e: BaseException) -> bool:
    """Whether `e` is a device out of memory: CUDA's `torch.OutOfMemoryError`, or the CPU
    allocator's failed allocation (one too large for the host: a huge --block-size or batch)."""
    if isinstance(e, torch.OutOfMemoryError):
        return True
    return isinstance(e, RuntimeError) and CPU_ALLOCATOR_FAILED in str(e)


def host_tensor(shape: tuple[int, ...], dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    """Zeros in host memory, page-locked when `pinned` (needs CUDA): a device's copy from or to
    it is then asynchronous (from pageable memory the host stages every copy itself)."""
    return torch.zeros(shape, dtype=dtype, pin_memory=pinned)


def handover(
    tensor: torch.Tensor | HostStaged, device: torch.device, ready: Mark | None = None
) -> torch.Tensor:
    """`tensor`, produced by another thread (on its own lane), on `device`, without a host wait.

    `ready` is the producer's mark after the kernels that wrote `tensor`: this thread's stream of
    the source device waits for it, and torch queues a device-to-device copy on that stream
    with a two-way barrier to this thread's stream of `device`, so the copy runs after the
    producer and everything after the copy runs after it. The source's memory was allocated on
    the producer's stream; it is marked as used by the copy's stream, so the producer's
    allocator cannot reuse it before the copy ran; the caller then drops its reference (freed
    as soon as handed over). On a shared device there is no copy: the tensor itself, with the
    same ordering and the same protection. On CPU a plain copy (or the tensor itself).
    `HostStaged` features (a feature store's pinned rows) are copied on this thread's stream of
    `device`, asynchronously, and decoded there.
    """
    if ready is not None:
        ready.wait_here()
    if isinstance(tensor, HostStaged):
        return tensor.to_device(device)
    if device.type != "cuda" or tensor.device.type != "cuda":
        return tensor.to(device)
    out = tensor.to(device, non_blocking=True)
    tensor.record_stream(torch.cuda.current_stream(tensor.device))
    return out


def configure_allocator() -> None:
    """Expandable CUDA segments unless the user set PYTORCH_CUDA_ALLOC_CONF: batches of
    different bucket lengths otherwise fragment the cache into blocks no later batch fits.
    Read by torch at the first CUDA allocation, so call it before any."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


def configure_cpu_threads(threads: int) -> None:
    """Bound torch's intra-op threads, once, before the workers start.

    The setting is process-wide (torch applies it lazily in every thread), so setting it per
    worker would only let the last thread to start decide it for all.
    """
    if threads > 0:
        torch.set_num_threads(threads)


def default_cpu_threads(num_cpu_workers: int) -> int:
    """Intra-op threads for CPU workers: the cores shared out, at least one each."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // max(1, num_cpu_workers))


@contextlib.contextmanager
def on_device(device: torch.device) -> Iterator[None]:
    """The calling thread's current CUDA device is `device` inside the block (a no-op on CPU).

    For work the main thread does for one device after another (warm-ups, cost probes, graph
    captures): without it the current device stays cuda:0, where events, streams and graphs
    made without an explicit device would land.
    """
    if device.type != "cuda":
        yield
        return
    with torch.cuda.device(device):
        yield


def synchronize(device: torch.device) -> None:
    """Wait for queued device work (for timings); a no-op on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class _Group:
    """The segments of one unit of work (a micro-batch, an optimizer step)."""

    host: dict[str, float] = field(default_factory=dict)
    events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list)

    def done(self) -> bool:
        # Events on one stream complete in order: the last one done means all are.
        return not self.events or self.events[-1][2].query()

    def seconds(self) -> dict[str, float]:
        out = dict(self.host)
        for name, start, end in self.events:
            out[name] = out.get(name, 0.0) + start.elapsed_time(end) / 1000.0
        return out


class SegmentClock:
    """Times named code segments on one device without waiting for it.

    Segments are grouped into units of work (`end_group()` closes one: a micro-batch however
    many chunks it ran, or an optimizer step). `harvest()` returns the seconds of the groups the
    device has already finished: CUDA events are only queried (no host sync), so the hot loop
    never waits for the device to time it; on CPU the host clock is exact at once. Unfinished
    groups stay pending until a later harvest (`wait=True` at the end of a run waits for them).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._current = _Group()
        self._pending: deque[_Group] = deque()

    @contextlib.contextmanager
    def segment(self, name: str) -> Iterator[None]:
        if self.device.type == "cuda":
            # On this device's current stream, whatever device the calling thread is on.
            stream = torch.cuda.current_stream(self.device)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            yield
            end.record(stream)
            self._current.events.append((name, start, end))
        else:
            t0 = time.perf_counter()
            yield
            host = self._current.host
            host[name] = host.get(name, 0.0) + time.perf_counter() - t0

    def end_group(self) -> None:
        """Close the current unit of work."""
        self._pending.append(self._current)
        self._current = _Group()

    def harvest(self, wait: bool = False) -> list[dict[str, float]]:
        """Seconds per segment name of every finished group, oldest first."""
        out = []
        while self._pending and (wait or self._pending[0].done()):
            group = self._pending.popleft()
            if wait and group.events:
                group.events[-1][2].synchronize()  # end of run: wait for the device once
            out.append(group.seconds())
        return out


def default_devices(
    targets: list[str] | None, drafters: list[str] | None, share: bool = False
) -> tuple[list[torch.device], list[torch.device]]:
    """Explicit lists win; otherwise cuda:0 for the target and the other GPUs for drafters
    (one GPU: both share it), or cpu / cpu without CUDA. Checked by `check_device_roles`
    (the one-GPU default shares its GPU without being asked)."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    one_gpu_default = n == 1 and not targets and not drafters
    targets = targets or (["cuda:0"] if n else ["cpu"])
    drafters = drafters or ([f"cuda:{i}" for i in range(1, n)] or ["cuda:0"] if n else ["cpu"])
    t, d = parse_devices(targets, "target_devices"), parse_devices(drafters, "drafter_devices")
    check_device_roles(t, d, share or one_gpu_default)
    return t, d


def check_device_roles(
    targets: list[torch.device], drafters: list[torch.device], share: bool
) -> None:
    """One worker per GPU and role: a GPU twice in one list is refused (two workers would
    fight over it), a GPU in both lists needs `share` (--share-device). `cpu` may repeat: CPU
    workers share the cores (see --cpu-threads)."""
    for devices, what in ((targets, "--target-devices"), (drafters, "--drafter-devices")):
        gpus = [d for d in devices if d.type == "cuda"]
        twice = sorted({str(d) for d in gpus if gpus.count(d) > 1})
        if twice:
            raise ValueError(f"{what} lists {', '.join(twice)} more than once: one worker per GPU")
    both = sorted({str(d) for d in targets if d.type == "cuda" and d in drafters})
    if both and not share:
        raise ValueError(
            f"{', '.join(both)} is both a target and a drafter device; pass --share-device to "
            "let the roles time-slice it, or give each role its own GPUs"
        )
