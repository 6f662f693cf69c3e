"""The compiled flex kernel's contract, on CPU (forward only: flex has no backward here).

Traced with a backend that asks of every trace what inductor's CUDA lowering asks before it
picks a kernel, then runs the graph eagerly (`cuda_lowering_guards`): dynamo's guards and
recompiles, plus the lowering's, without code generation; CPU is counted as a compiled device
type. What a GPU adds (inductor's kernels, the backward) is checked in `tests/cuda`.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from dflash_train.model import flex
from dflash_train.model.block_attention import block_attention
from dflash_train.objective import make_layout, pack_anchors


def cuda_lowering_guards(gm, example_inputs):
    """torch.compile's eager backend, plus the one size condition inductor's CUDA flex lowering
    evaluates on every trace whatever it then picks: `queries < 128`
    (`_use_flex_decoding` in torch/_inductor/kernel/flex/flex_decoding.py, called from
    flex_attention.py's lowering; `evaluate_expr` on a symbolic size installs a guard)."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.higher_order.flex_attention:
            queries = node.args[0].meta["example_value"].shape[-2]
            bool(queries < 128)  # a symbolic comparison made concrete: torch guards on it
    return gm.forward


@pytest.fixture
def kernel(monkeypatch):
    monkeypatch.setattr(flex, "COMPILED_DEVICE_TYPES", ("cuda", "cpu"))
    k = flex.FlexKernel(backend=cuda_lowering_guards, device_types=("cpu",))
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


# Pairs of calls (rows, blocks, block size, context) and whether one trace serves both, each
# from a condition torch evaluates on a trace: dynamo specialises a size of 1; the block mask
# works in tiles of 128 positions (`_DEFAULT_SPARSE_BLOCK_SIZE`), so one tile of queries or of
# keys is a shape of its own; inductor's CUDA lowering guards on queries < 128.
SAME_TRACE = [
    ((2, 4, 16, 700), (5, 7, 16, 900), True),  # 64 and 112 queries: all sizes symbolic
    ((2, 4, 16, 700), (2, 8, 16, 700), False),  # 64 vs 128 queries: the lowering's < 128
    ((3, 2, 16, 300), (2, 8, 16, 700), False),  # 32 vs 128 (the same query tile, though)
    ((2, 8, 16, 700), (3, 16, 8, 500), True),  # 128 queries both
    ((2, 8, 16, 700), (2, 9, 16, 700), False),  # 128 queries fit one tile, 144 do not
    ((2, 9, 16, 700), (4, 64, 16, 3000), True),  # more than one tile of queries
    ((1, 4, 16, 700), (2, 4, 16, 700), False),  # one row
    ((2, 1, 16, 700), (2, 2, 16, 700), False),  # one block per chunk
    ((2, 4, 16, 64), (2, 4, 16, 65), False),  # 128 keys fit one tile, 129 do not
    ((2, 2, 16, 10), (2, 3, 16, 20), True),  # 42 and 68 keys: one tile both
]


@pytest.mark.parametrize(("a", "b", "same"), SAME_TRACE)
def test_shape_classes_split_where_torchs_guards_do(a, b, same):
    assert (flex.shape_class(*a) == flex.shape_class(*b)) == same


def test_every_shape_class_is_one_trace_and_a_new_one_traces_once_more(kernel):
    # Rows, context length and blocks per chunk change from call to call: a trace per class
    # (`FlexKernel.traced` holds the classes the main thread ran), never one per shape.
    shapes = [(2, 200, 4), (3, 300, 8), (5, 150, 16)]  # 16, 32, 64 queries (block size 4)
    shapes += [(4, 260, 32), (2, 180, 32)]  # 128 queries: the lowering's guard
    shapes += [(3, 200, 48), (2, 170, 40), (1, 200, 4)]  # more than one tile; one row
    for shape in shapes:
        inputs, layout = case(*shape)
        torch.testing.assert_close(run(inputs, layout), run(inputs, layout, "dense"))
        assert kernel.compiles == len(kernel.traced), shape
    assert kernel.compiles == 4
    inputs, layout = case(3, 200, 4)  # a new layer kind
    got = run(inputs, layout, window=6, causal=True)
    torch.testing.assert_close(got, run(inputs, layout, "dense", window=6, causal=True))
    assert kernel.compiles == len(kernel.traced) == 5


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


def test_a_worker_never_recompiles_across_the_lowerings_128_queries(kernel):
    # tests/cuda/test_first_run.py's case: 128 queries traced on the main thread, then 64 in
    # a worker. One class to dynamo alone, two to the CUDA lowering: the worker must not trace.
    traced, layout = case(3, 300, 32)  # 128 queries
    run(traced, layout)
    before = flex.eager_calls()
    results = {}

    def worker():
        inputs, lay = case(2, 260, 16, seed=1)  # 64 queries
        results["short"] = (run(inputs, lay), run(inputs, lay, "dense"))

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert kernel.compiles == 1, "the worker traced"
    assert flex.eager_calls() - before == 1
    torch.testing.assert_close(*results["short"])


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
