"""Long rows (16K-32K tokens) through everything: `prepare --max-length 32768`, the target
forward, the hidden-state queue held back by its byte bound (not its depth), the drafter's
context attention read in tiles, the loss and the step, every sequence trained once."""

from __future__ import annotations

import json

import pytest

from dflash_train import cli
from dflash_train.data.dataset import PreparedDataset
from dflash_train.data.synthetic import corpus_texts, synthetic_conversations, write_jsonl
from dflash_train.data.tokenizer import build_chat_tokenizer
from dflash_train.model.tiny import save_random_qwen3
from dflash_train.train.command import metrics_sink
from dflash_train.train.trainer import Trainer
from pipeline_helpers import record_context_tiles, tiny_train_config
from target_zoo import save_target

pytestmark = pytest.mark.slow  # rows of 6K-32K tokens: ~1-2 minutes each on 2 cores


def long_conversations(repeats: list[int]) -> list[dict]:
    """One conversation per entry, its assistant turn the corpus' answer repeated that often."""
    rows = synthetic_conversations(len(repeats), seed=4)
    for row, n in zip(rows, repeats, strict=True):
        answer = row["messages"][-1]
        answer["content"] = " ".join([answer["content"]] * n)
    return rows


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("long")
    target = root / "target"
    rows = synthetic_conversations(200, seed=4)
    tok = build_chat_tokenizer(corpus_texts(rows), target, vocab_size=400, style="qwen3")
    save_random_qwen3(target, vocab_size=len(tok) + 8, max_position_embeddings=40960)
    return root, tok


def test_prepare_keeps_32k_rows_and_training_runs_them_within_the_byte_bound(
    workspace, monkeypatch
):
    root, tok = workspace
    probe = long_conversations([1])[0]["messages"][-1]["content"]
    per_answer = max(1, len(tok(probe)["input_ids"]))
    repeats = [17000 // per_answer, 24000 // per_answer, 40000 // per_answer]  # ~17K, 24K, 40K
    write_jsonl(long_conversations(repeats), root / "long.jsonl")
    argv = ["prepare", "--data", str(root / "long.jsonl"), "--tokenizer", str(root / "target")]
    argv += ["--out", str(root / "data"), "--max-length", "32768"]
    assert cli.main(argv) == 0
    lengths = sorted(int(x) for x in PreparedDataset(root / "data").lengths)
    assert len(lengths) == 3 and lengths[0] > 16384 and lengths[-1] == 32768  # one truncated
    summary = json.loads((root / "data" / "summary.json").read_text())
    assert summary["settings"]["max_length"] == 32768

    tiles = record_context_tiles(monkeypatch)
    # Features are rows x length x 3 layers x 64 x 4 bytes: ~25 MB for a 32K row. 40 MB holds
    # one long batch, so the byte bound, not the depth of 8, holds the queue back.
    cfg = tiny_train_config(
        root / "target", root / "data", root / "run", target_devices=["cpu"],
        drafter_devices=["cpu"], batch_size=1, num_anchors=512, hs_queue_depth=8,
        hs_min_ready=1, hs_queue_bytes="40MB", num_prefetchers=1, log_every=1,
        bucket_lengths=[32768], mask_token_id=int(tok.convert_tokens_to_ids("<|MASK|>")),
    )  # fmt: skip
    trainer = Trainer(cfg, log=lambda _m: None, sink_factory=metrics_sink(cfg))
    trainer.build()
    result = trainer.run()
    assert result.complete and all(e["trained_exactly_once"] for e in result.per_epoch)
    assert tiles, "a 17K-32K context should have been read in tiles"
    lines = [json.loads(x) for x in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = [m for m in lines if "queue/bytes" in m]
    assert logged and max(m["queue/bytes"] for m in logged) <= 40e6
    assert max(m["queue/depth"] for m in logged) <= 2  # the bytes bound, long before depth 8
    assert all(m["train/loss"] == m["train/loss"] for m in logged if "train/loss" in m)  # no NaN


def test_an_mla_targets_drafter_trains_a_long_row_through_the_tiled_context(tmp_path, monkeypatch):
    """DeepSeek-V3/R1 and Kimi K2 drafters have one query head per key/value head (MLA, see
    `target.drafter_geometry`). One ~6K-token row, one row per micro-batch, 512 anchors of 16
    in 8 chunks: a chunk holds 64 x 16 = 1,024 block tokens, so with the tiny target's 4 heads
    every chunk whose context passes 4,096 tokens is past the 64 MiB score budget and read in
    tiles, at the real budget. The tiled kernel's backward used to fail there ("view size is
    not compatible"): with one query head per kv head and one row, the incoming gradient's
    block-major reshape is a strided view."""
    rows = synthetic_conversations(200, seed=4)
    tok = build_chat_tokenizer(corpus_texts(rows), tmp_path / "target", vocab_size=400)
    save_target("deepseek_v3", tmp_path / "target", vocab_size=len(tok) + 8,
                max_position_embeddings=8192)  # fmt: skip
    probe = long_conversations([1])[0]["messages"][-1]["content"]
    repeats = 6500 // max(1, len(tok(probe)["input_ids"]))
    write_jsonl(long_conversations([repeats]), tmp_path / "long.jsonl")
    argv = ["prepare", "--data", str(tmp_path / "long.jsonl"), "--tokenizer"]
    argv += [str(tmp_path / "target"), "--out", str(tmp_path / "data"), "--max-length", "8192"]
    assert cli.main(argv) == 0
    assert int(PreparedDataset(tmp_path / "data").lengths[0]) > 5000
    tiles = record_context_tiles(monkeypatch)
    cfg = tiny_train_config(
        tmp_path / "target", tmp_path / "data", tmp_path / "run", target_devices=["cpu"],
        drafter_devices=["cpu"], batch_size=1, block_size=16, num_anchors=512,
        hs_min_ready=1, num_prefetchers=1, log_every=1, bucket_lengths=[8192],
        mask_token_id=int(tok.convert_tokens_to_ids("<|MASK|>")),
    )  # fmt: skip
    trainer = Trainer(cfg, log=lambda _m: None, sink_factory=metrics_sink(cfg))
    trainer.build()
    drafter = trainer.replicas[0].model.config
    assert drafter.num_attention_heads == drafter.num_key_value_heads == 4
    result = trainer.run()
    assert result.complete and all(e["trained_exactly_once"] for e in result.per_epoch)
    assert tiles, "contexts past 4K tokens at 4 heads should have been read in tiles"
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [m["train/loss"] for m in lines if "train/loss" in m]
    assert losses and all(x == x for x in losses)  # no NaN
