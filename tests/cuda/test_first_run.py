"""The fixes of issue 25 ("the first GPU run must be fast and right"), checked on a device
(marked `cuda`; skipped without one; `dflash-train bench gpu` runs them). Each has a CPU test
of its wiring beside the code it checks; these check the values and the kernels."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from device_values import chain, orthogonal
from dflash_train.devices import enter_worker_thread, handover, marks_here, on_device
from dflash_train.model import flex
from dflash_train.model.block_attention import block_attention
from dflash_train.objective import make_layout, pack_anchors

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
GPU = torch.device("cuda", 0)
LAST = torch.device("cuda", torch.cuda.device_count() - 1) if torch.cuda.is_available() else GPU
"""The last device: not the main thread's current one when there are two or more."""


def on_a_lane(device: torch.device, work):
    """`work()` in a worker thread with a lane of its own (as the pipeline's workers run);
    returns its result once the lane's kernels have finished."""
    out: list = []

    def worker():
        lane = enter_worker_thread(device)
        out.append(work())
        out.append(lane.mark())

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    out.pop().wait_here()
    torch.cuda.synchronize(device)
    return out[0]


def attention_case(rows: int, length: int, blocks: int, device, seed: int = 0, bs: int = 16):
    rng = np.random.default_rng(seed)
    per_row = [np.sort(rng.choice(length - 1, blocks, replace=False)) for _ in range(rows)]
    anchors, valid = pack_anchors(per_row, blocks)
    layout = make_layout(anchors, valid, bs, device, num_chunks=1)
    gen = torch.Generator().manual_seed(seed)
    n_q = blocks * bs
    shapes = [(rows, 8, n_q, 64), (rows, 2, length, 64), (rows, 2, length, 64)]
    shapes += [(rows, 2, n_q, 64)] * 2
    inputs = [torch.randn(s, generator=gen).to(device, torch.bfloat16) for s in shapes]
    return inputs, layout


def grads(inputs, layout, backend):
    xs = [t.clone().requires_grad_() for t in inputs]
    out = block_attention(*xs, layout, backend)
    out.float().square().sum().backward()
    return [out.detach().float(), *(x.grad.float() for x in xs)]


# ----------------------------------------------------------------------------- item 1: flex
@pytest.fixture
def kernel(monkeypatch):
    """A fresh flex kernel, traced from nothing (torch caches traces by function, and other
    tests of this session traced the process's own)."""
    fresh = flex.FlexKernel()
    monkeypatch.setattr(flex, "FLEX", fresh)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=64):  # restored after (monkeypatch would not)
        yield fresh
    torch._dynamo.reset()


def test_compiled_flex_serves_new_shapes_in_a_worker_without_compiling_or_going_unfused(kernel):
    # The main thread traces the two classes the worker meets (as the warm-up does): 128
    # queries and fewer (8 and 4 blocks of 16), which inductor's lowering tells apart.
    for blocks in (8, 4):
        inputs, layout = attention_case(3, 700, blocks, GPU)
        grads(inputs, layout, "flex")
    compiles, eager = kernel.compiles, flex.eager_calls()
    assert compiles == len(kernel.traced) == 2, "a trace per shape class (model.flex.shape_class)"

    def work():
        out = []
        for shape in [(2, 1500, 8), (5, 900, 4), (4, 2100, 8)]:  # the same class, new sizes
            case = attention_case(*shape, GPU, seed=1)
            out.append((grads(*case, "flex"), grads(*case, "dense")))
        return out

    results = on_a_lane(GPU, work)
    assert kernel.compiles == compiles, "a new shape recompiled (dynamic shapes broke)"
    assert flex.eager_calls() == eager, "a planned shape ran flex's unfused path"
    for got, want in results:
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, atol=0.05, rtol=0.05)


def test_a_worker_thread_runs_an_untraced_flex_shape_unfused_and_counts_it(kernel):
    before = flex.eager_calls()

    def work():
        inputs, layout = attention_case(1, 300, 4, GPU)
        return grads(inputs, layout, "flex"), grads(inputs, layout, "dense")

    got, want = on_a_lane(GPU, work)
    assert kernel.compiles == 0 and flex.eager_calls() - before == 1
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=0.05, rtol=0.05)


# ----------------------------------------------------------------------------- item 9
def test_a_segment_clock_times_work_on_a_device_that_is_not_the_current_one():
    from dflash_train.devices import SegmentClock

    clock = SegmentClock(LAST)
    a = torch.randn(2048, 2048, device=LAST)
    with clock.segment("matmul"):
        for _ in range(20):
            a = a @ a / 2048.0
    clock.end_group()
    (group,) = clock.harvest(wait=True)
    assert group["matmul"] > 0
    with on_device(LAST):
        assert torch.cuda.current_device() == LAST.index
        (mark,) = marks_here([LAST])
        assert mark.event is not None


