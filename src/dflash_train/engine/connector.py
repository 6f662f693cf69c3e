"""The project's KV connector: vLLM hands each finished request's selected-layer hidden states
to the trainer through a memory-backed directory, never through disk.

Loaded by vLLM inside its own environment (`kv_transfer_config = {"kv_connector":
"DFlashHandOverConnector", "kv_connector_module_path": "dflash_train.engine.connector",
"kv_role": "kv_producer", "kv_connector_extra_config": {"handover_dir": DIR}}`) together with
`speculative_config = {"method": "extract_hidden_states", ...}`: vLLM's extract-hidden-states
model writes the auxiliary layers' states of every computed token into a cache-only attention
layer (blocks of shape (num_blocks, K, block_size, hidden): K = the layers asked for, nothing
else), and this connector reads a finished request's blocks out of it.

The hand-over, per request (one prompt of n tokens):
- scheduler side: `request_finished` keeps the request's blocks alive (returns True) and names
  its file, `DIR/<request id>.bin`, in the output's `kv_transfer_params` (`hidden_states_path`,
  `num_tokens`);
- worker side, TP rank 0 only (the residual stream, hence this cache, is whole on every rank):
  the next step's `get_finished` gathers the n token slots into (n, K, hidden) and writes its raw
  bytes (the engine's dtype, C order) to `<file>.part`, then renames it to `<file>`: a reader
  never sees a partial file. The request is then reported done and vLLM frees its blocks.
  - CPU: gathered and written at once, on the engine's own thread (it is the only thread).
  - CUDA: gathered on a stream of the connector's own after the forward's work, copied into
    pinned host memory there (non-blocking), and the request reported done once that copy's
    event has completed (the blocks may then be reused); a writer thread writes the host copy.
    Host memory rather than a device hand-over: the trainer is another process (often on
    other devices or another node), and a device hand-over would hold the engine's KV blocks
    until the trainer had copied them.
- the engine server answers the client once every file of its job exists; the client reads and
  deletes them (`DIR` is on a tmpfs, /dev/shm: memory, bounded by the server's admission).

Imports vLLM: only ever imported inside the engine process.
"""

from __future__ import annotations

import os
import re
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.config import VllmConfig, get_layers_from_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

FILE_SUFFIX = ".bin"
PART_SUFFIX = ".part"


def handover_path(directory: str, request_id: str) -> str:
    """Where a request's features are handed over (request ids may hold any character)."""
    return os.path.join(directory, re.sub(r"[^A-Za-z0-9_.-]", "_", request_id) + FILE_SUFFIX)


def write_atomically(path: str, states: torch.Tensor) -> None:
    """`states` (host, contiguous) as raw bytes at `path`, visible only once complete."""
    part = path + PART_SUFFIX
    with open(part, "wb") as f:
        f.write(states.view(torch.uint8).numpy().data)  # (n, K, hidden) in C order
    os.replace(part, path)


@dataclass
class Save:
    """One finished request's hand-over: its blocks in the hidden-state group and its file."""

    req_id: str
    path: str
    num_tokens: int
    block_ids: list[int]


@dataclass
class HandOverMetadata(KVConnectorMetadata):
    saves: list[Save] = field(default_factory=list)


def hidden_state_group(kv_cache_config: KVCacheConfig | None) -> int:
    """Index of the KV cache group that holds the extracted hidden states."""
    if kv_cache_config is None:
        return 0
    from vllm.v1.kv_cache_interface import HiddenStateCacheSpec

    groups = kv_cache_config.kv_cache_groups
    found = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, HiddenStateCacheSpec)]
    if len(found) == 1:
        return found[0]
    if not found and len(groups) == 1:
        return 0
    raise ValueError(f"cannot tell the hidden-state cache group among {len(groups)} groups")


def pinned_like(t: torch.Tensor) -> torch.Tensor:
    """An empty page-locked host tensor of `t`'s shape and dtype (a non-blocking copy target)."""
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)


