"""The full threaded pipeline on CPU: clean ends, exact accounting, identical replicas, and
failures in any stage ending the run quickly with that stage's error."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from dflash_train.model.target import TargetFeatureExtractor
from dflash_train.pipeline.prefetch import BatchBuilder
from dflash_train.pipeline.workers import PipelineError
from dflash_train.train.replica import DraftReplica
from dflash_train.train.trainer import Trainer
from pipeline_helpers import deterministic_train_config, tiny_train_config, write_random_dataset


def run(cfg):
    trainer = Trainer(cfg, log=lambda _msg: None)
    trainer.build()
    return trainer, trainer.run()


def test_two_targets_two_drafters_finish_with_matching_accounting(tiny_target, tmp_path):
    data = write_random_dataset(tmp_path / "data", num_rows=30)
    cfg = tiny_train_config(tiny_target, data, tmp_path / "run", epochs=2)
    trainer, result = run(cfg)
    assert result.complete
    totals = trainer.pipeline.accounting.totals()
    assert totals == {"read": 60, "target": 60, "trained": 60}
    assert trainer.pipeline.accounting.problems(complete=True) == []
    assert "all match" in result.accounting
    a, b = trainer.replicas
    assert a.step == b.step == result.steps > 0
    assert all(
        torch.equal(x, y) for x, y in zip(a.model.parameters(), b.model.parameters(), strict=True)
    )
    assert (result.run_dir / "checkpoint" / "model.safetensors").is_file()
    assert (result.run_dir / "config.json").is_file()


def test_dataset_smaller_than_min_ready_still_finishes(tiny_target, tmp_path):
    data = write_random_dataset(tmp_path / "data", num_rows=3)
    cfg = tiny_train_config(tiny_target, data, tmp_path / "run", hs_queue_depth=90, hs_min_ready=30)
    trainer, result = run(cfg)
    assert result.complete and trainer.pipeline.accounting.totals()["trained"] == 3


def test_fewer_batches_than_drafters_and_unsupervised_batches_do_not_hang(tiny_target, tmp_path):
    # 3 batches of 1 for 2 drafters: the last step has one drafter with nothing; row 1 has no
    # supervised tokens at all, so its batch carries zero weight.
    data = write_random_dataset(tmp_path / "data", num_rows=3, unsupervised_rows=(1,))
    cfg = tiny_train_config(tiny_target, data, tmp_path / "run", batch_size=1)
    trainer, result = run(cfg)
    assert result.complete and trainer.pipeline.accounting.totals()["trained"] == 3


def test_an_all_unsupervised_dataset_finishes_without_updates(tiny_target, tmp_path):
    data = write_random_dataset(tmp_path / "data", num_rows=4, unsupervised_rows=range(4))
    cfg = tiny_train_config(tiny_target, data, tmp_path / "run")
    trainer, result = run(cfg)
    assert result.complete and result.steps == trainer.total_steps > 0  # each a step, not applied
    assert all(len(rep.optimizer.state) == 0 for rep in trainer.replicas)  # never stepped
    assert trainer.pipeline.accounting.totals()["trained"] == 4


def test_a_step_that_supervises_nothing_still_counts_as_a_step(tiny_target, tmp_path, monkeypatch):
    # Rows 1 and 2 supervise nothing: batches of one row, one drafter, so steps 2 and 3 carry
    # zero weight. Before, they left the step count at 1 and re-ran step 1's periodic save and
    # evaluation, logged its metric line again, and the run never reached its last step (no
    # final evaluation).
    from dflash_train.train.saving import RunSaver

    data = write_random_dataset(tmp_path / "data", num_rows=4, unsupervised_rows=(1, 2))
    cfg = deterministic_train_config(
        tiny_target, data, tmp_path / "run", batch_size=1, epochs=1, save_every=1
    )
    saves = []
    periodic = RunSaver.periodic
    monkeypatch.setattr(RunSaver, "periodic", lambda self: saves.append(1) or periodic(self))
    logged = []

    class Sink:  # the metric lines
        def log(self, step, metrics):
            logged.append((step, dict(metrics)))

        def close(self):
            pass

    trainer = Trainer(cfg, log=lambda _msg: None, sink_factory=lambda _dir, _config: Sink())
    trainer.build()
    evals = []

    class EveryThird:  # InLoopEval's interface
        def due(self, step):
            return step % 3 == 0

        def __call__(self, rep):
            evals.append(rep.step)
            return 1.0, 0.0

    trainer.evaluator = EveryThird()
    result = trainer.run()
    assert result.complete and result.steps == 4
    assert trainer.pipeline.accounting.totals()["trained"] == 4
    assert [step for step, metrics in logged if "eval/tau" not in metrics] == [1, 2, 3, 4]
    assert evals == [3, 4]  # due at 3, and the last step's
    assert len(saves) == 3  # after steps 1-3; step 4's is the final checkpoint
    (rep,) = trainer.replicas  # two updates: AdamW stepped twice
    assert {int(st["step"]) for st in rep.optimizer.state.values() if "step" in st} == {2}


def test_max_steps_stops_early_and_says_so(tiny_target, tmp_path):
    data = write_random_dataset(tmp_path / "data", num_rows=40)
    cfg = tiny_train_config(tiny_target, data, tmp_path / "run", epochs=3, max_steps=4)
    trainer, result = run(cfg)
    assert result.steps == 4 and not result.complete
    assert "partial: the run ended before its data" in result.accounting
    assert trainer.pipeline.accounting.problems(complete=False) == []
    # What an exact resume needs: optimizer moments by parameter name, trained ids per epoch.
    ckpt = result.checkpoint
    assert ckpt == result.run_dir / "checkpoints" / "step_0000004"
    assert (result.run_dir / "checkpoint").resolve() == ckpt.resolve()
    state = json.loads((ckpt / "train_state.json").read_text())
    assert state["step"] == 4 and state["epoch"] == 0 and not state["complete"]
    bits = np.unpackbits(load_file(ckpt / "state.safetensors")["trained"].numpy(), axis=-1)
    assert (
        bits[:, :40].shape == (3, 40)
        and bits.sum() == trainer.pipeline.accounting.totals()["trained"]
    )
    moments = load_file(ckpt / "optimizer.safetensors")  # Muon's matrices, AdamW's norms
    assert "fc.weight.momentum_buffer" in moments and "norm.weight.exp_avg_sq" in moments


def test_gradient_accumulation_counts_micro_batches(tiny_target, tmp_path):
    data = write_random_dataset(tmp_path / "data", num_rows=16)
    cfg = tiny_train_config(
        tiny_target, data, tmp_path / "run", batch_size=2, grad_accum=2, bucket_lengths=[128]
    )
    _trainer, result = run(cfg)
    assert result.complete and result.steps == 2  # 8 batches / (2 drafters x 2 micro-batches)


def _fail_on_call(n):
    calls = {"n": 0}

    def maybe_fail():
        calls["n"] += 1
        if calls["n"] == n:
            raise RuntimeError("injected failure")

    return maybe_fail


@pytest.mark.parametrize(
    ("cls", "method", "worker"),
    [
        (BatchBuilder, "build", "prefetch-"),
        (TargetFeatureExtractor, "__call__", "target-"),
        (DraftReplica, "micro_step", "drafter-"),
    ],
)
def test_a_failing_worker_stops_the_run_with_its_error(
    tiny_target, tmp_path, monkeypatch, cls, method, worker
):
    data = write_random_dataset(tmp_path / "data", num_rows=40)
    cfg = tiny_train_config(tiny_target, data, tmp_path / "run", epochs=3)
    original = getattr(cls, method)
    fail = _fail_on_call(3)

    def patched(self, *args, **kwargs):
        fail()
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, method, patched)
    trainer = Trainer(cfg, log=lambda _msg: None)
    trainer.build()
    t0 = time.monotonic()
    with pytest.raises(
        PipelineError, match=f"worker '{worker}\\d+' failed: RuntimeError: injected failure"
    ) as info:
        trainer.run()
    assert time.monotonic() - t0 < 20
    assert "Traceback" in str(info.value)
    assert trainer.pipeline.alive() == []
    # The weights trained so far are kept.
    assert (trainer.run_dir / "checkpoint" / "train_state.json").is_file()


def test_a_stalled_pipeline_is_declared_hung(tiny_target, tmp_path, monkeypatch):
    data = write_random_dataset(tmp_path / "data", num_rows=10)
    cfg = tiny_train_config(tiny_target, data, tmp_path / "run", stall_timeout=1.0)
    release = []

    def stuck(self, *args, **kwargs):
        while not release:  # a target that never returns (until the test ends)
            time.sleep(0.01)
            if trainer.pipeline.stop_event.is_set():
                raise RuntimeError("stopped")

    monkeypatch.setattr(TargetFeatureExtractor, "__call__", stuck)
    trainer = Trainer(cfg, log=lambda _msg: None)
    trainer.build()
    with pytest.raises(PipelineError, match="watchdog.*no pipeline progress"):
        trainer.run()
    release.append(True)


@pytest.mark.slow
def test_compiled_drafters_train_and_stay_identical(tiny_target, tmp_path, monkeypatch):
    # The target is traced too; with aot_eager (no inductor code generation) to keep it short.
    traced = TargetFeatureExtractor.compile
    monkeypatch.setattr(
        TargetFeatureExtractor, "compile", lambda ex, lengths: traced(ex, lengths, "aot_eager")
    )
    data = write_random_dataset(tmp_path / "data", num_rows=12)
    cfg = tiny_train_config(
        tiny_target, data, tmp_path / "run", compile=True, stall_timeout=300.0,
        target_devices=["cpu"],
    )  # fmt: skip
    lines: list[str] = []
    trainer = Trainer(cfg, log=lines.append)
    trainer.build()
    assert any(line.startswith("compiled the target on cpu") for line in lines), lines
    # Workers never trace: the stance is set once every shape was traced, reset at the end.
    import torch._dynamo.eval_frame as frames

    assert frames._stance.stance == "eager_on_recompile"
    result = trainer.run()
    assert frames._stance.stance == "default"
    assert result.complete and result.steps > 0
    a, b = trainer.replicas
    assert all(
        torch.equal(x, y) for x, y in zip(a.model.parameters(), b.model.parameters(), strict=True)
    )


def test_batch_cost_auto_measures_the_drafter_and_plans_and_records_its_share(
    tiny_target, tmp_path
):
    data = write_random_dataset(tmp_path / "data", num_rows=30)
    cfg = tiny_train_config(tiny_target, data, tmp_path / "run", batch_cost="auto")
    said = []
    trainer = Trainer(cfg, log=said.append)
    trainer.build()
    result = trainer.run()
    share = float(trainer.cfg.pipeline.batch_cost)  # auto became the measured number
    assert 0.0 <= share <= 1.0
    assert trainer.data.plans.batching.token_share == share
    assert any("batch cost (--batch-cost auto" in m for m in said)
    written = json.loads((result.run_dir / "config.json").read_text())
    assert written["pipeline"]["batch_cost"] == trainer.cfg.pipeline.batch_cost
    assert written["resolved"]["batch_cost_fit"]["token_share"] == share
    assert result.complete and trainer.pipeline.accounting.totals()["trained"] == 30
    assert result.steps == trainer.total_steps == -(-trainer.data.plans.batches_per_epoch() // 2)


def test_the_default_batch_cost_plans_by_the_drafters_flops_and_records_the_share(
    tiny_target, tmp_path
):
    """--batch-cost flops (the default): the share follows from the drafter's shape and the
    data alone (no timing), is recorded in the config, and plans exactly the batches the same
    share given as a number plans."""
    from dflash_train.model.flops import token_share

    data = write_random_dataset(tmp_path / "data", num_rows=30)
    said = []
    trainer = Trainer(
        tiny_train_config(tiny_target, data, tmp_path / "a", batch_cost="flops"), log=said.append
    )
    trainer.build()
    d = trainer.data
    share = token_share(d.draft_config, d.bucket_lengths[-1], 16)
    assert trainer.cfg.pipeline.batch_cost == f"{share:g}" and 0 < share < 1
    assert d.plans.batching.token_share == share
    assert any("batch cost (--batch-cost flops)" in m for m in said)
    written = json.loads((trainer.run_dir / "config.json").read_text())
    assert written["pipeline"]["batch_cost"] == f"{share:g}"
    assert written["resolved"]["batch_cost_from"] == "flops"
    plan = d.plans.epoch(0)
    trainer.close()
    again = Trainer(tiny_train_config(tiny_target, data, tmp_path / "b", batch_cost=f"{share:g}"))
    again.build()
    assert again.data.plans.epoch(0) == plan
    again.close()


def test_a_measured_token_share_replans_the_epoch_and_the_schedule(
    tiny_target, tmp_path, monkeypatch
):
    from dflash_train.pipeline.costing import CostFit

    fit = CostFit(0.0, 1e-6, 0.0, 1.0, [])  # the drafter's cost is all tokens
    monkeypatch.setattr("dflash_train.train.trainer.measure_batch_cost", lambda rep, data: fit)
    data = write_random_dataset(tmp_path / "data", num_rows=40)
    blocks = tiny_train_config(tiny_target, data, tmp_path / "a")
    trainer = Trainer(blocks, log=lambda _m: None)
    trainer.build()
    by_blocks = trainer.data.plans.batches_per_epoch()
    trainer.close()
    auto = tiny_train_config(tiny_target, data, tmp_path / "b", batch_cost="auto")
    trainer = Trainer(auto, log=lambda _m: None)
    trainer.build()
    assert trainer.cfg.pipeline.batch_cost == "1"
    lengths, longest = trainer.data.bucket_lengths, trainer.data.bucket_lengths[-1]
    plan = trainer.data.plans.epoch(0)
    assert all(len(s.seq_ids) * lengths[s.bucket] <= 2 * longest for s in plan)  # a token budget
    assert len(plan) != by_blocks
    assert trainer.total_steps == -(-len(plan) // 2)
    assert all(rep.total_steps == trainer.total_steps for rep in trainer.replicas)
    result = trainer.run()
    assert result.complete and trainer.pipeline.accounting.totals()["trained"] == 40


def test_target_batches_that_miss_their_graph_are_counted_in_the_metrics(tiny_target, tmp_path):
    # Graphs (the CPU stand-in backend) captured for one row per bucket: every planned batch of
    # two rows misses its graph and runs eagerly, and the metric lines say how many did.
    data = write_random_dataset(tmp_path / "data", num_rows=20)
    from dflash_train.train.command import metrics_sink

    cfg = tiny_train_config(tiny_target, data, tmp_path / "run", log_every=1)
    trainer = Trainer(cfg, log=lambda _m: None, sink_factory=metrics_sink(cfg))
    trainer.build()
    for ex in trainer.extractors:
        ex.capture_graphs({length: 1 for length in trainer.data.bucket_lengths}, backend="eager")
    result = trainer.run()
    misses = sum(ex.graph_misses for ex in trainer.extractors)
    assert result.complete and misses > 0
    assert result.last_metrics["time/target_graph_misses"] == misses
    lines = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    counts = [x["time/target_graph_misses"] for x in lines if "time/target_graph_misses" in x]
    assert counts == sorted(counts) and counts[-1] == misses  # a running count


def test_flex_calls_that_ran_unfused_are_counted_in_the_metrics(tiny_target, tmp_path, monkeypatch):
    # Flex has no backward on CPU: the replicas' "flex" runs the blockwise kernel here and
    # counts every call as unfused, as a shape that missed its compiled trace would on CUDA.
    # The metric lines must carry that count, and the workers run under eager_on_recompile.
    from dflash_train.model import block_attention as ba
    from dflash_train.model import flex
    from dflash_train.train import replica as replica_module
    from dflash_train.train.command import metrics_sink

    calls = []

    def unfused(*args):
        calls.append(1)
        flex._count_eager()
        return ba._blockwise(*args)

    stances = []
    monkeypatch.setattr(replica_module, "resolve_backend", lambda *_a, **_k: "flex")
    monkeypatch.setattr(ba, "_flex", unfused)
    monkeypatch.setattr(torch.compiler, "set_stance", lambda stance: stances.append(stance))
    data = write_random_dataset(tmp_path / "data", num_rows=20)
    cfg = tiny_train_config(tiny_target, data, tmp_path / "run", log_every=1)
    trainer = Trainer(cfg, log=lambda _m: None, sink_factory=metrics_sink(cfg))
    trainer.build()
    assert stances == ["eager_on_recompile"] and not calls  # nothing ran before the workers
    result = trainer.run()
    assert result.complete and calls
    assert result.last_metrics["time/flex_eager_calls"] == len(calls)
    assert stances == ["eager_on_recompile", "default"]  # restored when the run closed


def test_nodes_with_different_drafter_counts_are_refused_in_one_line(tiny_target, tmp_path):
    """Regression: each node planned its schedule with its own drafter count (the default is
    every GPU but cuda:0: machines differ); the node that ran out of steps first left the
    others in the step's collective until the group's timeout, nothing saved or named."""
    data = write_random_dataset(tmp_path / "data", num_rows=8)
    cfg = tiny_train_config(tiny_target, data, tmp_path / "run")  # 2 drafters here

    class TwoNodes:  # rank 0 of 2; rank 1 has `theirs` drafters
        rank, world_size, is_main = 0, 2, True

        def __init__(self, theirs):
            self.theirs = theirs

        def gather_text(self, text):
            return [text, self.theirs]

    with pytest.raises(ValueError, match=r"different numbers of drafters \(rank 0: 2, rank 1: 1\)"):
        Trainer(cfg, log=lambda _m: None, nodes=TwoNodes("1")).build()
    trainer = Trainer(cfg, log=lambda _m: None, nodes=TwoNodes("2"))
    try:  # the same count: past the check (as far as a fake group of nodes goes)
        trainer._load_data(None)
        trainer._resolve_devices()
    finally:
        trainer.close()


def test_a_drafter_vllm_cannot_serve_is_said_before_it_trains(tiny_target, tmp_path):
    """Regression: --num-target-features larger than the target's layers spread over repeated
    layer ids silently (an explicit repeat is refused; export only warned, after training)."""
    data = write_random_dataset(tmp_path / "data", num_rows=4)
    for features, noted in ((8, True), (1, False)):
        said = []
        cfg = tiny_train_config(tiny_target, data, tmp_path / "run", num_target_features=features)
        Trainer(cfg, log=said.append)._load_data(None)
        assert any("cannot serve this drafter" in line for line in said) == noted, said
