"""The KV connector's own logic without vLLM (a stand-in for the few vLLM names it imports): a
finished request's token slots are gathered out of the hidden-state cache blocks in token
order, written complete under their final name only, and reported done once the scheduler has
named the request finished (on a GPU: once its copy on the side stream has completed, checked
with stand-ins for the CUDA calls); TP ranks other than 0 hand over nothing."""

from __future__ import annotations

import importlib
import os
import sys
import types
from dataclasses import dataclass

import numpy as np
import pytest
import torch

K, BLOCK, HIDDEN = 3, 4, 5


class Base:
    def __init__(self, vllm_config, role, kv_cache_config) -> None:
        self._vllm_config = vllm_config
        self._kv_transfer_config = vllm_config.kv_transfer_config
        self._connector_metadata = None

    def bind_connector_metadata(self, meta) -> None:
        self._connector_metadata = meta


class CacheOnlyAttentionLayer:
    pass


@pytest.fixture
def connector(monkeypatch, tmp_path):
    """The connector module imported against stand-ins for vLLM; the TP rank is settable."""
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
    for name, attrs in names.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.delitem(sys.modules, "dflash_train.engine.connector", raising=False)
    mod = importlib.import_module("dflash_train.engine.connector")
    config = types.SimpleNamespace(
        kv_transfer_config=types.SimpleNamespace(
            kv_connector_extra_config={"handover_dir": str(tmp_path)}
        )
    )
    conn = mod.DFlashHandOverConnector(config, None, None)
    # (num_blocks, K, block_size, hidden): every slot's values name its block and offset
    cache = torch.arange(8 * K * BLOCK * HIDDEN, dtype=torch.float32).reshape(8, K, BLOCK, HIDDEN)
    conn.register_kv_caches({"model.hidden_cache": cache, "model.layers.0.attn": torch.zeros(1)})
    yield mod, conn, cache, rank
    monkeypatch.delitem(sys.modules, "dflash_train.engine.connector", raising=False)


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]


def test_a_finished_request_is_gathered_in_token_order_and_written_once_complete(connector):
    mod, conn, cache, _ = connector
    keep, params = conn.request_finished(Request("r/1", list(range(6))), [5, 2])  # 6 tokens
    assert keep and params["num_tokens"] == 6 and params["hidden_states_path"].endswith("r_1.bin")
    conn.bind_connector_metadata(conn.build_connector_meta(None))
    assert conn.build_connector_meta(None).saves == []  # each save is sent once
    assert conn.get_finished(set()) == (None, None)  # written, but not yet named finished
    path = params["hidden_states_path"]
    assert os.path.exists(path) and not os.path.exists(path + mod.PART_SUFFIX)
    got = torch.from_numpy(np.fromfile(path, dtype=np.float32)).reshape(6, K, HIDDEN)
    # tokens 0-3 in block 5, tokens 4-5 in block 2 (offsets 0, 1)
    want = torch.cat([cache[5].permute(1, 0, 2), cache[2, :, :2].permute(1, 0, 2)])
    assert torch.equal(got, want)
    conn.bind_connector_metadata(conn.build_connector_meta(None))
    assert conn.get_finished({"r/1"}) == ({"r/1"}, None)
    assert conn.get_finished(set()) == (None, None)  # reported once


def test_an_aborted_request_hands_over_nothing_and_other_ranks_write_nothing(connector):
    _, conn, _, rank = connector
    assert conn.request_finished(Request("never-ran", [1, 2]), []) == (False, None)
    rank["value"] = 1
    conn.register_kv_caches({"model.hidden_cache": torch.zeros(2, K, BLOCK, HIDDEN)})
    _, params = conn.request_finished(Request("r2", [1, 2, 3]), [0])
    conn.bind_connector_metadata(conn.build_connector_meta(None))
    assert conn.get_finished({"r2"}) == (None, None)
    assert not os.path.exists(params["hidden_states_path"])
    assert conn.get_finished_count() == 1  # rank 0's notice is the only one awaited


class FakeCuda:
    """Stand-ins for the CUDA calls of the connector's device hand-over, recording their order;
    the copy's event completes when the test says so."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.complete = False
        fake = self

        class Stream:
            def __init__(self, device) -> None:
                fake.calls.append(f"new stream on {device}")

            def wait_stream(self, other) -> None:
                fake.calls.append(f"side waits for {other}")

        class Event:
            def record(self, stream) -> None:
                fake.calls.append("event recorded on side")

            def query(self) -> bool:
                return fake.complete

        class StreamContext:
            def __init__(self, stream) -> None:
                pass

            def __enter__(self):
                fake.calls.append("enter side")

            def __exit__(self, *exc):
                fake.calls.append("leave side")

        self.Stream, self.Event, self.stream = Stream, Event, StreamContext

    def current_stream(self, device) -> str:
        return "compute"


def test_on_a_gpu_the_copy_runs_on_its_own_stream_and_the_request_waits_for_it(
    connector, monkeypatch
):
    # The CUDA path, as far as a CPU can run it: the side stream waits for the forward's
    # stream before gathering, the copy into pinned host memory and its event are on the side
    # stream, and the request is reported done (its blocks freed) only once that event has
    # completed; the file is then written by the writer thread, complete or not at all.
    mod, conn, cache, _ = connector
    fake = FakeCuda()
    for name in ("Stream", "Event", "stream", "current_stream"):
        monkeypatch.setattr(mod.torch.cuda, name, getattr(fake, name))
    monkeypatch.setattr(conn, "_copies_on_device", lambda: True)
    real_gather = conn._gather
    monkeypatch.setattr(
        conn, "_gather", lambda save: (fake.calls.append("gather"), real_gather(save))[1]
    )
    monkeypatch.setattr(
        mod, "pinned_like", lambda t: (fake.calls.append("pinned host"), torch.empty_like(t))[1]
    )
    _, params = conn.request_finished(Request("g1", list(range(6))), [5, 2])
    conn.bind_connector_metadata(conn.build_connector_meta(None))
    assert conn.get_finished({"g1"}) == (None, None)  # the copy is in flight: not done
    assert fake.calls == [
        f"new stream on {cache.device}",
        "side waits for compute",
        "enter side",
        "gather",
        "pinned host",
        "event recorded on side",
        "leave side",
    ]
    path = params["hidden_states_path"]
    assert not os.path.exists(path)
    conn.bind_connector_metadata(conn.build_connector_meta(None))
    assert conn.get_finished(set()) == (None, None)  # still in flight
    fake.complete = True
    conn.bind_connector_metadata(conn.build_connector_meta(None))
    assert conn.get_finished(set()) == ({"g1"}, None)
    conn.shutdown()  # the writer thread has finished its file
    got = torch.from_numpy(np.fromfile(path, dtype=np.float32)).reshape(6, K, HIDDEN)
    want = torch.cat([cache[5].permute(1, 0, 2), cache[2, :, :2].permute(1, 0, 2)])
    assert torch.equal(got, want) and not os.path.exists(path + mod.PART_SUFFIX)