# ----------------------------------------------------------------------------- item 2
def test_cuda_graphs_of_a_target_on_the_last_device_replay_its_features(tiny_target):
    # Captured from the main thread (current device cuda:0) for a target on the last device:
    # the graph must hold that device's forward, not an empty or a cuda:0 capture.
    from dflash_train.model.target import TargetFeatureExtractor

    eager = TargetFeatureExtractor(tiny_target, [1, 3], LAST, torch.float32)
    graphed = TargetFeatureExtractor(tiny_target, [1, 3], LAST, torch.float32)
    assert torch.cuda.current_device() == 0
    assert graphed.capture_graphs({32: 4}) == 1
    ids = [torch.randint(0, 250, (rows, 32)) for rows in (4, 3)]
    got = on_a_lane(LAST, lambda: [graphed(x) for x in ids])
    for x, out in zip(ids, got, strict=True):
        want = eager(x)
        assert want.abs().mean() > 1e-3  # real features (about 0.02 here), not zeros
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- item 3
def test_logged_losses_are_the_values_rank_0s_lane_wrote_not_what_was_there_before():
    # Rank 0's lane writes the step's loss statistics after a long kernel and hands them over
    # with its mark at once; the main thread's flush must read the finished values.
    from dflash_train.pipeline.monitor import StageTimers
    from dflash_train.pipeline.queue import BufferedHSQueue
    from dflash_train.pipeline.sync import StepOutcome
    from dflash_train.train.interval import IntervalMetrics

    a = orthogonal(4096, GPU)  # norms stay 1
    torch.cuda.synchronize(GPU)
    handed: list = []

    def rank0():
        lane = enter_worker_thread(GPU)
        x = chain(torch.ones(1, 4096, device=GPU) / 64.0, a, 200)  # unit norm throughout
        loss = x.norm() * 7.0  # 7.0 once every matmul has run
        count = torch.full((4,), 2.0, device=GPU)
        outcome = StepOutcome(0, 2.0, False, [], loss, count / 2, count, 0.0)
        handed.append((outcome, marks_here([GPU])))
        del lane

    t = threading.Thread(target=rank0)
    t.start()
    t.join()
    metrics = IntervalMetrics({0: 1.0}, num_target_workers=1, num_drafters=1)
    outcome, ready = handed.pop()
    metrics.add(outcome, None, ready)
    del outcome
    queue = BufferedHSQueue(4, 1, 1, stop_event=threading.Event())
    out = metrics.flush(StageTimers(), queue, lr=1e-3)
    assert abs(out["train/loss"] - 3.5) < 1e-3


# ----------------------------------------------------------------------------- item 8
def test_a_pinned_job_reaches_the_drafter_by_async_copies_with_the_same_values(
    tiny_target, tmp_path
):
    # The same micro-step from a pageable and from a pinned job: equal losses and gradients;
    # the pinned one's host tensors really are page-locked.
    from dflash_train.pipeline.monitor import StageTimers
    from dflash_train.train.models import build_replicas
    from dflash_train.train.setup import TrainingData
    from pipeline_helpers import tiny_train_config, write_random_dataset

    rows = write_random_dataset(tmp_path / "data", num_rows=8)
    cfg = tiny_train_config(
        tiny_target, rows, tmp_path / "run", drafter_devices=["cuda:0"], attention="blockwise"
    )
    d = TrainingData.load(cfg)
    (rep,) = build_replicas(cfg, d, [GPU], 10, StageTimers())
    job = d.builder.build(d.plans.epoch(0)[0])
    pinned = job.pinned()
    assert pinned.input_ids.is_pinned() and pinned.chunk_targets[0].labels.is_pinned()
    width = d.draft_config.num_features * d.draft_config.hidden_size
    features = torch.randn(*job.input_ids.shape, width, device=GPU)
    from dflash_train.pipeline.records import HSBatch

    outs = []
    for j in (job, pinned):
        loss = rep.micro_step(HSBatch(j, features))
        outs.append((loss.loss_sum.item(), rep.flat_grad.clone()))
        rep.flat_grad.zero_()
    assert outs[0][0] == pytest.approx(outs[1][0], rel=1e-6)
    torch.testing.assert_close(outs[0][1], outs[1][1])


