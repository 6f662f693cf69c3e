"""The feature store on disk: append-only shards, exactly-once rows, crash recovery, and one
clear error for each way a store can be damaged or be of other features; and what keeps a store
whole when more than one process, a full disk, many shards or a crafted manifest meet it: one
writer per part (a second refused naming the holder), a write that fails part-way rolled back,
the mapped shards bounded, shard names checked, and parts written by several nodes read as one
store."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from dflash_train.store.codec import decode_row, encode_row
from dflash_train.store.lock import no_readers
from dflash_train.store.manifest import MANIFEST_FILE, Binding
from dflash_train.store.shards import RECORD
from dflash_train.store.store import FeatureStore, estimate

K, H, ROWS = 2, 8, 10
LENGTHS = np.array([3, 5, 2, 7, 4, 6, 1, 8, 3, 5])
BINDING = Binding("t" * 64, "d" * 64, ROWS, (1, 3), H, "fp32")
ROW_BYTES = LENGTHS * K * H * 4


def feats(row: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(row)
    return torch.randn(int(LENGTHS[row]), K * H, generator=g)


def write(store: FeatureStore, rows) -> None:
    for r in rows:
        store.append(r, encode_row(feats(r), "fp32", K), int(LENGTHS[r]))


def read(store: FeatureStore, row: int) -> torch.Tensor:
    raw = torch.from_numpy(np.array(store.row_bytes(row)))
    return decode_row(raw, int(LENGTHS[row]), K, H, "fp32", torch.float32)


def new_store(path, **kw) -> FeatureStore:
    return FeatureStore.open_for_append(path, BINDING, "target", "data", **kw)


def test_committed_rows_read_back_and_uncommitted_ones_are_not_in_the_store(tmp_path):
    store = new_store(tmp_path / "f")
    write(store, [0, 3, 5])
    assert not store.present().any()  # appended, not committed
    assert store.commit() == 3
    write(store, [7])
    store.close()  # row 7 was never committed
    again = FeatureStore.open(tmp_path / "f")
    assert np.flatnonzero(again.present()).tolist() == [0, 3, 5]
    for r in (0, 3, 5):
        assert torch.equal(read(again, r), feats(r))


def test_a_row_is_written_once_however_often_it_is_appended(tmp_path):
    store = new_store(tmp_path / "f")
    write(store, [2, 2])
    store.commit()
    write(store, [2])
    assert store.commit() == 0
    store.close()
    idx = np.fromfile(tmp_path / "f" / "shard-00000.idx", dtype=RECORD)
    assert idx["row"].tolist() == [2]


@pytest.mark.parametrize("failing_file", ["shard-00000.idx", "shard-00000.bin"])
def test_a_failed_commit_leaves_its_records_off_the_index_and_no_commit_after_it(
    tmp_path, monkeypatch, failing_file
):
    """Regression: the index's fsync failing left its records in the file and pending, so the
    next commit (another target worker's, in the hybrid) appended them again and the shard
    could no longer be opened. Now the failed records are cut off, the writer refuses every
    later commit (a retried fsync proves nothing), and a new session redoes the rows."""
    from dflash_train.store import shards

    store = new_store(tmp_path / "f")
    write(store, [0, 1])
    store.commit()
    write(store, [2, 3])
    index = tmp_path / "f" / "shard-00000.idx"
    real_fsync = os.fsync

    def failing(fd):
        if os.readlink(f"/proc/self/fd/{fd}") == str(tmp_path / "f" / failing_file):
            raise OSError(5, "Input/output error (injected)")
        real_fsync(fd)

    monkeypatch.setattr(shards.os, "fsync", failing)
    with pytest.raises(OSError, match="injected"):
        store.commit()
    monkeypatch.setattr(shards.os, "fsync", real_fsync)
    assert index.stat().st_size == 2 * RECORD.itemsize  # rows 0 and 1's records only
    with pytest.raises(OSError, match=r"an earlier commit failed \(OSError: .*injected"):
        store.commit()
    store.close()
    assert np.flatnonzero(FeatureStore.open(tmp_path / "f").present()).tolist() == [0, 1]
    resumed = new_store(tmp_path / "f")
    write(resumed, [2, 3])
    assert resumed.commit() == 2
    resumed.close()
    again = FeatureStore.open(tmp_path / "f")
    assert np.flatnonzero(again.present()).tolist() == [0, 1, 2, 3]
    assert all(torch.equal(read(again, r), feats(r)) for r in range(4))


def test_a_resumed_session_writes_new_shards_and_cuts_an_interrupted_commits_tail(tmp_path):
    store = new_store(tmp_path / "f")
    write(store, [0, 1])
    store.commit()
    write(store, [2])  # bytes written, never committed: a crash before the commit
    store._writer._values.close()  # (the process died: nothing else happens, but the kernel
    store._writer_lock.release()  # drops a dead process's lock)
    with open(tmp_path / "f" / "shard-00000.idx", "ab") as f:
        f.write(b"\x01\x02\x03")  # and a partial index record from a commit cut short
    resumed = new_store(tmp_path / "f")
    values = tmp_path / "f" / "shard-00000.bin"
    assert values.stat().st_size == (3 + 5) * K * H * 4  # rows 0 and 1 only
    assert (tmp_path / "f" / "shard-00000.idx").stat().st_size == 2 * RECORD.itemsize
    write(resumed, [2, 3])
    resumed.commit()
    resumed.close()
    store = FeatureStore.open(tmp_path / "f")
    assert store.manifest.shards == ["shard-00000", "shard-00001"]
    assert np.flatnonzero(store.present()).tolist() == [0, 1, 2, 3]
    assert all(torch.equal(read(store, r), feats(r)) for r in range(4))


def test_shards_rotate_at_shard_bytes_and_every_row_stays_one_contiguous_read(tmp_path):
    store = new_store(tmp_path / "f", shard_bytes=10 * K * H * 4)  # ~10 tokens per shard
    write(store, range(ROWS))
    store.commit()
    store.close()
    store = FeatureStore.open(tmp_path / "f")
    assert len(store.manifest.shards) > 3
    assert store.present().all()
    assert all(torch.equal(read(store, r), feats(r)) for r in range(ROWS))


def test_unlisted_shard_files_from_a_crash_are_removed_before_writing(tmp_path):
    new_store(tmp_path / "f").close()
    stray = tmp_path / "f" / "shard-00000.bin"
    stray.write_bytes(b"x" * 100)  # created, then the process died before listing it
    store = new_store(tmp_path / "f")
    assert not stray.exists()
    write(store, [4])
    store.commit()
    assert FeatureStore.open(tmp_path / "f").present()[4]


def test_a_store_of_other_features_is_refused_and_overwrite_replaces_only_a_store(tmp_path):
    new_store(tmp_path / "f").close()
    other = Binding("x" * 64, "d" * 64, ROWS, (1, 3), H, "fp32")
    with pytest.raises(ValueError, match="another target"):
        FeatureStore.open_for_append(tmp_path / "f", other, "t", "d")
    fp8 = Binding("t" * 64, "d" * 64, ROWS, (1, 3), H, "fp8")
    with pytest.raises(ValueError, match="holds fp32, not fp8"):
        FeatureStore.open_for_append(tmp_path / "f", fp8, "t", "d")
    FeatureStore.open_for_append(tmp_path / "f", other, "t", "d", overwrite=True).close()
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "precious.txt").write_text("not a store")
    with pytest.raises(ValueError, match="not a feature store"):
        FeatureStore.open_for_append(tmp_path / "g", other, "t", "d", overwrite=True)
    assert (tmp_path / "g" / "precious.txt").exists()


def test_damaged_stores_are_one_clear_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        FeatureStore.open(tmp_path / "nowhere")
    store = new_store(tmp_path / "f")
    write(store, [0, 1, 2])
    store.commit()
    store.close()
    values, index = tmp_path / "f" / "shard-00000.bin", tmp_path / "f" / "shard-00000.idx"
    os.truncate(values, values.stat().st_size - 1)
    with pytest.raises(ValueError, match="shard-00000.bin is truncated"):
        FeatureStore.open(tmp_path / "f")
    index.unlink()
    with pytest.raises(ValueError, match="index shard-00000.idx of shard shard-00000 is missing"):
        FeatureStore.open(tmp_path / "f")
    (tmp_path / "f" / MANIFEST_FILE).write_text(json.dumps({"format": "something else"}))
    with pytest.raises(ValueError, match="not a readable feature store manifest"):
        FeatureStore.open(tmp_path / "f")
    (tmp_path / "f" / MANIFEST_FILE).unlink()
    with pytest.raises(ValueError, match="not a feature store: it has no manifest.json"):
        FeatureStore.open(tmp_path / "f")


def test_inconsistent_index_records_are_refused(tmp_path):
    store = new_store(tmp_path / "f")
    write(store, [0, 1])
    store.commit()
    store.close()
    index = tmp_path / "f" / "shard-00000.idx"
    recs = np.fromfile(index, dtype=RECORD)
    recs["row"][1] = 0  # the same row twice
    recs.tofile(index)
    with pytest.raises(ValueError, match="stored twice"):
        FeatureStore.open(tmp_path / "f")
    recs["row"][1], recs["offset"][1] = 1, 12345  # a hole in the value file
    recs.tofile(index)
    with pytest.raises(ValueError, match="inconsistent records"):
        FeatureStore.open(tmp_path / "f")


def test_the_estimate_counts_the_rows_left_and_their_index_records(tmp_path):
    present = np.zeros(ROWS, dtype=bool)
    present[:4] = True
    est = estimate(BINDING, LENGTHS, present, tmp_path / "new" / "dir")
    assert est.bytes_per_token == K * H * 4
    left = int(LENGTHS[4:].sum())
    assert est.bytes_left == left * K * H * 4 + 6 * RECORD.itemsize
    assert est.free > 0 and est.fits
    assert "64 bytes per token" in est.describe(BINDING) and "4 stored already" in est.describe(
        BINDING
    )


# ---------------------------------------------------------------------- one writer
HOLDER = textwrap.dedent(
    """
    import sys
    import numpy as np
    from dflash_train.store.manifest import Binding
    from dflash_train.store.store import FeatureStore
    b = Binding("t" * 64, "d" * 64, 10, (1, 3), 8, "fp32")
    store = FeatureStore.open_for_append(sys.argv[1], b, "target", "data")
    store.append(0, np.zeros(3 * 2 * 8 * 4, np.uint8), 3)
    store.commit()
    store.append(1, np.ones(5 * 2 * 8 * 4, np.uint8), 5)  # appended, its commit to come
    print("ready", flush=True)
    sys.stdin.readline()
    store.commit()
    store.close()
    """
)


@contextlib.contextmanager
def writer_process(path):
    """Another process holding `path` open for writing, a row committed, one appended."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def test_a_zeroed_index_tail_is_uncommitted_cut_on_resume_and_zeros_before_a_record_refused(
    tmp_path,
):
    store = new_store(tmp_path / "f")
    write(store, [0, 1])
    store.commit()
    store.close()
    index = tmp_path / "f" / "shard-00000.idx"
    with open(index, "ab") as f:  # a crash after the index grew, before its records reached disk
        f.write(bytes(2 * RECORD.itemsize + 5))
    store = FeatureStore.open(tmp_path / "f")
    assert np.flatnonzero(store.present()).tolist() == [0, 1]
    assert all(torch.equal(read(store, r), feats(r)) for r in (0, 1))
    store.close()
    resumed = new_store(tmp_path / "f")
    assert index.stat().st_size == 2 * RECORD.itemsize  # the zeros cut before appending
    write(resumed, [2])
    resumed.commit()
    resumed.close()
    assert np.flatnonzero(FeatureStore.open(tmp_path / "f").present()).tolist() == [0, 1, 2]
    recs = np.fromfile(index, dtype=RECORD)
    recs[0] = 0  # zeros before a written record: damage, not an unfinished commit
    recs.tofile(index)
    with pytest.raises(ValueError, match="inconsistent records"):
        FeatureStore.open(tmp_path / "f")


