"""A store's rows reach a CUDA device as their stored bytes, staged in pinned memory, one
asynchronous copy per tensor on the stream of the thread that uses them, and are decoded there
(`train --features`: the drafter's; the hybrid: its target's); the hybrid's rows to store go to
the host on a side lane of the target's device, never through its stream.

Recorded on CPU with the CUDA calls stood in for: pinning (a pinned tensor is one whose storage
the stand-in made), lanes and marks (which lane is active for each copy, who waits for what),
and a `meta` device standing for the GPU where only the place of the work matters; the values
are checked against each row's own decode (`codec.decode_row`)."""

from __future__ import annotations

import contextlib
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dflash_train import devices
from dflash_train.config import EngineOptions
from dflash_train.devices import HostStaged, Mark, handover
from dflash_train.store import cache, codec, reader
from dflash_train.store.cache import CachingReader, FeatureCache
from dflash_train.store.codec import decode_row, encode_row
from dflash_train.store.manifest import Binding
from dflash_train.store.reader import StoreReader
from dflash_train.store.store import FeatureStore
from dflash_train.train import features

K, H, ROWS, L = 3, 16, 6, 8
LENGTHS = np.array([3, 8, 5, 2, 7, 4])
CPU = torch.device("cpu")


def row_features(row: int) -> torch.Tensor:
    """(n, K * H) features of row `row`, of very different scales per layer."""
    g = torch.Generator().manual_seed(int(row))
    n = int(LENGTHS[row])
    return torch.randn(n, K, H, generator=g).mul(torch.tensor([0.05, 1.0, 40.0])[:, None])


def store_with(tmp_path, rows, dtype: str) -> FeatureStore:
    binding = Binding("t", "d", ROWS, (2, 5, 7), H, dtype)
    store = FeatureStore.open_for_append(tmp_path / f"f_{dtype}", binding, "t", "d")
    for r in rows:
        store.append(r, encode_row(row_features(r).view(-1, K * H), dtype, K), int(LENGTHS[r]))
    store.commit()
    return store


def decoded(row: int, dtype: str, out_dtype: torch.dtype, layers=(0, 1, 2)) -> torch.Tensor:
    """Row `row` as its own stored bytes decode, the stored layers `layers`, padded to L."""
    raw = torch.from_numpy(encode_row(row_features(row).view(-1, K * H), dtype, K))
    n = int(LENGTHS[row])
    x = decode_row(raw, n, K, H, dtype, out_dtype).view(n, K, H)[:, list(layers)]
    out = torch.zeros(L, len(layers) * H, dtype=out_dtype)
    out[:n] = x.reshape(n, -1)
    return out


@pytest.fixture
def pinned(monkeypatch):
    """`host_tensor` stood in for: the storages it made pinned, and `is_pinned` true of them."""
    made: set[int] = set()

    def host_tensor(shape, dtype, pin):
        out = torch.zeros(shape, dtype=dtype)
        if pin:
            made.add(out.untyped_storage().data_ptr())
        return out

    for module in (reader, cache):
        monkeypatch.setattr(module, "host_tensor", host_tensor, raising=False)
    monkeypatch.setattr(
        torch.Tensor, "is_pinned", lambda self: self.untyped_storage().data_ptr() in made
    )
    return made


class Lanes:
    """Which lane each thread queues on (`active` stood in for) and every mark and wait."""

    def __init__(self) -> None:
        self.active: dict[str, str] = {}
        self.log: list[tuple] = []

    def here(self) -> str:
        return self.active.get(threading.current_thread().name, "own")


class RecordedMark(Mark):
    def __init__(self, lanes: Lanes, kind: str) -> None:
        super().__init__(CPU)
        self.lanes, self.kind = lanes, kind
        lanes.log.append(("mark", kind, lanes.here()))

    def wait_here(self) -> None:
        self.lanes.log.append(("device wait", self.kind, self.lanes.here()))

    def wait_host(self) -> None:
        self.lanes.log.append(("host wait", self.kind, self.lanes.here()))


