"""The compiled flex kernel's contract, on CPU (forward only: flex has no backward here).

Traced with torch.compile's "eager" backend (dynamo's guards and recompiles are the same as
inductor's, without code generation), with CPU counted as a compiled device type. What a GPU
adds (inductor's kernels, the backward) is checked in `tests/cuda`.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from dflash_train.model import flex
from dflash_train.model.block_attention import block_attention
from dflash_train.objective import make_layout, pack_anchors


@pytest.fixture
def kernel(monkeypatch):
    monkeypatch.setattr(flex, "COMPILED_DEVICE_TYPES", ("cuda", "cpu"))
    k = flex.FlexKernel(backend="eager", device_types=("cpu",))
    monkeypatch.setattr(flex, "FLEX", k)
    torch._dynamo.reset()  # each test traces from nothing (torch caches by function)
    yield k
    torch._dynamo.reset()


def case(rows: int, length: int, blocks: int, seed: int = 0, bs: int = 4):
    """q, k_ctx, v_ctx, k_blk, v_blk and the layout of `rows` rows of `length` context tokens
    with `blocks` blocks each (one chunk)."""
    rng = np.random.default_rng(seed)
    per_row = [np.sort(rng.choice(length - 1, blocks, replace=False)) for _ in range(rows)]
    anchors, valid = pack_anchors(per_row, blocks)
    layout = make_layout(anchors, valid, bs, "cpu", num_chunks=1)
    gen = torch.Generator().manual_seed(seed)
    n_q = blocks * bs
    shapes = [(rows, 4, n_q, 8), (rows, 2, length, 8), (rows, 2, length, 8), (rows, 2, n_q, 8)]
    shapes.append(shapes[-1])
    return [torch.randn(s, generator=gen) for s in shapes], layout


def run(inputs, layout, backend="flex", window=None, causal=False):
    with torch.no_grad():
        return block_attention(*inputs, layout, backend, window, causal)


def test_one_trace_serves_every_rows_length_and_block_count_of_a_layer_kind(kernel):
    # Rows, context length and blocks per chunk all change from call to call: one trace (the
    # mask's tiles hold 128 positions; every shape here has more than 128 keys, up to 128
    # queries).
    for shape in [(2, 200, 4), (3, 300, 8), (5, 150, 16), (4, 260, 32)]:
        inputs, layout = case(*shape)
        torch.testing.assert_close(run(inputs, layout), run(inputs, layout, "dense"))
    assert kernel.compiles == 1
    # torch specialises a size of 1: one row is a trace of its own, so are more than one tile
    # of queries and a new layer kind.
    for shape, compiles in [((1, 200, 4), 2), ((3, 200, 48), 3), ((2, 170, 40), 3)]:
        inputs, layout = case(*shape)
        torch.testing.assert_close(run(inputs, layout), run(inputs, layout, "dense"))
        assert kernel.compiles == compiles, shape
    inputs, layout = case(3, 200, 4)
    got = run(inputs, layout, window=6, causal=True)
    torch.testing.assert_close(got, run(inputs, layout, "dense", window=6, causal=True))
    assert kernel.compiles == 4


def test_a_worker_thread_never_compiles_and_its_unfused_calls_are_counted(kernel):
    traced, layout = case(2, 200, 4)
    run(traced, layout)  # the main thread traces the class of 2+ rows, full attention
    assert kernel.compiles == 1
    before = flex.eager_calls()
    results = {}

    def worker():
        inputs, lay = case(3, 300, 8, seed=1)  # same class: the compiled kernel
        results["same"] = (run(inputs, lay), run(inputs, lay, "dense"))
        inputs, lay = case(1, 150, 2, seed=2)  # never traced: unfused, counted, not compiled
        results["new"] = (run(inputs, lay), run(inputs, lay, "dense"))

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert kernel.compiles == 1
    assert flex.eager_calls() - before == 1
    for got, want in results.values():
        torch.testing.assert_close(got, want)


def test_a_call_torch_itself_runs_unfused_is_counted(kernel):
    inputs, layout = case(2, 200, 4)
    run(inputs, layout)
    before = flex.eager_calls()
    torch.compiler.set_stance("eager_on_recompile")  # what the trainer sets after its warm-up
    try:
        one_row, lay = case(1, 200, 4)
        got = run(one_row, lay)  # the main thread, but a recompile: torch runs it unfused
    finally:
        torch.compiler.set_stance("default")
    assert kernel.compiles == 1 and flex.eager_calls() - before == 1
    torch.testing.assert_close(got, run(one_row, lay, "dense"))


def test_the_recompile_limit_is_raised_to_what_is_asked_and_never_lowered():
    cfg = torch._dynamo.config
    # config.patch restores torch's settings (monkeypatch's undo would delete them).
    with cfg.patch(recompile_limit=8, accumulated_recompile_limit=256):
        assert flex.ensure_recompile_limit(112) == 112
        assert cfg.accumulated_recompile_limit == 448
        assert flex.ensure_recompile_limit(20) == 112
