"""The flex kernel of the block mask, compiled once per process and never in a worker thread.

Without torch.compile, `flex_attention` runs an unfused path that materialises the whole score
matrix in fp32 (many times slower, tens of GB more activation memory). So on CUDA the kernel
(the block mask built AND the attention, in one compiled function) is compiled with every size
that varies between batches marked dynamic: rows, context length, blocks per chunk. One trace
then serves every planned shape of a (device, layer kind) pair within one shape class
(`shape_class`): torch specialises every size of 1 (one row, one block per chunk), the block mask
works in tiles of 128 positions (queries or keys that fit one tile), and inductor's CUDA
lowering always asks whether there are fewer than 128 queries (its decoding kernel's condition),
so 128 queries (8 blocks of 16) is a class of its own. The block mask is built inside
the compiled function, so its sizes are symbolic too (a mask built outside carries Python ints
that pin every length); `torch.compile(create_block_mask)`, which this is, replaced the
deprecated `_compile=True`. The context length reaches the mask as a 0-dim device tensor rather
than a symbolic scalar (a buffer the kernel's template can read).

Threads: the main thread may compile (the trainer's warm-up does, device by device, before the
workers start; `bench step` compiles in its warm-up steps). A worker thread runs the compiled
kernel only for a shape class the main thread has traced (`FlexKernel.key`); any other call runs
the unfused path instead of compiling there. Every unfused call on CUDA is counted
(`eager_calls()`, logged as `time/flex_eager_calls`), also one that torch itself sends to the
unfused path (a recompile past the limit, or the trainer's `eager_on_recompile` stance): the
count sits in the kernel function, which only the unfused path executes as Python.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

import torch
import torch.nn.attention.flex_attention as _fa

COMPILED_DEVICE_TYPES = ("cuda",)
"""Where flex runs compiled (flex has no backward on CPU; CPU calls run the unfused path), and
where an unfused call is counted."""
_eager_calls = 0
_count_lock = threading.Lock()


def eager_calls() -> int:
    """Calls on a compiled device type that ran the unfused path since the process started."""
    with _count_lock:
        return _eager_calls


def _count_eager() -> None:
    global _eager_calls
    with _count_lock:
        _eager_calls += 1


def _kernel(q, k, v, limits, anchors, block_size: int, window: int | None, causal: bool):
    """Block-mask attention of q (batch, heads, N * B, d) over k, v (batch, kv_heads, S + N * B,
    d): [context | the N blocks]. limits, anchors: (batch, N) (see `BlockLayout`)."""
    if not torch.compiler.is_compiling() and q.device.type in COMPILED_DEVICE_TYPES:
        _count_eager()  # only ever runs as Python on the unfused path
    b = block_size
    # The context length as a 0-dim tensor on the device: a buffer the kernel's mask reads.
    s = torch.full((), k.shape[2] - q.shape[2], dtype=torch.long, device=q.device)

    def mask_mod(bi, hi, q_idx, kv_idx):
        j, i = q_idx // b, q_idx % b
        # limits < s: a context key at or after the anchor (or a block key) never passes.
        ctx_ok = kv_idx < limits[bi, j]
        if window is not None:  # distance between absolute positions
            ctx_ok = ctx_ok & (anchors[bi, j] + i - kv_idx < window)
        k_off = (kv_idx - s) % b
        own_ok = (kv_idx >= s) & ((kv_idx - s) // b == j)
        if causal:
            own_ok = own_ok & (k_off <= i)
        if window is not None:
            own_ok = own_ok & (i - k_off < window)
            if not causal:
                own_ok = own_ok & (k_off - i < window)
        return ctx_ok | own_ok

    n_q = q.shape[2]
    mask = _fa.create_block_mask(mask_mod, q.shape[0], None, n_q, k.shape[2], device=q.device)
    return _fa.flex_attention(q, k, v, block_mask=mask, enable_gqa=True)


def _mark_dynamic(q, k, v, limits, anchors) -> None:
    """Sizes that vary between batches: rows (dim 0 of all), query and key lengths (dim 2),
    blocks per chunk (dim 1 of the layout's tensors). Heads, head dim and block size do not."""
    for t in (q, k, v):
        torch._dynamo.maybe_mark_dynamic(t, 0)
        torch._dynamo.maybe_mark_dynamic(t, 2)
    for t in (limits, anchors):
        torch._dynamo.maybe_mark_dynamic(t, 0)
        torch._dynamo.maybe_mark_dynamic(t, 1)


SHORT_QUERIES = 128
"""Inductor's CUDA flex lowering evaluates `queries < 128` on every trace (`_use_flex_decoding`
in torch/_inductor/kernel/flex/flex_decoding.py, called by flex_attention.py's lowering, in
torch 2.11 through 2.13): a guard, so a trace on either side never serves the other."""


MASK_TILE = _fa._DEFAULT_SPARSE_BLOCK_SIZE
"""Positions per tile of the block mask (queries and keys alike)."""


def shape_class(rows: int, blocks: int, block_size: int, context: int) -> tuple[bool, ...]:
    """What a compiled trace of a call over `rows` rows, `blocks` blocks of `block_size` and
    `context` context tokens is specialised on, each a condition torch guards on: rows and
    blocks of 1 (dynamo specialises sizes of 1), fewer than 128 queries (the CUDA lowering's
    `SHORT_QUERIES`), and queries and keys that fit one tile of the block mask (128 positions).
    Together: queries < 128, == 128 and > 128 are three classes."""
    tile = MASK_TILE
    n_q = blocks * block_size
    return (
        rows == 1,
        blocks == 1,
        n_q < SHORT_QUERIES,
        n_q <= tile,
        context + n_q <= tile,
    )


class _CountingBackend:
    """A torch.compile backend that counts compilations (one per trace) and delegates."""

    def __init__(self, backend: str | Callable[..., Any]) -> None:
        self.backend, self.compiles = backend, 0

    def __call__(self, gm, example_inputs):
        self.compiles += 1
        inner = self.backend
        if isinstance(inner, str):
            inner = torch._dynamo.lookup_backend(inner)
        return inner(gm, example_inputs)


class FlexKernel:
    """The process's flex kernel: compiled lazily on the main thread, run by any thread.

    `backend`: torch.compile's backend (tests trace with "eager", which skips code generation);
    `device_types`: where calls run compiled (tests add "cpu").
    """

    def __init__(
        self,
        backend: str | Callable[..., Any] = "inductor",
        device_types: tuple[str, ...] = COMPILED_DEVICE_TYPES,
    ) -> None:
        self._backend = _CountingBackend(backend)
        self.device_types = device_types
        self._compiled: Callable[..., torch.Tensor] | None = None
        self.traced: set[Hashable] = set()
        """Shape classes the main thread has run compiled (`key`)."""
        # Serialises launches: tracing (main thread) and the unfused path (which runs torch's
        # own compile of its operator) must not overlap another thread's. Host side only: the
        # kernels stay asynchronous, and the GIL serialises the launches anyway.
        self._lock = threading.Lock()

    @property
    def compiles(self) -> int:
        """Traces compiled so far (each costs seconds; the warm-up reports them)."""
        return self._backend.compiles

    @staticmethod
    def key(
        q: torch.Tensor, k: torch.Tensor, limits: torch.Tensor, window: int | None, causal: bool
    ) -> Hashable:
        """What a trace is specialised on: the device, dtype and grad mode, the layer's kind
        (window, causal) and the sizes that are 1 (`shape_class`)."""
        rows, blocks, n_q = q.shape[0], limits.shape[1], q.shape[2]
        cls = shape_class(rows, blocks, n_q // blocks, k.shape[2] - n_q)
        return (q.device, q.dtype, torch.is_grad_enabled(), window, causal, *cls)

    def __call__(self, q, k, v, limits, anchors, block_size: int, window, causal) -> torch.Tensor:
        args = (q, k, v, limits, anchors, block_size, window, causal)
        if q.device.type not in self.device_types:
            with self._lock:
                return _kernel(*args)
        key = self.key(q, k, limits, window, causal)
        main = threading.current_thread() is threading.main_thread()
        with self._lock:
            if not main and key not in self.traced:
                return _kernel(*args)  # never compile in a worker: unfused, and counted
            _mark_dynamic(q, k, v, limits, anchors)
            out = self._compiled_kernel()(*args)
            if main:
                self.traced.add(key)
            return out

    def _compiled_kernel(self) -> Callable[..., torch.Tensor]:
        if self._compiled is None:
            self._compiled = torch.compile(_kernel, backend=self._backend, fullgraph=True)
        return self._compiled


FLEX = FlexKernel()
"""The kernel every drafter replica's flex attention runs (`block_attention(..., "flex")`)."""


def ensure_recompile_limit(traces: int) -> int:
    """Let torch keep `traces` compiled versions of one function (its default keeps 8 and runs
    every later shape unfused): at least `traces`, never lowered. Returns the limit now set."""
    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, traces)
    cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 4 * traces)
    return cfg.recompile_limit


def graphs_compiled() -> int:
    """Graphs torch.compile has compiled in this process so far, every compiled function
    together (flex's traces and `--compile`'s layers): after the warm-up it must not move."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def timed_compiles(kernel: FlexKernel = FLEX) -> Callable[[], tuple[int, float]]:
    """A stopwatch of compiles: call the result to get (traces compiled, seconds) since."""
    t0, n0 = time.monotonic(), kernel.compiles
    return lambda: (kernel.compiles - n0, time.monotonic() - t0)