class SideLane(devices.Lane):
    def __init__(self, lanes: Lanes) -> None:
        super().__init__(CPU)
        self.lanes = lanes

    @contextlib.contextmanager
    def active(self):
        name = threading.current_thread().name
        self.lanes.active[name] = "side"
        try:
            yield
        finally:
            del self.lanes.active[name]

    def mark(self) -> Mark:
        return RecordedMark(self.lanes, "side")


@pytest.fixture
def lanes(monkeypatch):
    lanes = Lanes()
    monkeypatch.setattr(
        cache, "marks_here", lambda devs: [RecordedMark(lanes, "forward")], raising=False
    )
    return lanes


@pytest.fixture
def copies(monkeypatch, lanes):
    """Every copy between host and device stood in for: `to(device)`, `copy_` and `cpu()`, as
    (op, thread, lane, source pinned, destination pinned, non_blocking, source dtype)."""
    log: list[tuple] = []
    to, copy_, cpu = torch.Tensor.to, torch.Tensor.copy_, torch.Tensor.cpu

    def record(op, src, dst_pinned, non_blocking):
        name = threading.current_thread().name
        log.append((op, name, lanes.here(), src.is_pinned(), dst_pinned, non_blocking, src.dtype))

    def recording_to(self, *args, **kwargs):
        if any(isinstance(a, torch.device | str) for a in args) or "device" in kwargs:
            record("to", self, False, kwargs.get("non_blocking", False))
        return to(self, *args, **kwargs)

    def recording_copy(self, src, non_blocking=False):
        record("copy_", src, self.is_pinned(), non_blocking)
        return copy_(self, src, non_blocking)

    def recording_cpu(self, *args, **kwargs):
        record("cpu", self, False, False)
        return cpu(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", recording_to)
    monkeypatch.setattr(torch.Tensor, "copy_", recording_copy)
    monkeypatch.setattr(torch.Tensor, "cpu", recording_cpu)
    return log


def in_thread(name: str, work):
    out: list = []
    t = threading.Thread(target=lambda: out.append(work()), name=name)
    t.start()
    t.join()
    return out[0]


# ------------------------------------------------------------- train --features: host readers
@pytest.mark.parametrize("dtype", ["fp8", "bf16", "fp32"])
def test_a_host_reader_hands_cuda_drafters_pinned_stored_bytes_they_copy_and_decode(
    tmp_path, pinned, copies, dtype
):
    store = store_with(tmp_path, range(ROWS), dtype)
    ids = np.array([4, 0, 3])
    rdr = StoreReader(store, [7, 2], CPU, torch.bfloat16, pinned=True)
    copies.clear()  # the store's own writes above
    staged = in_thread("reader-0", lambda: rdr.read(ids, torch.zeros(3, L, dtype=torch.long)))
    # The reader decodes nothing: the batch's stored bytes (2 of 3 layers), pinned.
    assert isinstance(staged, HostStaged) and not copies
    value_bytes = codec.VALUE_BYTES[dtype] * 2 * H + (8 if dtype == "fp8" else 0)
    assert staged.nbytes == 3 * L * value_bytes
    assert staged.values.is_pinned() and (staged.scales is None or staged.scales.is_pinned())

    out = in_thread("drafter-0", lambda: handover(staged, CPU, Mark(CPU)))
    # One asynchronous copy per tensor (not per row), from pinned memory, on the drafter's own
    # thread (its stream): values, and fp8's scales.
    assert [c[:3] for c in copies] == [("to", "drafter-0", "own")] * (2 if dtype == "fp8" else 1)
    assert all(src_pinned and non_blocking for _, _, _, src_pinned, _, non_blocking, _ in copies)
    want = torch.stack([decoded(r, dtype, torch.bfloat16, layers=(2, 0)) for r in ids])
    assert out.dtype == torch.bfloat16 and torch.equal(out, want)
    # Decoded where the drafter is: on a device standing for the GPU, the result is there.
    on_device = handover(staged, torch.device("meta"))
    assert on_device.device.type == "meta" and on_device.shape == want.shape


def test_without_cuda_the_reader_decodes_on_the_host_and_pins_nothing(tmp_path, pinned):
    store = store_with(tmp_path, range(ROWS), "fp8")
    ids = np.array([1, 5])
    out = StoreReader(store, [2, 5, 7], CPU, torch.float32).read(ids, torch.zeros(2, L))
    assert isinstance(out, torch.Tensor) and not pinned
    assert torch.equal(out, torch.stack([decoded(r, "fp8", torch.float32) for r in ids]))


def test_readers_stage_pinned_exactly_when_a_drafter_is_on_cuda(tmp_path, monkeypatch):
    store = store_with(tmp_path, range(ROWS), "fp8")
    monkeypatch.setattr(features, "open_features", lambda _cfg, _data: store)
    pipeline = SimpleNamespace(
        features="f", num_readers=2, target_devices=None, cuda_graphs=False, cache_features=None
    )
    cfg = SimpleNamespace(
        pipeline=pipeline, model=SimpleNamespace(dtype="auto"), engine=EngineOptions()
    )
    data = SimpleNamespace(
        draft_config=SimpleNamespace(target_layer_ids=[2, 5, 7]),
        feature_layer_ids=[2, 5, 7],
        teacher=False,
    )
    for drafters, want in (([CPU], False), ([CPU, torch.device("cuda", 0)], True)):
        stages = features.build_feature_stages(cfg, data, [], drafters, lambda _m: None)
        assert [r.pinned for r in stages.readers] == [want, want]


# ---------------------------------------------------------------------------- the hybrid
class Target:
    """A target on the CPU whose features of row r (token 0 holds r) are `row_features(r)`."""

    device = CPU

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(input_ids.shape[0], input_ids.shape[1], K * H)
        for b, row in enumerate(input_ids[:, 0].tolist()):
            out[b, : LENGTHS[row]] = row_features(row).view(-1, K * H)
        return out


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_the_hybrid_stores_through_a_side_lane_and_reads_by_one_copy_per_tensor(
    tmp_path, pinned, lanes, copies, dtype
):
    store = store_with(tmp_path, [1], dtype)
    # A target on a CUDA device, stood in for: pinned staging, a side lane of its own.
    rdr = CachingReader(
        Target(),
        FeatureCache.open(store, np.ones(ROWS, dtype=bool), LENGTHS),
        StoreReader(store, [2, 5, 7], CPU, torch.float32, pinned=True),
    )
    rdr._copies = SideLane(lanes)
    copies.clear()  # the store's own writes above
    ids = np.array([1, 2, 3])
    input_ids = torch.tensor(ids)[:, None].expand(3, L).contiguous()
    out = rdr.read(ids, input_ids, epoch=0)  # rows 2 and 3 computed and stored, 1 read
    tensors = 2 if dtype == "fp8" else 1
    # Stored rows: one asynchronous copy per encoded tensor, on the side lane, into pinned
    # memory; the side lane waited for the forward, the host for the side lane's copies only.
    stored = [c for c in copies if c[0] in ("copy_", "cpu")]
    assert [c[:3] for c in stored] == [("copy_", "MainThread", "side")] * tensors
    assert all(dst_pinned and non_blocking for *_, dst_pinned, non_blocking, _ in stored)
    assert lanes.log == [
        ("mark", "forward", "own"),
        ("device wait", "forward", "side"),
        ("mark", "side", "side"),
        ("host wait", "side", "own"),
    ]
    # The read row: one copy per tensor from pinned memory, asynchronous, on the target's own
    # stream (where the features are used).
    read = [c for c in copies if c[0] == "to"]
    assert [c[:3] for c in read] == [("to", "MainThread", "own")] * tensors
    assert all(src_pinned and non_blocking for _, _, _, src_pinned, _, non_blocking, _ in read)
    # Values: computed rows as the target gave them, stored rows as they decode.
    assert torch.equal(out[0], decoded(1, dtype, torch.float32))
    for b in (1, 2):  # rows 2 and 3
        assert torch.equal(out[b], Target()(input_ids[b : b + 1])[0])
    again = rdr.read(np.array([3, 2]), input_ids[[2, 1]], epoch=1)  # both from the store now
    assert torch.equal(again, torch.stack([decoded(r, dtype, torch.float32) for r in (3, 2)]))
