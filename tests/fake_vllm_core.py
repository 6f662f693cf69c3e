"""A fake of vLLM 0.32's engine core around the project's real KV connector (stand-ins for the
few vLLM names the connector imports), for tests without vLLM.

What vLLM 0.32 does, and the fake copies (`vllm/v1/engine/core.py`, `v1/core/sched/scheduler.py`,
`v1/worker/gpu_model_runner.py`, `kv_connector_model_runner_mixin.py`):
- the scheduler side and the worker side are two connector objects that share nothing but the
  metadata `build_connector_meta` returns; it is built while scheduling a step, before the step's
  tokens are added to the requests' `num_computed_tokens`;
- the worker binds it, runs the forward (prompts in chunks of at most `budget` tokens per step),
  calls `get_finished` as the forward's connector context exits, then the drafter (the
  extract-hidden-states model, which writes the cache), then `wait_for_save`;
- `update_from_output`: a request whose prompt is complete samples its one token and finishes:
  `request_finished` says whether its blocks are kept (freed once a later `get_finished` names
  it) and what goes in its output's `kv_transfer_params`;
- `EngineCore.step` does nothing unless the scheduler has requests (unfinished ones, finished
  ones not yet told to the workers, or ones whose blocks a connector keeps): the engine core's
  own process steps while it has (`run_busy_loop`); in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`,
  `InprocClient`) it steps only when `LLMEngine.step` is called (`InProcessEngine`), which the
  server's loop does while it has unfinished requests.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import types
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

K, BLOCK, HIDDEN, NUM_BLOCKS = 3, 4, 5, 16
"""The cache's default shape: (NUM_BLOCKS, K, BLOCK, HIDDEN)."""
CONNECTOR = "dflash_train.engine.connector"


class Base:
    """vLLM's `KVConnectorBase_V1`, as far as the connector uses it."""

    def __init__(self, vllm_config, role, kv_cache_config) -> None:
        self._vllm_config = vllm_config
        self._kv_transfer_config = vllm_config.kv_transfer_config
        self._connector_metadata = None
        self._kv_cache_manager = None

    def bind_kv_cache_manager(self, manager) -> None:
        self._kv_cache_manager = manager

    def on_new_request(self, request) -> None:
        return None

    def bind_connector_metadata(self, meta) -> None:
        self._connector_metadata = meta

    def clear_connector_metadata(self) -> None:
        self._connector_metadata = None

    def get_finished(self, finished_req_ids):
        return None, None


class CacheOnlyAttentionLayer:
    pass


@contextlib.contextmanager
def connector_module() -> Iterator[types.ModuleType]:
    """The connector module imported against stand-ins for vLLM (removed again after);
    `module.rank["value"]` sets the TP rank."""
    rank = {"value": 0}
    layers = {"model.hidden_cache": CacheOnlyAttentionLayer(), "model.layers.0.attn": object()}
    names = {
        "vllm": {},
        "vllm.config": {
            "VllmConfig": object,
            "get_layers_from_vllm_config": lambda cfg, kind, names: {
                n: layers[n] for n in names if isinstance(layers[n], kind)
            },
        },
        "vllm.distributed": {},
        "vllm.distributed.kv_transfer": {},
        "vllm.distributed.kv_transfer.kv_connector": {},
        "vllm.distributed.kv_transfer.kv_connector.v1": {},
        "vllm.distributed.kv_transfer.kv_connector.v1.base": {
            "KVConnectorBase_V1": Base,
            "KVConnectorMetadata": object,
            "KVConnectorRole": object,
            "SupportsHMA": object,
        },
        "vllm.distributed.parallel_state": {
            "get_tensor_model_parallel_rank": lambda: rank["value"]
        },
        "vllm.model_executor": {},
        "vllm.model_executor.models": {},
        "vllm.model_executor.models.extract_hidden_states": {
            "CacheOnlyAttentionLayer": CacheOnlyAttentionLayer
        },
    }
    saved = {n: sys.modules.get(n) for n in [*names, CONNECTOR]}
    try:
        for name, attrs in names.items():
            module = types.ModuleType(name)
            module.__dict__.update(attrs)
            sys.modules[name] = module
        sys.modules.pop(CONNECTOR, None)
        module = importlib.import_module(CONNECTOR)
        module.rank = rank
        yield module
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def states_of(prompt: list[int], layers: int = K, hidden: int = HIDDEN) -> torch.Tensor:
    """The hidden states the fake forward computes: (n, layers, hidden), token- and
    order-dependent, small and exact in fp32."""
    tok = torch.tensor(prompt, dtype=torch.float32)[:, None, None]
    pos = torch.arange(len(prompt), dtype=torch.float32)[:, None, None]
    k = torch.arange(layers, dtype=torch.float32)[None, :, None]
    c = torch.arange(hidden, dtype=torch.float32)[None, None, :]
    return tok / 256 + pos / 1024 + k + c / 64


