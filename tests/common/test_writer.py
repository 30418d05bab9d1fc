"""The bounded background writer: ``put`` never waits on the sink, a full queue drops and counts, nothing queued is
lost at close, and rows keep their order."""

from __future__ import annotations

import logging
import threading

import pytest

from services.common.observe.writer import BackgroundWriter, close_all

pytestmark = pytest.mark.unit

WAIT_S = 10  # bounds a wait on the writer's thread, so a broken writer fails the test instead of hanging it


class HeldSink:
    """A sink whose first call blocks until ``release``; it keeps every batch it is given."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.batches: list[list[int]] = []

    def __call__(self, rows: list[int]) -> None:
        self.entered.set()
        assert self.release.wait(WAIT_S)
        self.batches.append(rows)


def test_put_returns_while_the_sink_is_still_blocked_on_the_row_before():
    sink = HeldSink()
    writer = BackgroundWriter("test", sink)
    assert writer.put(1)
    assert sink.entered.wait(WAIT_S)
    assert writer.put(2)  # the sink holds row 1: a writer that wrote in the caller's thread would wait here
    assert sink.batches == []
    sink.release.set()
    writer.close()
    assert sink.batches == [[1], [2]]


def test_a_full_queue_drops_and_counts_the_rows_it_cannot_take_and_keeps_the_ones_it_took():
    sink = HeldSink()
    writer = BackgroundWriter("test", sink, capacity=2)
    writer.put(1)
    assert sink.entered.wait(WAIT_S)  # row 1 is in the sink, out of the queue
    assert [writer.put(row) for row in (2, 3, 4, 5)] == [True, True, False, False]
    assert writer.dropped == 2
    sink.release.set()
    writer.close()
    assert sink.batches == [[1], [2, 3]]  # in order, the backlog in one batch


def test_close_all_writes_every_queued_row_of_every_open_writer_before_it_returns():
    sinks = [HeldSink(), HeldSink()]
    writers = [BackgroundWriter(f"test-{n}", sink) for n, sink in enumerate(sinks)]
    for writer, sink in zip(writers, sinks, strict=True):
        writer.put(1)
        assert sink.entered.wait(WAIT_S)
        writer.put(2)  # queued behind the row the sink holds
    for sink in sinks:
        sink.release.set()
    close_all()
    assert [sink.batches for sink in sinks] == [[[1], [2]], [[1], [2]]]
    assert [writer.put(3) for writer in writers] == [False, False]  # closed: later rows are dropped, counted


def test_a_sink_that_raises_is_logged_once_and_later_rows_still_reach_it(caplog):
    written: list[int] = []

    def flaky(rows: list[int]) -> None:
        if rows[0] < 3:
            raise OSError("no space left on device")
        written.extend(rows)

    writer = BackgroundWriter("test", flaky)
    with caplog.at_level(logging.ERROR, logger="services.common.observe.writer"):
        for row in (1, 2):
            writer.put(row)
            writer.flush()
        writer.put(3)
        writer.close()
    assert written == [3]
    assert [record.getMessage() for record in caplog.records] == ["writer_failed"]