class DFlashHandOverConnector(KVConnectorBase_V1, SupportsHMA):
    """See the module docstring."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self._dir = str(extra.get("handover_dir") or "")
        if not self._dir:
            raise ValueError("DFlashHandOverConnector needs kv_connector_extra_config.handover_dir")
        self._group = hidden_state_group(kv_cache_config)
        # Scheduler side: saves named by request_finished, sent with the next step's metadata.
        self._to_send: list[Save] = []
        # Worker side.
        self._cache: torch.Tensor | None = None  # (num_blocks, K, block_size, hidden)
        self._writes_here = True
        self._finished: set[str] = set()  # finished ids the scheduler told us about
        self._saved: set[str] = set()  # ids whose states are safe in host memory
        self._in_flight: dict[str, tuple[torch.cuda.Event, torch.Tensor, str]] = {}
        self._stream: torch.cuda.Stream | None = None
        self._writer: ThreadPoolExecutor | None = None
        self._writes: list[Future] = []

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False  # a producer only: nothing is ever loaded

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        return None

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = HandOverMetadata(saves=self._to_send)
        self._to_send = []
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        if not block_ids or request.prompt_token_ids is None:
            return False, None  # aborted before it ran: nothing to hand over
        n = len(request.prompt_token_ids)
        path = handover_path(self._dir, request.request_id)
        self._to_send.append(Save(request.request_id, path, n, list(block_ids)))
        return True, {"hidden_states_path": path, "num_tokens": n}

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        if not 0 <= self._group < len(block_ids):
            return False, None
        return self.request_finished(request, block_ids[self._group])

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        # Tokens of one block contiguous per layer: (num_blocks, K, block_size, hidden).
        return "LBNHC"

    def get_finished_count(self) -> int:
        return 1  # TP rank 0 alone hands over, so one notice per request

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer

        self._writes_here = get_tensor_model_parallel_rank() == 0
        layers = get_layers_from_vllm_config(
            self._vllm_config, CacheOnlyAttentionLayer, list(kv_caches)
        )
        if len(layers) != 1:
            raise ValueError(f"expected one hidden-state cache layer, found {len(layers)}")
        self._cache = kv_caches[next(iter(layers))]

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None  # the extract-hidden-states model fills the cache during the forward

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if not self._writes_here:
            return None, None
        meta = self._connector_metadata
        if isinstance(meta, HandOverMetadata):
            for save in meta.saves:
                self._hand_over(save)
        self._poll_device_copies()
        self._finished |= finished_req_ids
        done = self._saved & self._finished
        self._saved -= done
        self._finished -= done
        return done or None, None

    def _gather(self, save: Save) -> torch.Tensor:
        """(n, K, hidden) of the request's token slots, on the cache's device."""
        assert self._cache is not None
        block = self._cache.shape[2]
        blocks = torch.tensor(save.block_ids, dtype=torch.long)
        slots = (blocks[:, None] * block + torch.arange(block)[None, :]).flatten()[
            : save.num_tokens
        ]
        slots = slots.to(self._cache.device, non_blocking=True)
        return self._cache[slots // block, :, slots % block]

    def _copies_on_device(self) -> bool:
        """Whether the cache lives on a GPU (then the hand-over copies on a stream of its own)."""
        return self._cache is not None and self._cache.device.type == "cuda"

    def _hand_over(self, save: Save) -> None:
        if not self._copies_on_device():
            write_atomically(save.path, self._gather(save).contiguous())
            self._saved.add(save.req_id)
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(self._cache.device)
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="dflash-handover")
        self._stream.wait_stream(torch.cuda.current_stream(self._cache.device))
        with torch.cuda.stream(self._stream):
            states = self._gather(save)
            host = pinned_like(states)
            host.copy_(states, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        self._in_flight[save.req_id] = (done, host, save.path)

    def _poll_device_copies(self) -> None:
        for req_id, (event, host, path) in list(self._in_flight.items()):
            if event.query():
                del self._in_flight[req_id]
                assert self._writer is not None
                self._writes.append(self._writer.submit(write_atomically, path, host))
                self._saved.add(req_id)
        for f in [f for f in self._writes if f.done()]:
            self._writes.remove(f)
            f.result()  # a failed write fails the step (the server then reports the engine dead)

    def shutdown(self) -> None:
        if self._writer is not None:
            self._writer.shutdown(wait=True)