@dataclass
class Request:
    """vLLM's `Request`, as far as the connector and the fake scheduler read it."""

    request_id: str
    prompt_token_ids: list[int]
    num_computed_tokens: int = 0
    finished: bool = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class BlockTable:
    """The scheduler's KV cache manager: blocks taken as tokens are scheduled, freed ones first
    in line for reuse."""

    def __init__(self, num_blocks: int) -> None:
        self.free = list(range(num_blocks))
        self.tables: dict[str, list[int]] = {}

    def allocate(self, req_id: str, tokens: int) -> None:
        table = self.tables.setdefault(req_id, [])
        while len(table) * BLOCK < tokens:
            table.append(self.free.pop(0))

    def release(self, req_id: str) -> None:
        self.free[:0] = self.tables.pop(req_id, [])

    def get_block_ids(self, req_id: str) -> tuple[list[int], ...]:
        return (list(self.tables[req_id]),)  # one KV cache group: the hidden states'


@dataclass
class Output:
    request_id: str
    finished: bool
    kv_transfer_params: dict | None


@dataclass
class FakeCore:
    """vLLM 0.32's engine core with one TP-1 worker around two connector objects (see the module
    docstring); `cache` is the hidden-state cache layer (num_blocks, K, block, hidden)."""

    scheduler: object
    worker: object
    budget: int = 6
    cache: torch.Tensor = field(default_factory=lambda: torch.zeros(NUM_BLOCKS, K, BLOCK, HIDDEN))
    blocks: BlockTable = field(default_factory=lambda: BlockTable(NUM_BLOCKS))
    requests: dict[str, Request] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)
    kept: set[str] = field(default_factory=set)
    steps: int = 0

    def __post_init__(self) -> None:
        self.scheduler.bind_kv_cache_manager(self.blocks)
        self.worker.register_kv_caches({"model.hidden_cache": self.cache})

    def add_request(self, req_id: str, prompt: list[int]) -> None:
        request = Request(req_id, prompt)
        self.requests[req_id] = request
        self.scheduler.on_new_request(request)

    def abort(self, req_id: str) -> None:
        self._finish(self.requests[req_id])

    def has_requests(self) -> bool:
        unfinished = any(not r.finished for r in self.requests.values())
        return unfinished or bool(self.finished_req_ids) or bool(self.kept)

    def step(self) -> list[Output]:
        if not self.has_requests():
            return []
        self.steps += 1
        scheduled = self._schedule()
        meta = self.scheduler.build_connector_meta(
            types.SimpleNamespace(num_scheduled_tokens=scheduled)
        )
        finished_ids, self.finished_req_ids = self.finished_req_ids, set()
        for req_id, n in scheduled.items():
            self.requests[req_id].num_computed_tokens += n
        sending = self._execute(meta, scheduled, finished_ids)
        return self._update_from_output(scheduled, sending)

    def _schedule(self) -> dict[str, int]:
        scheduled, left = {}, self.budget
        for r in self.requests.values():
            todo = r.num_prompt_tokens - r.num_computed_tokens
            if r.finished or todo <= 0 or left <= 0:
                continue
            n = min(todo, left)
            self.blocks.allocate(r.request_id, r.num_computed_tokens + n)
            scheduled[r.request_id], left = n, left - n
        return scheduled

    def _execute(self, meta, scheduled: dict[str, int], finished_ids: set[str]) -> set[str]:
        """The worker: forward (then get_finished), the drafter writes the cache, wait_for_save."""
        self.worker.bind_connector_metadata(meta)
        sending, _ = self.worker.get_finished(finished_ids)
        for req_id, n in scheduled.items():  # the extract-hidden-states drafter
            r = self.requests[req_id]
            states = states_of(r.prompt_token_ids, *self.cache.shape[1::2])
            for pos in range(r.num_computed_tokens - n, r.num_computed_tokens):
                block = self.blocks.tables[req_id][pos // BLOCK]
                self.cache[block, :, pos % BLOCK] = states[pos]
        self.worker.wait_for_save()
        self.worker.clear_connector_metadata()
        return sending or set()

    def _update_from_output(self, scheduled: dict[str, int], sending: set[str]) -> list[Output]:
        for req_id in sending:
            self.kept.discard(req_id)
            self.blocks.release(req_id)
        outputs = []
        for req_id in scheduled:
            r = self.requests[req_id]
            if r.num_computed_tokens >= r.num_prompt_tokens:  # its one token is sampled
                outputs.append(Output(req_id, True, self._finish(r)))
        return outputs

    def _finish(self, r: Request) -> dict | None:
        r.finished = True
        self.finished_req_ids.add(r.request_id)
        keep, params = self.scheduler.request_finished_all_groups(
            r, self.blocks.get_block_ids(r.request_id)
        )
        if keep:
            self.kept.add(r.request_id)
        else:
            self.blocks.release(r.request_id)
        return params


def make_core(
    mod, directory: Path, layers: int = K, hidden: int = HIDDEN, num_blocks: int = NUM_BLOCKS, **kw
) -> FakeCore:
    """A core around two connector objects of `mod` handing over into `directory`."""
    config = types.SimpleNamespace(
        kv_transfer_config=types.SimpleNamespace(
            kv_connector_extra_config={"handover_dir": str(directory)}
        )
    )
    return FakeCore(
        mod.DFlashHandOverConnector(config, "scheduler", None),
        mod.DFlashHandOverConnector(config, "worker", None),
        cache=torch.zeros(num_blocks, layers, BLOCK, hidden),
        blocks=BlockTable(num_blocks),
        **kw,
    )


def run_in_process(core: FakeCore, on_finished) -> None:
    """LLMEngine in-process with the server's loop: steps while a request is unfinished as the
    client sees it (its finished output not yet received)."""
    waiting = {r for r, req in core.requests.items() if not req.finished}
    while waiting:
        for out in core.step():
            waiting.discard(out.request_id)
            on_finished(out)


def run_busy_loop(core: FakeCore, on_finished) -> None:
    """The engine core's own process (`EngineCoreProc.run_busy_loop`): steps while the
    scheduler has requests."""
    while core.has_requests():
        for out in core.step():
            on_finished(out)


class InProcessEngine:
    """vLLM's `LLMEngine` with its core in this process (`InprocClient`), as the engine server's
    loop uses it: `has_unfinished_requests` is its output processor's view (requests whose
    finished output it has not returned yet), and the core steps only in `step`. As vLLM 0.32,
    it gives each request an id of its own inside (`ID-XXXXXXXX`, 8 random characters: the
    scheduler and the connector see that one), and its outputs name the caller's id."""

    def __init__(self, core: FakeCore) -> None:
        self.core = core
        self.unfinished: set[str] = set()
        self.inside: dict[str, str] = {}  # the caller's id -> the core's

    def add_request(self, rid: str, prompt: list[int], params) -> None:
        self.inside[rid] = f"{rid}-{uuid.uuid4().hex[:8]}"
        self.core.add_request(self.inside[rid], list(prompt))
        self.unfinished.add(rid)

    def abort_request(self, rids: list[str]) -> None:
        for rid in rids:
            if rid in self.unfinished:
                self.core.abort(self.inside.pop(rid))
                self.unfinished.discard(rid)

    def has_unfinished_requests(self) -> bool:
        return bool(self.unfinished)

    def step(self) -> list[Output]:
        callers = {inside: rid for rid, inside in self.inside.items()}
        outputs = [
            Output(callers[o.request_id], o.finished, o.kv_transfer_params)
            for o in self.core.step()
            if o.request_id in callers  # an aborted request's output is dropped, as vLLM's
        ]
        self.unfinished -= {o.request_id for o in outputs}
        for o in outputs:
            self.inside.pop(o.request_id, None)
        return outputs
