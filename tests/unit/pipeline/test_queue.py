"""BufferedHSQueue's contract: bounds, readiness gate, drain, pull modes, counting, stop."""

from __future__ import annotations

import random
import sys
import threading
import time
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_train.pipeline.queue import END, BufferedHSQueue, QueueStopped, total_variation


def wait_until(predicate, timeout=5.0):
    """Poll a condition on the queue's own state (never a sleep standing in for a signal)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.001)


def test_put_blocks_at_max_depth():
    q = BufferedHSQueue(max_depth=3, min_ready=1, num_producers=1)
    for i in range(3):
        q.put(i)
    with pytest.raises(TimeoutError):
        q.put(3, timeout=0.05)
    assert q.get() in (0, 1, 2)
    q.put(3, timeout=0.05)  # room again
    assert len(q) == 3


def test_get_waits_below_min_ready_while_producers_live():
    q = BufferedHSQueue(max_depth=10, min_ready=3, num_producers=1)
    q.put("a")
    q.put("b")
    with pytest.raises(TimeoutError):
        q.get(timeout=0.05)
    q.put("c")
    assert q.get(timeout=1) in ("a", "b", "c")


def test_drains_below_min_ready_after_producers_finish():
    q = BufferedHSQueue(max_depth=10, min_ready=5, num_producers=2)
    q.put(1)
    q.put(2)
    q.producer_done()
    with pytest.raises(TimeoutError):
        q.get(timeout=0.05)  # one producer still alive
    q.producer_done()
    got = {q.get(timeout=1), q.get(timeout=1)}
    assert got == {1, 2}
    assert q.get(timeout=1) is END
    assert q.get(timeout=1) is END  # END is sticky


def test_end_needs_every_producer_and_extra_done_is_an_error():
    q = BufferedHSQueue(max_depth=4, min_ready=1, num_producers=3)
    q.producer_done()
    q.producer_done()
    with pytest.raises(TimeoutError):
        q.get(timeout=0.05)
    q.producer_done()
    assert q.get(timeout=1) is END
    with pytest.raises(RuntimeError, match="more than num_producers"):
        q.producer_done()


@pytest.mark.parametrize(("depth", "ready"), [(0, 1), (4, 0), (4, 5)])
def test_bad_bounds_are_refused_at_start(depth, ready):
    with pytest.raises(ValueError, match="min_ready|positive"):
        BufferedHSQueue(max_depth=depth, min_ready=ready, num_producers=1)


def test_fifo_keeps_arrival_order():
    q = BufferedHSQueue(max_depth=10, min_ready=1, num_producers=1, mix="fifo")
    for i in range(5):
        q.put(i, bucket=i % 2)
    assert [q.get() for _ in range(5)] == [0, 1, 2, 3, 4]


def test_random_pull_is_not_arrival_order_and_is_uniform():
    counts = Counter()
    trials = 3000
    for t in range(trials):
        q = BufferedHSQueue(max_depth=8, min_ready=4, num_producers=1, mix="random", seed=t)
        for i in range(4):
            q.put(i)
        counts[q.get()] += 1
    # Each of the 4 buffered items is first with probability 1/4.
    assert all(abs(counts[i] / trials - 0.25) < 0.04 for i in range(4))


@pytest.mark.parametrize(("mix", "max_tv"), [("stratified", 0.05), ("random", 1.0)])
def test_stratified_pull_holds_the_dataset_mix_when_one_bucket_floods(mix, max_tv):
    weights = {0: 0.5, 1: 0.3, 2: 0.2}
    q = BufferedHSQueue(
        max_depth=70,
        min_ready=20,
        num_producers=1,
        mix=mix,
        bucket_weights=weights,
        seed=1,
        bucket_cap=None,
        max_age=10**9,
    )
    # Bucket 2 (long sequences) floods the buffer: 5x as many buffered as each other bucket
    # (no admission cap and no age bound here: the pull alone is under test).
    for b, n in ((0, 10), (1, 10), (2, 50)):
        for _ in range(n):
            q.put(b, bucket=b)
    drawn = Counter()
    for _ in range(4000):
        b = q.get()
        drawn[b] += 1
        q.put(b, bucket=b)  # each bucket's producer refills what was taken
    tv = total_variation(dict(drawn), weights)
    if mix == "stratified":
        assert tv < max_tv
    else:
        assert drawn[2] / 4000 > 0.6  # uniform pull follows the flood (50 / 70)


def test_stratified_pull_never_waits_on_an_empty_bucket():
    q = BufferedHSQueue(
        max_depth=4, min_ready=1, num_producers=1, bucket_weights={0: 0.99, 1: 0.01}
    )
    q.put("x", bucket=1)
    assert q.get(timeout=0.5) == "x"


def test_byte_bound_blocks_put_and_admits_oversized_items_when_empty():
    q = BufferedHSQueue(max_depth=10, min_ready=1, num_producers=1, max_bytes=100)
    q.put("a", nbytes=60)
    with pytest.raises(TimeoutError):
        q.put("b", nbytes=60, timeout=0.05)
    q.get()
    q.put("huge", nbytes=500, timeout=0.05)  # alone in an empty queue: admitted
    assert q.stats().bytes == 500


def test_byte_bound_opens_the_readiness_gate_instead_of_deadlocking():
    q = BufferedHSQueue(max_depth=10, min_ready=5, num_producers=1, max_bytes=100)
    q.put("a", nbytes=60)
    t = threading.Thread(target=q.put, args=("b",), kwargs={"nbytes": 60, "timeout": 5})
    t.start()
    wait_until(lambda: q._blocked_producers == 1)
    assert q.get(timeout=1) == "a"  # depth 1 < min_ready, but the producer cannot add more
    t.join(timeout=5)
    assert not t.is_alive()


def test_a_producer_woken_with_room_no_longer_holds_the_gate_open():
    """Regression: the gate counted a producer as blocked until it re-took the lock.

    A full queue (max_depth = min_ready = 2) with its producer waiting in put: the first get
    makes room, so the producer is no longer blocked (the buffer can grow again). A second get
    that wins the lock before the producer does must wait for min_ready and take its item only
    after the producer's put, not drain the buffer on the stale "a producer is blocked" count.
    A long GIL switch interval makes this thread win that race every time.
    """
    q = BufferedHSQueue(max_depth=2, min_ready=2, num_producers=1, poll_s=30.0)
    q.put(0)
    q.put(1)
    t = threading.Thread(target=q.put, args=(2,), kwargs={"timeout": 10}, daemon=True)
    t.start()
    wait_until(lambda: q._blocked_producers == 1)
    old = sys.getswitchinterval()
    sys.setswitchinterval(1.0)
    try:
        q.get(timeout=5)
        q.get(timeout=5)
        depth, put_total = len(q), q.stats().put_total
    finally:
        sys.setswitchinterval(old)
    t.join(timeout=5)
    assert not t.is_alive()
    assert (depth, put_total) == (1, 3)  # the second get waited for item 2


def test_stop_wakes_every_waiter():
    q = BufferedHSQueue(max_depth=1, min_ready=1, num_producers=1, poll_s=10.0)
    q.put(0)
    outcomes = []

    def call(fn):
        try:
            fn()
        except QueueStopped:
            outcomes.append("stopped")

    threads = [threading.Thread(target=call, args=(lambda: q.put(1),))]
    empty = BufferedHSQueue(
        max_depth=1, min_ready=1, num_producers=1, poll_s=10.0, stop_event=q.stop_event
    )
    threads += [threading.Thread(target=call, args=(empty.get,)) for _ in range(3)]
    for t in threads:
        t.start()
    wait_until(lambda: q._blocked_producers == 1)
    q.stop()
    empty.stop()
    for t in threads:
        t.join(timeout=2)
    assert not any(t.is_alive() for t in threads)
    assert outcomes == ["stopped"] * 4


def test_counters_track_traffic_and_waiting():
    q = BufferedHSQueue(max_depth=2, min_ready=2, num_producers=1)
    q.put(1, bucket=0, nbytes=10)
    with pytest.raises(TimeoutError):
        q.get(timeout=0.05)
    q.put(2, bucket=1, nbytes=20)
    assert q.bucket_sizes() == {0: 1, 1: 1}
    q.get()
    s = q.stats()
    assert (s.put_total, s.got_total, s.depth, s.producers_alive) == (2, 1, 1, 1)
    assert s.consumer_starved_s >= 0.04
    assert sum(s.drawn.values()) == 1


@settings(max_examples=15, deadline=None)
@given(
    producers=st.integers(1, 4),
    consumers=st.integers(1, 4),
    items=st.integers(0, 300),
    depth=st.integers(1, 16),
    mix=st.sampled_from(["stratified", "random", "fifo"]),
    seed=st.integers(0, 1000),
)
def test_concurrent_traffic_loses_and_duplicates_nothing(
    producers, consumers, items, depth, mix, seed
):
    ready = max(1, depth // 2)
    q = BufferedHSQueue(
        max_depth=depth,
        min_ready=ready,
        num_producers=producers,
        mix=mix,
        seed=seed,
        bucket_weights={0: 0.3, 1: 0.7},
    )
    got: list[list[int]] = [[] for _ in range(consumers)]
    errors = []

    def produce(p):
        rng = random.Random(seed + p)
        try:
            for i in range(p, items, producers):
                if rng.random() < 0.05:
                    time.sleep(0.0005)  # jitter to shake out interleavings
                q.put(i, bucket=i % 2, timeout=10)
        except Exception as e:  # recorded for the assertion below
            errors.append(e)
        finally:
            q.producer_done()

    def consume(c):
        try:
            while (x := q.get(timeout=10)) is not END:
                got[c].append(x)
        except Exception as e:  # recorded for the assertion below
            errors.append(e)

    threads = [threading.Thread(target=produce, args=(p,)) for p in range(producers)]
    threads += [threading.Thread(target=consume, args=(c,)) for c in range(consumers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads) and not errors
    flat = sorted(x for g in got for x in g)
    assert flat == list(range(items))


def test_stratified_mix_holds_within_every_short_window():
    weights = {0: 0.4, 1: 0.3, 2: 0.2, 3: 0.1}
    q = BufferedHSQueue(
        max_depth=100, min_ready=1, num_producers=1, bucket_weights=weights, bucket_cap=None
    )
    for b in weights:
        for _ in range(25):
            q.put(b, bucket=b)
    draws = []
    for _ in range(200):
        b = q.get()
        draws.append(b)
        q.put(b, bucket=b)
    windows = [Counter(draws[i : i + 10]) for i in range(0, 200, 10)]
    assert max(total_variation(dict(w), weights) for w in windows) <= 0.1


def test_an_empty_bucket_earns_no_credit_and_does_not_burst_later():
    weights = {0: 0.5, 1: 0.5}
    q = BufferedHSQueue(
        max_depth=100, min_ready=1, num_producers=1, bucket_weights=weights, bucket_cap=None
    )
    for _ in range(30):
        q.put(0, bucket=0)
    first = [q.get() for _ in range(20)]  # bucket 1 empty all along
    assert first == [0] * 20
    for _ in range(10):
        q.put(1, bucket=1)
    nxt = [q.get() for _ in range(10)]
    assert 4 <= nxt.count(1) <= 6  # back to the 50/50 mix, not ten 1s in a row


def test_readiness_gate_scales_with_the_byte_bound():
    # 9 of 10 bytes buffered is "ready" even though 3 items < min_ready 5.
    q = BufferedHSQueue(max_depth=10, min_ready=5, num_producers=1, max_bytes=10)
    for i in range(3):
        q.put(i, nbytes=3)
    assert q.get(timeout=0.5) in (0, 1, 2)
    # ... while 1 item of 1 byte is not.
    small = BufferedHSQueue(max_depth=10, min_ready=5, num_producers=1, max_bytes=10)
    small.put("x", nbytes=1)
    with pytest.raises(TimeoutError):
        small.get(timeout=0.05)


def test_stratified_put_caps_a_flooding_bucket_but_admits_the_others():
    q = BufferedHSQueue(max_depth=10, min_ready=1, num_producers=1, bucket_weights={0: 0.5, 1: 0.5})
    for _ in range(8):  # cap = ceil(1.5 * 0.5 * 10)
        q.put("long", bucket=0, timeout=0.05)
    with pytest.raises(TimeoutError):
        q.put("long", bucket=0, timeout=0.05)
    q.put("short", bucket=1, timeout=0.05)
    assert q.get() in ("long", "short")


def test_a_bucket_cap_never_blocks_an_empty_bucket_and_random_mode_has_none():
    q = BufferedHSQueue(
        max_depth=4, min_ready=1, num_producers=1, bucket_weights={0: 0.999, 1: 0.001}
    )
    q.put("rare", bucket=1, timeout=0.05)  # cap is at least 1
    r = BufferedHSQueue(
        max_depth=4, min_ready=1, num_producers=1, mix="random", bucket_weights={0: 0.5, 1: 0.5}
    )
    for _ in range(4):
        r.put("x", bucket=0, timeout=0.05)


def test_stratified_takes_the_oldest_item_of_the_bucket_it_draws():
    q = BufferedHSQueue(max_depth=20, min_ready=1, num_producers=1, bucket_weights={0: 1.0})
    for i in range(10):
        q.put(i, bucket=0)
    assert [q.get() for _ in range(10)] == list(range(10))


def test_no_batch_waits_longer_than_the_age_bound_and_the_mix_holds():
    """Regression (issue 27, item 9): a uniform pick inside a bucket let some batches wait for
    epochs, so a run stopped at --max-steps trained a skewed sample. Producers here deliver
    the mix with noise; every age stays within max_age and the drawn mix within 0.05."""
    weights = {b: w for b, w in enumerate((0.4, 0.25, 0.15, 0.1, 0.06, 0.04))}
    rng = np.random.default_rng(0)
    q = BufferedHSQueue(  # one thread: no admission cap (a put that blocks would hang it)
        max_depth=60, min_ready=20, num_producers=1, bucket_weights=weights, bucket_cap=None
    )
    keys, p = list(weights), np.array(list(weights.values()))
    for _ in range(60):
        q.put(0, bucket=int(rng.choice(keys, p=p)))
    for _ in range(6000):
        q.get()  # items are placeholders; their buckets are what matters
        b = int(rng.choice(keys, p=p))
        q.put(b, bucket=b)
    ages = q.take_ages()
    assert len(ages) == 6000 and max(ages) <= q.max_age == 120
    assert q.take_ages() == []  # handed once
    drawn = {b: float(n) for b, n in q.stats().drawn.items()}
    assert total_variation(drawn, weights) < 0.05


def test_an_overdue_item_is_taken_next_whatever_its_bucket():
    q = BufferedHSQueue(
        max_depth=50, min_ready=1, num_producers=1, bucket_weights={0: 0.99, 1: 0.01}, max_age=5
    )
    q.put("old", bucket=1)
    for _ in range(20):
        q.put("new", bucket=0)
    got = [q.get() for _ in range(7)]
    assert got.index("old") == 5  # waited 5 takes: taken at once, although its bucket is rare
    assert q.take_ages()[5] == 5


# ---------------------------------------------------------------------- plan order
def plan_queue(**kw) -> BufferedHSQueue:
    kw = {"max_depth": 4, "min_ready": 1, "num_producers": 1, "mix": "plan", **kw}
    return BufferedHSQueue(**kw)


def test_plan_order_hands_each_ticket_its_planned_item_whatever_the_arrival_order():
    q = plan_queue(max_depth=8)
    for seq in (3, 1, 0, 2):  # arrival order is not plan order
        q.put(f"item{seq}", seq=seq)
    assert [q.get(ticket=t) for t in (2, 0, 3, 1)] == ["item2", "item0", "item3", "item1"]


def test_plan_order_without_tickets_follows_the_plan_not_the_arrival():
    q = plan_queue(max_depth=8)
    for seq in (2, 0, 1):
        q.put(seq, seq=seq)
    assert [q.get(), q.get(), q.get()] == [0, 1, 2]


def test_plan_window_blocks_later_items_but_always_admits_the_head():
    """The buffer full of later items while the next planned one is in flight: the head is
    admitted (no deadlock); an item beyond the window waits for the head to be taken."""
    q = plan_queue(max_depth=3)
    q.put("b", seq=1)
    q.put("c", seq=2)
    with pytest.raises(TimeoutError):
        q.put("d", seq=3, timeout=0.05)  # beyond the window [0, 3)
    q.put("a", seq=0, timeout=0.05)  # the head: admitted at once
    assert q.get(ticket=0) == "a"
    q.put("d", seq=3, timeout=0.05)  # the window moved on
    assert len(q) == 3


def test_plan_order_admits_one_steps_tickets_past_the_byte_bound():
    """Every position a consumer may hold a ticket for now (`reserve`: one lockstep step's
    items) is admitted past the byte bound, or a step could wait for an item that the bytes
    of later items keep out."""
    q = plan_queue(max_depth=8, max_bytes=10, reserve=2)
    q.put("c", seq=2, nbytes=10)
    q.put("a", seq=0, nbytes=10, timeout=0.05)  # urgent: admitted past the bound
    q.put("b", seq=1, nbytes=10, timeout=0.05)
    with pytest.raises(TimeoutError):
        q.put("d", seq=3, nbytes=10, timeout=0.05)  # not urgent: the bound holds
    assert q.stats().bytes == 30


def test_plan_window_is_at_least_one_steps_tickets():
    q = plan_queue(max_depth=2, reserve=5)
    for seq in (4, 3, 2, 1):
        q.put(seq, seq=seq, timeout=0.05)
    with pytest.raises(TimeoutError):
        q.put(5, seq=5, timeout=0.05)


def test_plan_order_ends_tickets_past_the_stream_once_producers_are_done():
    q = plan_queue(num_producers=2)
    q.put("x", seq=0)
    q.producer_done()
    with pytest.raises(TimeoutError):
        q.get(ticket=1, timeout=0.05)  # one producer is alive: item 1 may still come
    q.producer_done()
    assert q.get(ticket=1, timeout=1) is END
    assert q.get(ticket=0, timeout=1) == "x"  # drained after the end too


def test_plan_order_refuses_an_item_without_its_position_or_put_twice():
    q = plan_queue()
    with pytest.raises(ValueError, match="plan position"):
        q.put("x")
    q.put("x", seq=0)
    q.get(ticket=0)
    with pytest.raises(RuntimeError, match="put twice"):
        q.put("x", seq=0)


def test_plan_order_counts_head_of_line_waits_apart_from_starvation():
    """Waiting for its own item while others are ready is a head-of-line wait; waiting at
    the shut gate is starvation."""
    q = plan_queue(min_ready=1)
    q.put("b", seq=1)
    with pytest.raises(TimeoutError):
        q.get(ticket=0, timeout=0.1)  # the gate is open (item 1 is ready), item 0 is not
    s = q.stats()
    assert s.consumer_hol_s > 0.05 and s.consumer_starved_s == 0.0
    empty = plan_queue(min_ready=1)
    with pytest.raises(TimeoutError):
        empty.get(ticket=0, timeout=0.1)
    s = empty.stats()
    assert s.consumer_starved_s > 0.05 and s.consumer_hol_s == 0.0
