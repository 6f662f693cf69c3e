"""The vLLM backend against the hf backend (slow): one engine for the whole module, in the vLLM
CPU environment `bench engine` builds and caches, reached as an endpoint. The engine runs vLLM's
core in its own process (VLLM_ENABLE_V1_MULTIPROCESSING=0): that core steps only while the
server's loop has an unfinished request, so every batch checks that a row's features are handed
over without a later engine step (a hand-over that waited for one stalled every batch).

- features equal the hf source's on the same rows, in the drafter's layer order (any order),
  and on each row's own tokens when rows are sent without their padding;
- an endpoint serving another fine-tune of the target (the same shape) is refused at open;
- both hand-overs (shared memory on this host, inline for another host) give the same bytes,
  concurrent target workers each get their own rows, and nothing stays in the hand-over
  directory;
- a short deterministic run (1 prefetcher, 1 target worker, 1 drafter, --mix fifo) has the same
  losses with either backend, and the drafter it trains from the engine's features is an
  ordinary export: the reference client decodes with it exactly as this project's loop does;
- with 2 target workers on the engine and random delays in every stage, two runs train the
  same batches at every step (the plan's order; issue 34's determinism with this backend);
- on-policy rounds (Draft-OPD, `--anchors on-policy` from a trained drafter) on the engine's
  features: the same rounds and losses as on the hf backend's, with the losses that need no
  teacher input (the engine serves no final-normed last hidden state), and the teacher's
  losses refused in one line.
"""

from __future__ import annotations

import json
import os
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_train import faults
from dflash_train.data.dataset import PreparedDataset
from dflash_train.engine.protocol import LOCK_FILE, TOKEN_FILE
from dflash_train.engine.source import VllmTarget, VllmTargetSettings
from dflash_train.model.target import TargetFeatureExtractor
from engine_helpers import (
    ENGINE_TEST_TIMEOUT_S,
    assert_no_engine_left,
    engine_pgids,
    save_vllm_target,
    shared_memory_segments,
    vllm_python,
)
from pipeline_helpers import (
    deterministic_train_config,
    fine_tune,
    jitter,
    logged_losses,
    tiny_train_config,
    write_random_dataset,
)
from pipeline_helpers import (
    run_trainer as train,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(ENGINE_TEST_TIMEOUT_S)]

ENGINE_LAYERS = [0, 1, 3]  # DFlash ids the module's engine serves (vLLM aux ids 1, 2, 4)
FEATURE_ATOL = 2e-5  # fp32 on CPU: measured max |vllm - hf| 4.4e-6 on features of size ~5
LOSS_RTOL = 1e-4


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return save_vllm_target(tmp_path_factory.mktemp("vllm_target") / "qwen3")


def settings(target_dir: Path, layer_ids: list[int], **kw) -> VllmTargetSettings:
    base = dict(
        target=str(target_dir),
        layer_ids=layer_ids,
        dtype=torch.float32,
        max_model_len=300,
        request_timeout_s=120.0,
        hidden_size=64,
        python=vllm_python(),
    )
    return VllmTargetSettings(**{**base, **kw})


@pytest.fixture(scope="module")
def engine(target_dir):
    """One engine for every test here (started as the trainer starts it), its core in the
    server's process."""
    before = shared_memory_segments()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine's environment
        target = VllmTarget.open(settings(target_dir, ENGINE_LAYERS), say=lambda _m: None)
    yield target
    target.close()
    assert target.process.group_pids() == []
    assert not Path(target.info["handover_dir"]).exists()
    assert shared_memory_segments() - before == set()


def endpoint(engine, target_dir, layer_ids, **kw) -> VllmTarget:
    """Another client of the module's engine, reached by URL as --target-endpoint does."""
    return VllmTarget.open(settings(target_dir, layer_ids, endpoint=engine.url, **kw))


def hf_features(target_dir, layer_ids, ids) -> torch.Tensor:
    ex = TargetFeatureExtractor(target_dir, layer_ids, torch.device("cpu"), torch.float32)
    return ex(ids)


def handover_files(engine) -> list[str]:
    return sorted(set(os.listdir(engine.info["handover_dir"])) - {TOKEN_FILE, LOCK_FILE})


