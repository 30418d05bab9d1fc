"""What reading ``lineage.jsonl`` costs a checkpoint save, against the run's length, before and after the index.

A save needs two things of the lineage: the highest policy version it names (the checkpoint's version high water)
and its text up to the step (stored with the checkpoint). Before the index, the snapshot parsed the whole file for
the first and read it whole for the second, both on the trainer's event loop, the one that renews its lease. Now
the loop asks the ``LineageIndex``, which reads only the lines appended since its last read (one step's, between
two saves), and the text is copied on the snapshot's worker thread.

For each length it writes a lineage of that many steps (``--groups`` groups each, group ids as the trainer writes
them), then times, in the same run:

- before: ``Lineage.records()`` and the highest version over them, and the file read whole: all on the loop;
- after, on the loop: one more step appended, then ``catch_up`` and the highest version, as the next save does;
- after, off the loop: ``text(end)``, the copy stored with the checkpoint.

    python -m bench.lineage_save [--steps 100 1000 20000 --groups 16 --repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from services.trainer.checkpointing.lineage import Lineage, RestartRecord, StepRecord


def median_s(call: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def step_record(step: int, groups: int) -> StepRecord:
    ids = [(f"e0-i{step * groups + k}", step - 1) for k in range(groups)]
    return StepRecord(step=step, policy_version=step, groups=ids, dropped_stale=[], experience_seq=step * groups)


def write_lineage(path: Path, steps: int, groups: int) -> None:
    """``steps`` step records, written at once (the trainer fsyncs each; the content is the same)."""
    path.write_bytes(b"".join(step_record(step, groups).line() + b"\n" for step in range(1, steps + 1)))


def before(lineage: Lineage) -> None:
    records = lineage.records()
    max(r.policy_version for r in records if isinstance(r, StepRecord | RestartRecord))
    lineage.path.read_text()


def next_save(lineage: Lineage, step: int) -> float:
    """Append step ``step``, then time what the next save asks of the lineage on the loop."""
    lineage.record_step(step, step, [(f"e1-i{step}", step - 1)], [], step)
    started = time.perf_counter()
    lineage.catch_up()
    lineage.max_version()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, nargs="+", default=[100, 1000, 20000])
    parser.add_argument("--groups", type=int, default=16, help="groups applied per step")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print("| steps | lineage.jsonl | before: on the loop | after: on the loop | after: off the loop |")
    print("| --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as folder:
        for steps in args.steps:
            path = Path(folder) / f"lineage-{steps}.jsonl"
            write_lineage(path, steps, args.groups)
            lineage = Lineage(path)
            before_s = median_s(lambda lineage=lineage: before(lineage), args.repeats)
            lineage.catch_up()  # the trainer's start reads it whole once, off the loop
            after_s = statistics.median(next_save(lineage, steps + k) for k in range(1, args.repeats + 1))
            end = lineage.catch_up().end
            off_loop_s = median_s(lambda lineage=lineage, end=end: lineage.text(end), args.repeats)
            size = path.stat().st_size / 2**20
            print(
                f"| {steps:,} | {size:.2f} MiB | {before_s * 1000:.1f} ms | {after_s * 1000:.2f} ms "
                f"| {off_loop_s * 1000:.1f} ms |",
                flush=True,
            )


if __name__ == "__main__":
    main()