READER = textwrap.dedent(
    """
    import sys
    from dflash_train.store.store import FeatureStore
    store = FeatureStore.open(sys.argv[1])
    print("ready", flush=True)
    sys.stdin.readline()
    """
)


def test_overwrite_is_refused_while_a_reader_has_the_store_open_and_its_rows_stay(tmp_path):
    path = tmp_path / "f"
    store = new_store(path)
    write(store, [0, 1])
    store.commit()
    store.close()
    proc = subprocess.Popen(
        [sys.executable, "-c", READER, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert proc.stdout.readline().strip() == b"ready"
        with pytest.raises(ValueError, match="is open for reading .* --overwrite would delete"):
            new_store(path, overwrite=True)
        reader = FeatureStore.open(path)  # readers share the store
        assert torch.equal(read(reader, 1), feats(1))  # nothing deleted by the refused capture
        proc.kill()  # a reader that died holds nothing
        proc.wait(timeout=30)
        with pytest.raises(ValueError, match="is open for reading"):
            new_store(path, overwrite=True)  # this process's own reader counts too
        reader.close()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
    new_store(path, overwrite=True).close()
    assert not FeatureStore.open(path).present().any()


def test_a_reader_is_refused_while_an_overwrite_is_deleting_the_store(tmp_path):
    new_store(tmp_path / "f").close()
    with no_readers(tmp_path / "f"), pytest.raises(ValueError, match="is being deleted by"):
        FeatureStore.open(tmp_path / "f")
    FeatureStore.open(tmp_path / "f").close()


def test_a_second_writer_is_refused_naming_the_holder_and_the_live_shard_survives(tmp_path):
    path = tmp_path / "f"
    with writer_process(path) as holder:
        with pytest.raises(ValueError) as e:
            new_store(path)
        msg = str(e.value)
        assert "\n" not in msg and "one writer at a time" in msg
        assert f"host {socket.gethostname()}, pid {holder.pid}" in msg
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.wait(timeout=60) == 0
    store = FeatureStore.open(path)  # the holder's rows, whole: nothing cut by the refused open
    assert store.present()[[0, 1]].all()
    assert not np.array(store.row_bytes(0)).any() and np.array(store.row_bytes(1)).all()


def test_a_writer_that_died_does_not_block_the_next_and_a_closed_one_frees_its_store(tmp_path):
    path = tmp_path / "f"
    with writer_process(path) as holder:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    store = new_store(path)  # the kernel dropped the dead writer's lock
    assert np.flatnonzero(store.present()).tolist() == [0]  # its uncommitted row cut off
    with pytest.raises(ValueError, match="this process"):
        new_store(path)
    store.close()
    new_store(path).close()


# ---------------------------------------------------------------------- a full disk
@contextlib.contextmanager
def file_size_limit(nbytes: int):
    """Writes past `nbytes` in any file are cut short, the next one fails (EFBIG): how a
    filling disk behaves (a short write, then ENOSPC), in this process, for a moment."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an error, not a signal that kills
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)


def test_a_row_cut_short_by_a_full_disk_is_rolled_back_and_the_next_row_reads_whole(tmp_path):
    store = new_store(tmp_path / "f")
    write(store, [0])
    store.commit()
    with file_size_limit(int(ROW_BYTES[0] + ROW_BYTES[1] // 2)), pytest.raises(OSError):
        write(store, [1])  # half of row 1 reached the disk, then the disk was full
    values = tmp_path / "f" / "shard-00000.bin"
    assert values.stat().st_size == ROW_BYTES[0]  # the half row is gone again
    write(store, [2])  # space freed: the next row starts where its record will say
    store.commit()
    assert torch.equal(read(store, 2), feats(2))
    store.close()
    again = FeatureStore.open(tmp_path / "f")
    assert np.flatnonzero(again.present()).tolist() == [0, 2]
    assert torch.equal(read(again, 0), feats(0)) and torch.equal(read(again, 2), feats(2))


def test_a_commit_cut_short_by_a_full_disk_leaves_whole_records_and_can_be_retried(tmp_path):
    store = new_store(tmp_path / "f")
    write(store, [0])
    store.commit()
    write(store, [3, 4])
    with file_size_limit(RECORD.itemsize + 10), pytest.raises(OSError):
        store.commit()  # 10 bytes of the two records written, then the disk was full
    index = tmp_path / "f" / "shard-00000.idx"
    assert index.stat().st_size == RECORD.itemsize  # only row 0's record, whole
    assert store.commit() == 2  # the same rows, committed once space is free
    store.close()
    again = FeatureStore.open(tmp_path / "f")
    assert np.flatnonzero(again.present()).tolist() == [0, 3, 4]
    assert all(torch.equal(read(again, r), feats(r)) for r in (0, 3, 4))


def test_a_shard_rollover_that_fails_leaves_the_store_appendable(tmp_path, monkeypatch):
    """Regression: a manifest write failing while the next shard was started (a full disk)
    left the closed writer in place and the shard listed in memory only, so the next append
    failed with 'I/O operation on closed file' instead of carrying on."""
    from dflash_train.store.manifest import Manifest

    store = new_store(tmp_path / "f", shard_bytes=int(ROW_BYTES[0]))  # a shard per row
    write(store, [0])
    real = Manifest.write

    def full(self, store_dir):
        raise OSError(28, "No space left on device (injected)")

    monkeypatch.setattr(Manifest, "write", full)
    with pytest.raises(OSError, match="injected"):
        write(store, [1])  # shard 0 committed and closed, shard 1 not listed
    assert store.manifest.shards == ["shard-00000"]
    monkeypatch.setattr(Manifest, "write", real)
    write(store, [1, 2])  # space freed: the same store goes on
    store.commit()
    store.close()
    again = FeatureStore.open(tmp_path / "f")
    assert np.flatnonzero(again.present()).tolist() == [0, 1, 2]
    assert all(torch.equal(read(again, r), feats(r)) for r in range(3))


# ---------------------------------------------------------------------- many shards
def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_reading_a_store_of_many_shards_keeps_the_open_files_bounded(tmp_path):
    rows = 200
    binding = Binding("t" * 64, "d" * 64, rows, (1,), 4, "fp32")
    store = FeatureStore.open_for_append(tmp_path / "f", binding, "t", "d", shard_bytes=16)
    for r in range(rows):  # one 16-byte row per shard: 200 shards
        store.append(r, np.full(16, r % 256, np.uint8), 1)
    store.commit()
    store.close()
    before = open_fds()
    many = FeatureStore.open(tmp_path / "f")
    assert len(many.manifest.shards) == rows
    peak = 0
    for r in range(rows):
        assert np.array(many.row_bytes(r)).tolist() == [r % 256] * 16
        peak = max(peak, open_fds() - before)
    assert peak <= 64 + 2  # the maps, at most (a read's own file, the listing's)
    assert many.open_maps() == 64
    small = FeatureStore.open(tmp_path / "f", max_maps=4)
    for r in range(rows):
        np.array(small.row_bytes(r))
    assert small.open_maps() == 4


def test_a_closed_store_keeps_no_shard_open(tmp_path):
    """Regression: close() released the read lock but kept the shard maps (a descriptor each,
    up to 64) while the object lived: a trainer kept after its run held them, and a store
    deleted then (`capture --overwrite`, allowed once the lock is free) kept its disk space."""
    binding = Binding("t" * 64, "d" * 64, 8, (1,), 4, "fp32")
    store = FeatureStore.open_for_append(tmp_path / "f", binding, "t", "d", shard_bytes=16)
    for r in range(8):
        store.append(r, np.full(16, r, np.uint8), 1)
    store.commit()
    store.close()
    reader = FeatureStore.open(tmp_path / "f")
    assert all(np.array(reader.row_bytes(r)).tolist() == [r] * 16 for r in range(8))
    assert reader.open_maps() == 8
    reader.close()
    assert reader.open_maps() == 0
    assert not [path for path in open_files() if path.startswith(str(tmp_path))]


def open_files() -> list[str]:
    """What this process's descriptors point at (one closed while listing is left out)."""
    paths = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            paths.append(os.readlink(f"/proc/self/fd/{fd}"))
    return paths


# ---------------------------------------------------------------------- crafted manifests
@pytest.mark.parametrize("name", ["../victim", "/tmp/victim", "shard-00000/../../victim", "x"])
def test_a_manifest_naming_files_outside_its_store_is_refused_and_they_stay_untouched(
    tmp_path, name
):
    new_store(tmp_path / "f").close()
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"precious" * 100)
    (tmp_path / "victim.idx").write_bytes(b"")  # to a store, "no committed rows": cut it all
    manifest = tmp_path / "f" / MANIFEST_FILE
    d = json.loads(manifest.read_text())
    d["shards"] = [name]
    manifest.write_text(json.dumps(d))
    for open_it in (lambda: new_store(tmp_path / "f"), lambda: FeatureStore.open(tmp_path / "f")):
        with pytest.raises(ValueError) as e:
            open_it()
        assert "is not one of a feature store's" in str(e.value) and "\n" not in str(e.value)
    assert victim.read_bytes() == b"precious" * 100


def test_a_manifest_listing_a_shard_twice_is_refused(tmp_path):
    new_store(tmp_path / "f").close()
    manifest = tmp_path / "f" / MANIFEST_FILE
    d = json.loads(manifest.read_text())
    d["shards"] = ["shard-00000", "shard-00000"]
    manifest.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="listed twice"):
        FeatureStore.open(tmp_path / "f")