@pytest.mark.parametrize("layer_ids", [[0, 1, 3], [3, 0], [1]])
def test_features_equal_the_hf_backends_in_the_drafters_layer_order(engine, target_dir, layer_ids):
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (3, 96))
    got = endpoint(engine, target_dir, layer_ids).source()(ids)
    want = hf_features(target_dir, layer_ids, ids)
    assert got.shape == want.shape == (3, 96, 64 * len(layer_ids)) and got.dtype == torch.float32
    diff = (got - want).abs()
    over = int((diff > FEATURE_ATOL).sum())
    assert torch.allclose(got, want, rtol=0, atol=FEATURE_ATOL), (diff.max(), over)
    assert handover_files(engine) == []  # read and deleted at once


def test_rows_without_their_padding_give_the_hf_features_on_their_own_tokens(engine, target_dir):
    torch.manual_seed(2)
    ids = torch.randint(0, 256, (3, 80))
    lengths = [80, 33, 57]
    for i, n in enumerate(lengths):
        ids[i, n:] = 0  # the prefetchers' padding
    job = types.SimpleNamespace(input_ids=ids, seq_ids=np.arange(3))
    got = endpoint(engine, target_dir, [3, 0]).source(np.array(lengths)).features_of(job)
    want = hf_features(target_dir, [3, 0], ids)  # computed on the padded rows
    for i, n in enumerate(lengths):
        assert torch.allclose(got[i, :n], want[i, :n], rtol=0, atol=FEATURE_ATOL), i
        assert not got[i, n:].any()
    assert handover_files(engine) == []


def test_an_endpoint_serving_another_fine_tune_is_refused_at_open(engine, target_dir, tmp_path):
    other = tmp_path / "fine-tuned"
    fine_tune(target_dir, other, "mlp", "start")  # the same config, other weights
    with pytest.raises(ValueError, match="serves other weights than this run's --target"):
        endpoint(engine, other, ENGINE_LAYERS)


def test_inline_hand_over_gives_the_same_bytes_as_shared_memory(engine, target_dir):
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    shm = endpoint(engine, target_dir, [3, 1])
    inline = endpoint(engine, target_dir, [3, 1])
    assert shm.shared_memory
    inline.shared_memory = False  # as a trainer on another host sees the engine
    a, b = shm.source()(ids), inline.source()(ids)
    assert torch.equal(a, b) or torch.allclose(a, b, rtol=0, atol=FEATURE_ATOL)
    assert handover_files(engine) == []


def test_a_layer_the_engine_does_not_serve_is_refused_at_open(engine, target_dir):
    with pytest.raises(ValueError, match=r"serves target layers \[0, 1, 3\].*needs \[2\]"):
        endpoint(engine, target_dir, [1, 2])


def test_concurrent_target_workers_each_get_their_own_rows(engine, target_dir):
    target = endpoint(engine, target_dir, ENGINE_LAYERS)
    batches = [torch.randint(0, 256, (2, 48 + 16 * i)) for i in range(4)]
    results: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            source = target.source()
            for _ in range(3):
                results[i] = source(batches[i])
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    for i, ids in enumerate(batches):
        want = hf_features(target_dir, ENGINE_LAYERS, ids)
        assert torch.allclose(results[i], want, rtol=0, atol=FEATURE_ATOL), i
    assert handover_files(engine) == []


def test_a_deterministic_run_has_the_same_losses_with_either_backend(
    engine, target_dir, tmp_path, monkeypatch
):
    data = write_random_dataset(tmp_path / "data", num_rows=16)
    hf_cfg = deterministic_train_config(target_dir, data, tmp_path / "hf", target_layer_ids=[1, 3])
    vllm_cfg = deterministic_train_config(
        target_dir,
        data,
        tmp_path / "vllm",
        target_layer_ids=[1, 3],
        target_backend="vllm",
        target_endpoint=[engine.url],
    )
    (_, hf), (trainer, vllm) = train(hf_cfg), train(vllm_cfg)
    assert hf.complete and vllm.complete and hf.steps == vllm.steps == 16
    # The engine computed every row's own tokens, twice (2 epochs), not the 128-token bucket's
    # padding: 2 layers x 64 x fp32 each.
    tokens = 2 * int(PreparedDataset(data).lengths.sum())
    assert [s.stats.nbytes for s in trainer.targets.sources] == [tokens * 2 * 64 * 4]
    want, got = logged_losses(tmp_path / "hf"), logged_losses(tmp_path / "vllm")
    assert sorted(got) == sorted(want) == list(range(1, 17))
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=LOSS_RTOL), step
    assert vllm.per_epoch == hf.per_epoch  # every sequence trained once, both ways
    assert engine.process.exit_code() is None  # an endpoint's engine keeps serving
    assert handover_files(engine) == []
    check_reference_client(tmp_path / "vllm", target_dir, tmp_path / "export", monkeypatch)


