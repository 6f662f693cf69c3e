"""The target's CUDA-only paths, recorded on CPU with stand-ins for torch.cuda: where a CUDA
graph is captured, and how input ids reach the device (`tests/cuda` checks the values)."""

from __future__ import annotations

import contextlib

import torch

from dflash_train.model import target as target_module
from dflash_train.model.target import TargetFeatureExtractor, capture_cuda_graph


class FakeCuda:
    """torch.cuda's device, stream and graph calls, recorded with the device that was current."""

    def __init__(self) -> None:
        self.current = torch.device("cuda", 0)  # the main thread's, as in a real run
        self.stream_now = "default"
        self.log: list[tuple] = []

    def install(self, monkeypatch) -> None:
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "device", self.device)
        monkeypatch.setattr(cuda, "Stream", self.Stream)
        monkeypatch.setattr(cuda, "stream", self.stream)
        monkeypatch.setattr(cuda, "current_stream", lambda device=None: self.Stream(device))
        monkeypatch.setattr(cuda, "CUDAGraph", lambda: "graph")
        monkeypatch.setattr(cuda, "graph", self.graph)

    @contextlib.contextmanager
    def device(self, device):
        before, self.current = self.current, torch.device(device)
        try:
            yield
        finally:
            self.current = before

    def Stream(self, device=None):  # stands in for the class
        fake = self

        class _Stream:
            def __init__(self) -> None:
                self.device = torch.device(device) if device is not None else fake.current

            def wait_stream(self, _other) -> None:
                pass

        return _Stream()

    @contextlib.contextmanager
    def stream(self, s):
        before, self.stream_now = self.stream_now, s
        try:
            yield
        finally:
            self.stream_now = before

    @contextlib.contextmanager
    def graph(self, graph, pool=None, stream=None):
        self.log.append(("capture", self.current, None if stream is None else stream.device))
        with self.stream(stream or "side stream of the current device"):
            yield


def test_a_graph_is_captured_under_the_targets_own_device_on_a_stream_of_it(monkeypatch):
    fake = FakeCuda()
    fake.install(monkeypatch)
    dev = torch.device("cuda", 3)

    def run():
        where = fake.stream_now.device if hasattr(fake.stream_now, "device") else fake.stream_now
        fake.log.append(("run", fake.current, where))
        return torch.zeros(1)

    graph, out = capture_cuda_graph(run, dev)
    assert graph == "graph" and out.shape == (1,)
    # Two warm-up runs on a side stream of cuda:3, then the capture on a stream of cuda:3,
    # all while cuda:3 is the current device (not the main thread's cuda:0).
    assert fake.log == [
        ("run", dev, dev),
        ("run", dev, dev),
        ("capture", dev, dev),
        ("run", dev, dev),
    ]
    assert fake.current == torch.device("cuda", 0)  # given back afterwards


def test_the_extractor_captures_through_the_device_aware_capture(tiny_target, monkeypatch):
    seen = []

    def recording(run, device, pool=None):
        seen.append(device)
        return None, run()

    monkeypatch.setattr(target_module, "capture_cuda_graph", recording)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    ex = TargetFeatureExtractor(tiny_target, [1, 3], torch.device("cpu"), torch.float32)
    assert ex.capture_graphs({16: 2, 32: 1}) == 2
    assert seen == [torch.device("cpu")] * 2


def test_each_bucket_graph_is_captured_on_the_extractors_device(tiny_target, monkeypatch):
    # The extractor's own capture (CPU tensors, CUDA calls faked): the capture must name the
    # extractor's device and a stream of it, whatever device the main thread is on.
    ex = TargetFeatureExtractor(tiny_target, [1, 3], torch.device("cpu"), torch.float32)
    fake = FakeCuda()
    fake.install(monkeypatch)
    target_module._ShapeGraph(ex, 2, 16, "cuda", None)
    assert ("capture", ex.device, ex.device) in fake.log