# ----------------------------------------------------------------------------- item 5
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_replicas_on_two_gpus_sum_finished_gradients_with_one_nccl_all_reduce():
    from dflash_train.pipeline import sync

    devs = [torch.device("cuda", i) for i in range(2)]
    assert sync._nccl_reduces([torch.zeros(4, device=d) for d in devs])
    mats = [orthogonal(2048, d, seed=i) for i, d in enumerate(devs)]
    bufs = [torch.zeros(2048 * 2048, device=d) for d in devs]
    for d in devs:
        torch.cuda.synchronize(d)
    rdv = sync.StepRendezvous(bufs, threading.Event(), stall_timeout_s=120)
    got: list = [None, None]

    def replica(rank):
        lane = enter_worker_thread(devs[rank])
        out = chain(mats[rank], mats[rank], 10 * (rank + 1))  # values of order 1 / sqrt(n)
        bufs[rank].copy_(out.flatten())
        outcome = rdv.exchange(sync.Contribution(rank, ready=lane.mark()))
        for mark in outcome.done:
            if mark.device == devs[rank]:
                mark.wait_here()
        got[rank] = bufs[rank].cpu()  # on this lane, after the sum

    threads = [threading.Thread(target=replica, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    want = torch.zeros(2048 * 2048)
    for rank in range(2):
        want += chain(mats[rank], mats[rank], 10 * (rank + 1)).flatten().cpu()
    assert want.abs().mean() > 0.01
    assert torch.equal(got[0], got[1])
    torch.testing.assert_close(got[0], want, atol=1e-3, rtol=1e-3)


# ----------------------------------------------------------------------------- item 6
def test_an_nccl_group_bound_to_a_device_with_the_chosen_error_handling_reduces():
    import datetime

    import torch.distributed as dist

    from dflash_train.pipeline.distributed import _nccl_settings

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    bound = _nccl_settings(LAST)
    dist.init_process_group(
        backend="nccl", store=dist.HashStore(), rank=0, world_size=1,
        timeout=datetime.timedelta(seconds=60), **bound,
    )  # fmt: skip
    try:
        group = dist.new_group(backend="nccl", timeout=datetime.timedelta(seconds=60), **bound)
        t = torch.full((8,), 3.0, device=LAST)
        dist.all_reduce(t, group=group)
        assert torch.equal(t.cpu(), torch.full((8,), 3.0))
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- item 10
def test_telemetry_finds_every_cuda_device_by_its_uuid():
    pynvml = pytest.importorskip("pynvml")
    from dflash_train.metrics.telemetry import GpuTelemetry, cuda_uuid

    indices = list(range(torch.cuda.device_count()))
    with GpuTelemetry(indices) as telemetry:
        if not telemetry.enabled:
            pytest.skip("NVML is not available here")
        for i in indices:
            handle = telemetry._handles[i]
            got = pynvml.nvmlDeviceGetUUID(handle)
            got = got.decode() if isinstance(got, bytes) else got
            want = cuda_uuid(i).removeprefix("GPU-").removeprefix("MIG-")
            assert got.split("-", 1)[1] == want, i  # the very device CUDA calls i
        sample = telemetry.sample()
    assert all(f"gpu/{i}/mem_used_gb" in sample for i in indices)


# ----------------------------------------------------------------------------- item 11
def test_the_tuners_precomputed_features_reach_a_drafter_thread_finished(tiny_target):
    from dflash_train.bench.tune import precomputed_batches
    from dflash_train.devices import handover
    from dflash_train.model.target import TargetFeatureExtractor

    ex = TargetFeatureExtractor(tiny_target, [1, 3], GPU, torch.float32)

    class Job:
        def __init__(self, ids):
            self.input_ids = ids

    ids = [torch.randint(0, 250, (4, 64)) for _ in range(3)]
    main_stream = torch.cuda.current_stream(GPU)
    enter_worker_thread(GPU)  # as the tuner's main thread does: its forwards on a lane
    try:
        batches = precomputed_batches(ex, [Job(x) for x in ids])
    finally:
        torch.cuda.set_stream(main_stream)  # the rest of the session on the default stream
    got = on_a_lane(GPU, lambda: [handover(b.features, GPU, b.ready) * 1.0 for b in batches])
    for x, out in zip(ids, got, strict=True):
        torch.testing.assert_close(out, ex(x), atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- issue 35
@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_stored_rows_reach_a_drafter_lane_pinned_and_decode_there_as_on_the_host(tmp_path, dtype):
    # train --features with a CUDA drafter: the reader stages pinned bytes on the host, the
    # drafter's lane copies and decodes them; the values are the host decode's, bit for bit.
    from dflash_train.store.codec import encode_row
    from dflash_train.store.manifest import Binding
    from dflash_train.store.reader import StoreReader
    from dflash_train.store.store import FeatureStore

    lengths = [37, 64, 5]
    binding = Binding("t", "d", 3, (1, 2, 3), 256, dtype)
    store = FeatureStore.open_for_append(tmp_path / "f", binding, "t", "d")
    gen = torch.Generator().manual_seed(0)
    for r, n in enumerate(lengths):
        store.append(r, encode_row(torch.randn(n, 768, generator=gen) * 3, dtype, 3), n)
    store.commit()
    ids, input_ids = np.array([2, 0, 1]), torch.zeros(3, 64, dtype=torch.long)
    staged = StoreReader(store, [3, 1], torch.device("cpu"), torch.bfloat16, pinned=True).read(
        ids, input_ids
    )
    assert staged.values.is_pinned()
    want = StoreReader(store, [3, 1], torch.device("cpu"), torch.bfloat16).read(ids, input_ids)
    got = on_a_lane(GPU, lambda: handover(staged, GPU))
    assert got.device == GPU and torch.equal(got.cpu(), want)