def test_on_policy_rounds_on_the_engines_features_train_as_on_the_hf_backends(
    engine, target_dir, tmp_path
):
    """Draft-OPD's post-training stage with the target on the engine: a drafter trained first
    (hf, random anchors), then on-policy rounds from it on either backend's features. The rounds
    are recomputed from those features at every step, so equal losses and equal round
    statistics at every step mean the engine's rows reach the rounds as the hf rows do."""
    data = write_random_dataset(tmp_path / "data", num_rows=12)
    sft = deterministic_train_config(target_dir, data, tmp_path / "sft", target_layer_ids=[1, 3])
    assert train(sft)[1].complete
    opd = dict(
        target_layer_ids=[1, 3],
        init_from=str(tmp_path / "sft"),
        anchors="on-policy",
        loss="ce",
        opd_rejected_weight=0.0,
        epochs=1,
    )
    hf_cfg = deterministic_train_config(target_dir, data, tmp_path / "hf", **opd)
    vllm_cfg = deterministic_train_config(
        target_dir, data, tmp_path / "vllm", target_backend="vllm",
        target_endpoint=[engine.url], **opd,
    )  # fmt: skip
    (_, hf), (_, vllm) = train(hf_cfg), train(vllm_cfg)
    assert hf.complete and vllm.complete and hf.steps == vllm.steps == 6
    assert vllm.per_epoch == hf.per_epoch
    want, got = (rounds_by_step(tmp_path / name) for name in ("hf", "vllm"))
    assert sorted(got) == sorted(want) == list(range(1, 7))
    for step, (loss, tau, rejected) in want.items():
        assert got[step][0] == pytest.approx(loss, rel=LOSS_RTOL), step
        assert got[step][1:] == pytest.approx((tau, rejected), rel=1e-6), step
        assert 1.0 <= tau <= 8.0  # block 8: one to eight tokens a round
    # The losses on the target's distribution read a teacher input the engine does not serve.
    kl = deterministic_train_config(
        target_dir, data, tmp_path / "kl", **{**opd, "loss": "kl"}, target_backend="vllm",
        target_endpoint=[engine.url],
    )  # fmt: skip
    with pytest.raises(ValueError, match="--loss kl"):
        train(kl)
    assert handover_files(engine) == []


def test_two_target_workers_on_the_engine_train_in_the_plans_order_whatever_their_timing(
    engine, target_dir, tmp_path
):
    """Determinism with the engine: 2 prefetchers, 2 target workers (clients of the engine) and
    2 drafter replicas, random delays before every call of every stage, another seed per run:
    every step trains the same batches (the same padding share, exactly) and so the same loss.
    The loss is equal to fp32 rounding, not bit for bit: the engine batches whichever rows its
    clients have in flight, and a CPU matmul over other rows may round the last bit otherwise.
    (With an arrival-order pull, --mix stratified, the padding shares differ from step 3 on.)"""
    data = write_random_dataset(tmp_path / "data", num_rows=24)
    runs = []
    for seed in (1, 2):
        cfg = tiny_train_config(
            target_dir, data, tmp_path / f"run{seed}", target_layer_ids=[1, 3],
            target_backend="vllm", target_endpoint=[engine.url], log_every=1,
            bucket_lengths=[64, 128], hs_queue_depth=6, hs_min_ready=2,
        )  # fmt: skip
        faults.install(jitter(seed))
        try:
            _, result = train(cfg)
        finally:
            faults.install(None)
        assert result.complete and "all match" in result.accounting
        runs.append(step_figures(tmp_path / f"run{seed}"))
    (a, b) = runs
    assert a.keys() == b.keys() and len(a) >= 6
    for step in a:
        assert b[step][1] == a[step][1], step  # the same batches
        assert b[step][0] == pytest.approx(a[step][0], rel=1e-5), step
    assert handover_files(engine) == []


