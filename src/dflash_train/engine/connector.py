"""The project's KV connector: vLLM hands each request's selected-layer hidden states to the
trainer through a memory-backed directory, never through disk.

Loaded by vLLM inside its own environment (`kv_transfer_config = {"kv_connector":
"DFlashHandOverConnector", "kv_connector_module_path": "dflash_train.engine.connector",
"kv_role": "kv_producer", "kv_connector_extra_config": {"handover_dir": DIR}}`) together with
`speculative_config = {"method": "extract_hidden_states", ...}`: vLLM's extract-hidden-states
model writes the auxiliary layers' states of every computed token into a cache-only attention
layer (blocks of shape (num_blocks, K, block_size, hidden): K = the layers asked for, nothing
else), and this connector reads a request's blocks out of it.

The hand-over, per request (one prompt of n tokens, one token generated: the request finishes
in the step that computes the last of its prompt):
- scheduler side: `build_connector_meta` names, in the step that computes the rest of a
  request's prompt, its blocks in the hidden-state group and its file `DIR/<request id>.bin`;
  `request_finished` puts the file's name in the output's `kv_transfer_params`
  (`hidden_states_path`, `num_tokens`) and lets vLLM free the blocks at once (returns False);
- worker side, TP rank 0 only (the residual stream, hence this cache, is whole on every rank):
  in that same step's `wait_for_save` (vLLM calls it after the target's and the drafter's
  forwards, so the cache holds every prompt token) gathers the n token slots into
  (n, K, hidden) and writes their raw bytes (the engine's dtype, C order) to `<file>.part`,
  then renames it to `<file>`: a reader never sees a partial file.
  - CPU: gathered and written at once, on the engine's own thread: the file is complete before
    vLLM reports the request finished.
  - CUDA: gathered on a stream of the connector's own after the forward's work and copied into
    pinned host memory there (non-blocking); the forward's stream then waits for that copy, so
    no later step can overwrite the blocks before it is done; a writer thread waits for the
    copy and writes the file. Host memory rather than a device hand-over: the trainer is
    another process (often on other devices or another node), and a device hand-over would
    hold the engine's KV blocks until the trainer had copied them.
  Nothing waits for a later engine step: vLLM steps only while it has requests (in-process,
  only while its client has unfinished ones), and the last request of a batch is finished, its
  blocks freed, in the step that starts its copy.
- the engine server answers the client once every file of its job exists; the client reads and
  deletes them (`DIR` is on a tmpfs, /dev/shm: memory, bounded by the server's admission).

Imports vLLM: only ever imported inside the engine process.
"""

from __future__ import annotations

import os
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

from dflash_train.engine.protocol import PART_SUFFIX, handover_path

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


def write_atomically(path: str, states: torch.Tensor) -> None:
    """`states` (host, contiguous) as raw bytes at `path`, visible only once complete."""
    part = path + PART_SUFFIX
    with open(part, "wb") as f:
        f.write(states.view(torch.uint8).numpy().data)  # (n, K, hidden) in C order
    os.replace(part, path)


@dataclass
class Save:
    """One request's hand-over: its blocks in the hidden-state group and its file."""

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


def prompt_completes(request: Request, num_scheduled: int) -> bool:
    """Whether this step computes the last of `request`'s prompt (vLLM calls
    `build_connector_meta` before it adds the step's tokens to `num_computed_tokens`)."""
    return request.num_computed_tokens + num_scheduled >= request.num_prompt_tokens


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
        # Scheduler side: requests whose prompt is still being computed, and the files named.
        self._computing: dict[str, Request] = {}
        self._named: dict[str, Save] = {}
        # Worker side.
        self._cache: torch.Tensor | None = None  # (num_blocks, K, block_size, hidden)
        self._writes_here = True
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

    def on_new_request(self, request: Request) -> None:
        if request.prompt_token_ids is not None:
            self._computing[request.request_id] = request

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = HandOverMetadata()
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            request = self._computing.get(req_id)
            if request is None or not prompt_completes(request, n):
                continue
            del self._computing[req_id]
            assert self._kv_cache_manager is not None  # bound by the scheduler at start
            blocks = list(self._kv_cache_manager.get_block_ids(req_id)[self._group])
            save = Save(req_id, handover_path(self._dir, req_id), request.num_prompt_tokens, blocks)
            self._named[req_id] = save
            meta.saves.append(save)
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._computing.pop(request.request_id, None)
        save = self._named.pop(request.request_id, None)
        if save is None:
            return False, None  # aborted before its prompt was computed: nothing handed over
        # The blocks may go: the copy was made (CPU) or is ordered before any reuse (CUDA).
        return False, {"hidden_states_path": save.path, "num_tokens": save.num_tokens}

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, [])

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        # Tokens of one block contiguous per layer: (num_blocks, K, block_size, hidden).
        return "LBNHC"

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
        """After this step's forwards (vLLM's contract): hand over the requests whose prompt it
        completed; a failed earlier write fails the step (the server then reports the engine
        dead)."""
        if not self._writes_here:
            return
        meta = self._connector_metadata
        if isinstance(meta, HandOverMetadata):
            for save in meta.saves:
                self._hand_over(save)
        for f in [f for f in self._writes if f.done()]:
            self._writes.remove(f)
            f.result()

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
            return
        assert self._cache is not None
        if self._stream is None:
            self._stream = torch.cuda.Stream(self._cache.device)
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="dflash-handover")
        compute = torch.cuda.current_stream(self._cache.device)
        self._stream.wait_stream(compute)
        with torch.cuda.stream(self._stream):
            states = self._gather(save)
            host = pinned_like(states)
            host.copy_(states, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self._stream)
        # The blocks are freed when vLLM reports the request finished: every later kernel of
        # the forward's stream (a step reusing them) runs after the copy, without a host wait.
        compute.wait_event(copied)
        assert self._writer is not None
        self._writes.append(self._writer.submit(_write_when_copied, copied, save.path, host))

    def shutdown(self) -> None:
        if self._writer is not None:
            self._writer.shutdown(wait=True)


def _write_when_copied(copied: torch.cuda.Event, path: str, host: torch.Tensor) -> None:
    """The writer thread: wait for the device-to-host copy, then write the file."""
    copied.synchronize()
    write_atomically(path, host)
