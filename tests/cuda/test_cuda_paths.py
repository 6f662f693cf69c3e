"""What only a GPU can check (marked `cuda`; skipped without one; `bench gpu` runs them):
flex gradients against the dense kernel, bf16 autocast against fp32 on the device, the
stream ordering of a hand-over between threads, the cross-device gradient sum, and a tiny run
of the whole pipeline on one shared GPU."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from device_values import chain, orthogonal
from dflash_train.devices import SegmentClock, enter_worker_thread, handover, wait_for
from dflash_train.model.block_attention import block_attention
from dflash_train.objective import make_layout, pack_anchors
from dflash_train.pipeline.sync import sum_into_all

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
GPU = torch.device("cuda", 0)


def kernel_case(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    seq, n, bs = 256, 16, 16
    anchors, valid = pack_anchors(
        [np.sort(np.random.default_rng(0).choice(250, 16, replace=False)), np.arange(3, 200, 20)],
        n,
    )
    layout = make_layout(anchors, valid, bs, GPU, num_chunks=4)
    shapes = [(2, 8, n * bs, 64), (2, 2, seq, 64), (2, 2, seq, 64), (2, 2, n * bs, 64),
              (2, 2, n * bs, 64)]  # fmt: skip
    inputs = [torch.randn(s, generator=gen).to(GPU, dtype) for s in shapes]
    return inputs, layout, torch.randn(shapes[0], generator=gen).to(GPU)


def test_flex_outputs_and_gradients_match_the_dense_kernel():
    inputs, layout, weights = kernel_case()
    results = {}
    for backend in ("dense", "flex", "blockwise"):
        xs = [t.clone().requires_grad_() for t in inputs]
        out = block_attention(*xs, layout, backend)
        (out * weights).sum().backward()
        results[backend] = [out.detach(), *(x.grad for x in xs)]
    for backend in ("flex", "blockwise"):
        for got, want in zip(results[backend], results["dense"], strict=True):
            torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)


def test_bf16_kernels_stay_close_to_fp32_on_the_device():
    inputs, layout, _ = kernel_case()
    want = block_attention(*inputs, layout, "dense").float()
    for backend in ("flex", "blockwise"):
        got = block_attention(*[t.bfloat16() for t in inputs], layout, backend).float()
        torch.testing.assert_close(got, want, atol=0.05, rtol=0.05)


def test_a_handover_is_ordered_after_the_producers_kernels():
    # The producer queues a long computation on its own lane and hands the result over at once
    # with its mark; the consumer, another thread with a lane of its own, must see the finished
    # values, not the memory before the kernels ran. The inputs are made (and finished) on
    # this thread first: the lanes do not wait for its default stream.
    a = orthogonal(4096, GPU)
    torch.cuda.synchronize(GPU)
    got: list = []

    def produce():
        lane = enter_worker_thread(GPU)
        assert torch.cuda.current_stream(GPU) == lane.stream != torch.cuda.default_stream(GPU)
        out = chain(a, a, 20)
        got.append((out, lane.mark()))  # no synchronize: the consumer is ordered by the mark

    t = threading.Thread(target=produce)
    t.start()
    t.join()
    dst = torch.device("cuda", 1) if torch.cuda.device_count() > 1 else GPU
    results: list = []

    def consume():
        lane = enter_worker_thread(dst)
        copied = handover(got[0][0], dst, got[0][1])
        results.append((copied * 1.0, lane.mark()))

    t = threading.Thread(target=consume)
    t.start()
    t.join()
    results[0][1].wait_here()
    expected = chain(a, a, 20)
    assert expected.abs().mean() > 1e-3  # of order 1 / sqrt(4096): a racing read fails
    torch.testing.assert_close(results[0][0].to(GPU), expected)


def test_replicas_on_their_own_lanes_sum_finished_gradients():
    # Two "replicas" on one GPU, each writing its gradient on its own lane after a long kernel;
    # the rendezvous (reducing on whichever thread arrives last) must sum the finished values.
    from dflash_train.pipeline.sync import Contribution, StepRendezvous

    a = orthogonal(2048, GPU)
    bufs = [torch.zeros(2048 * 2048, device=GPU) for _ in range(2)]
    torch.cuda.synchronize(GPU)  # the lanes do not wait for this thread's default stream
    rdv = StepRendezvous(bufs, threading.Event(), stall_timeout_s=60)
    outcomes = [None, None]

    def replica(rank):
        lane = enter_worker_thread(GPU)
        out = chain(a, a, 10 * (rank + 1))
        bufs[rank].copy_(out.flatten())
        outcomes[rank] = rdv.exchange(Contribution(rank, ready=lane.mark()))
        wait_for(outcomes[rank].done, GPU)
        outcomes[rank] = bufs[rank].clone()

    threads = [threading.Thread(target=replica, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.cuda.synchronize()
    want = torch.zeros_like(bufs[0])
    for rank in range(2):
        want += chain(a, a, 10 * (rank + 1)).flatten()
    assert want.abs().mean() > 1e-3  # of order 1 / sqrt(2048), not 1e-17..1e-33
    for got in outcomes:
        torch.testing.assert_close(got, want)


def test_segment_clock_harvests_only_finished_work_without_waiting():
    clock = SegmentClock(GPU)
    a = torch.randn(2048, 2048, device=GPU)
    with clock.segment("matmul"):
        for _ in range(50):
            a = a @ a / 2048.0
    clock.end_group()
    groups = clock.harvest(wait=True)
    assert len(groups) == 1 and groups[0]["matmul"] > 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_the_cross_device_gradient_sum_is_identical_everywhere():
    bufs = [torch.randn(1000, device=f"cuda:{i}") for i in range(2)]
    want = bufs[0].cpu() + bufs[1].cpu()
    sum_into_all(bufs)
    assert torch.equal(bufs[0].cpu(), bufs[1].cpu())
    torch.testing.assert_close(bufs[0].cpu(), want)


def test_a_tiny_run_of_the_whole_pipeline_on_one_shared_gpu(tiny_target, tmp_path):
    from dflash_train.train.trainer import Trainer
    from pipeline_helpers import tiny_train_config, write_random_dataset

    data = write_random_dataset(tmp_path / "data", num_rows=16)
    cfg = tiny_train_config(
        tiny_target, data, tmp_path / "run", target_devices=["cuda:0"],
        drafter_devices=["cuda:0"], share_device=True, attention="flex",
    )  # fmt: skip
    trainer = Trainer(cfg, log=lambda _m: None)
    trainer.build()
    result = trainer.run()
    assert result.complete and "all match" in result.accounting


def test_target_cuda_graphs_replay_the_eager_features_from_a_worker_lane(tiny_target):
    from dflash_train.model.target import TargetFeatureExtractor

    eager = TargetFeatureExtractor(tiny_target, [1, 3], GPU, torch.float32)
    graphed = TargetFeatureExtractor(tiny_target, [1, 3], GPU, torch.float32)
    assert graphed.capture_graphs({32: 4}) == 1  # on this (main) thread, before any worker
    ids = [torch.randint(0, 250, (rows, 32)) for rows in (4, 2, 3)]
    got: list = []

    def worker():
        lane = enter_worker_thread(GPU)
        got.extend(graphed(x) for x in ids)
        got.append(lane.mark())

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    got.pop().wait_here()
    for x, out in zip(ids, got, strict=True):
        torch.testing.assert_close(out, eager(x), atol=1e-5, rtol=1e-5)
    assert graphed.graph_misses == 0