def step_figures(run_dir: Path) -> dict[int, tuple[float, float]]:
    """(train/loss, train/padding_frac) by step."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "train/loss" in rec:
            out[rec["step"]] = (rec["train/loss"], rec["train/padding_frac"])
    return out


def rounds_by_step(run_dir: Path) -> dict[int, tuple[float, float, float]]:
    """(train/loss, train/opd_tau, train/opd_rejected_per_row) by step of an on-policy run."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "train/opd_tau" in rec:
            out[rec["step"]] = (
                rec["train/loss"],
                rec["train/opd_tau"],
                rec["train/opd_rejected_per_row"],
            )
    return out


def check_reference_client(run_dir, target_dir, export, monkeypatch) -> None:
    """The run's export, decoded by the reference client and by this project's loop (T = 0):
    the same acceptance lengths and tokens on a few prompts."""
    pytest.importorskip("dflash", reason="pip install --no-deps dflash==0.1.0")
    import dflash.model

    from dflash_train.export import export_draft
    from dflash_train.model.serving import load_exported
    from dflash_train.model.target import FrozenHead, load_causal_lm
    from dflash_train.speculative import speculative_generate

    export_draft(run_dir, export, target_dir=target_dir)
    monkeypatch.setattr(dflash.model, "_cuda_time", time.perf_counter)
    target = load_causal_lm(target_dir, torch.device("cpu"), torch.float32)
    mine = load_exported(export)
    theirs = dflash.DFlashDraftModel.from_pretrained(str(export), dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(4)
    for _ in range(3):
        ids = torch.randint(0, 250, (12,), generator=gen)
        ours = speculative_generate(
            mine, target, FrozenHead.of_model(target), ids, max_new_tokens=24,
            block_size=mine.config.block_size,
        )  # fmt: skip
        ref = dflash.model.dflash_generate(
            theirs, target, ids[None], 24, None, temperature=0.0, return_stats=True
        )
        assert ref.acceptance_lengths == ours.acceptance_lengths
        assert ref.output_ids[0, len(ids) :].tolist() == ours.tokens


def capture_both_ways(target_dir, tmp_path, *via: str) -> None:
    """An hf capture and a vLLM capture (`via`: how it reaches its engine) of the same 10 rows:
    the same store row by row (fp32 stores, the features' tolerance)."""
    from dflash_train import cli
    from dflash_train.store.reader import StoreReader
    from dflash_train.store.store import FeatureStore

    data = write_random_dataset(tmp_path / "data", num_rows=10)
    common = ["capture", "--target", str(target_dir), "--data", str(data), "--dtype", "fp32"]
    common += ["--target-layer-ids", "1,3", "--target-devices", "cpu", "--batch-size", "3"]
    assert cli.main([*common, "--out", str(tmp_path / "hf")]) == 0
    assert (
        cli.main([*common, "--out", str(tmp_path / "vllm"), "--target-backend", "vllm", *via]) == 0
    )
    stores = [FeatureStore.open(tmp_path / name) for name in ("hf", "vllm")]
    assert all(s.present().all() for s in stores)
    readers = [StoreReader(s, [1, 3], torch.device("cpu"), torch.float32) for s in stores]
    for sid in range(10):
        n = int(stores[0].tokens_of[sid])
        ids = torch.zeros(1, n, dtype=torch.long)
        want, got = (r.read(np.array([sid]), ids) for r in readers)
        assert torch.allclose(got, want, rtol=0, atol=FEATURE_ATOL), sid


def test_a_capture_on_the_engine_stores_the_hf_backends_features(engine, target_dir, tmp_path):
    # `dflash-train capture --target-backend vllm`: the same store as an hf capture, row by row.
    capture_both_ways(target_dir, tmp_path, "--target-endpoint", engine.url)
    assert handover_files(engine) == []


def test_a_tensor_parallel_engine_computes_the_same_features(target_dir, tmp_path, capsys):
    # --target-tp 2: the target split over two ranks (on CPU each bound to its own core, see
    # engine.process.cpu_thread_binding) hands over the same features, once per row (rank 0's),
    # and the engine the capture started is gone when it ends.
    capture_both_ways(target_dir, tmp_path, "--vllm-python", vllm_python(), "--target-tp", "2")
    err = capsys.readouterr().err
    assert "TP 2" in err
    assert_no_engine_left(engine_pgids(err))
