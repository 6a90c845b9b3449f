"""bench.kv_fanout --shapes on a few batches: every shape decodes and applies cleanly (no unknown parent,
nothing malformed), and the subscriber rows receive every batch from another process, each alone and
through a KVIntake, from one pod and from several, without a gap."""

from __future__ import annotations

from bench import kv_fanout


def test_every_shape_applies_cleanly() -> None:
    rows = kv_fanout.shapes_us(12, rounds=1)  # (it asserts no unknown parent and nothing malformed)
    assert [name for name, _, _ in rows] == [name for name, *_ in kv_fanout.SHAPES]
    assert all(med > 0 and best > 0 for _, med, best in rows)


def test_subscribers_receive_every_batch_alone_and_through_an_intake() -> None:
    for pods, window in ((1, None), (3, 0.005)):
        # (it waits for every batch of every pod, and asserts no gap and no unknown parent)
        assert kv_fanout.subscriber_us(30, rate=300.0, pods=pods, window_s=window) > 0