# ---------------------------------------------------------------------- parts
def test_parts_written_by_two_nodes_read_as_one_store_as_they_commit(tmp_path):
    root = tmp_path / "f"
    node1 = new_store(root, part=1, world=2)  # may come first: the root's manifest is not there
    node0 = new_store(root, part=0, world=2)
    write(node0, [0, 2])
    node0.commit()
    write(node1, [1, 3])
    node1.commit()
    assert not node0.present()[[1, 3]].any()  # not read yet
    node0.refresh()
    assert np.flatnonzero(node0.present()).tolist() == [0, 1, 2, 3]
    assert torch.equal(read(node0, 3), feats(3))
    write(node0, [1, 4])  # row 1 is node 1's: not written twice
    node0.commit()
    for s in (node0, node1):
        s.close()
    union = FeatureStore.open(root)
    assert np.flatnonzero(union.present()).tolist() == [0, 1, 2, 3, 4]
    assert all(torch.equal(read(union, r), feats(r)) for r in range(5))
    idx = np.fromfile(root / "shard-00000.idx", dtype=RECORD)
    assert idx["row"].tolist() == [0, 2, 4]
    assert (root / "rank-00001" / "shard-00000.bin").is_file()


def test_the_rows_held_at_a_mark_are_told_apart_from_those_committed_since(tmp_path):
    root = tmp_path / "f"
    store = new_store(root)
    write(store, [5, 1])
    store.commit()
    mark = store.committed_counts()
    write(store, [7])
    store.commit()
    store.close()
    resumed = new_store(root)
    assert mark == {"0": 2}
    assert np.flatnonzero(resumed.rows_held(mark)).tolist() == [1, 5]
    assert resumed.rows_held(resumed.committed_counts()).sum() == 3
    with pytest.raises(ValueError, match="part 0 held 5 rows when this run started"):
        resumed.rows_held({"0": 5})


def test_a_part_of_other_features_is_refused(tmp_path):
    root = tmp_path / "f"
    new_store(root, part=1, world=2).close()
    other = Binding("t" * 64, "d" * 64, ROWS, (1, 3), H, "bf16")
    with pytest.raises(ValueError, match=r"its part 1 \(.*rank-00001\) holds other features"):
        FeatureStore.open_for_append(root, other, "t", "d")
    assert not (root / MANIFEST_FILE).exists()  # refused before anything was written
    new_store(root).close()
    part1 = root / "rank-00001" / MANIFEST_FILE
    d = json.loads(part1.read_text())
    d["dtype"] = "bf16"
    part1.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="holds bf16, not fp32"):
        FeatureStore.open(root)
