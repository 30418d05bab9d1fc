"""Offering each new policy version to the rollouts without holding the training loop.

A version is made in two parts: the copy (``Learner.snapshot``: the weights into reused host memory, on a worker
thread; from a GPU the thread only queues the copies on a stream of their own, see ``HostStaging``), then the offer
(``WeightSyncServer.publish``: wait for the copy to land, check every value is finite, serve it). ``offer`` starts
both in the background and returns at once, so training goes on while they run.

The learner must not change, nor run a collective, under the copy: whatever does either (the next step, a save's
snapshot, an evaluation, a live reconfigure, an adoption) first awaits ``released``, which returns once the newest
copy has been taken (on the CPU the copy itself; from a GPU the queueing, since the device's next kernels wait for
the copies). That wait is the whole of what publishing costs the loop (``time/publish_s``); usually the copy was
made while the trainer waited for experience. So a version holds the weights of the step that made it, never a
later step's.

Versions are served in the order they were offered, and one overtaken while it waited for the previous to be served
is dropped (its memory freed): a slow offer never queues more than one version behind it, and the versions served
only grow. Weights refused as not finite go to ``on_refused``; any other failure is raised at the loop's next wait
on the publisher (``released`` or ``drain``), as it was raised from the step before publishing moved off the loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Protocol

from services.common.observe.logs import Stopwatch
from services.common.transport.weightsync.server import WeightSyncServer
from services.common.transport.weightsync.snapshot import NonFiniteWeights, Snapshot

Refused = Callable[[NonFiniteWeights, int, int], Awaitable[None]]  # (why, version, step)


class Snapshots(Protocol):
    """What a version is copied from: the learner (``Learner.snapshot``)."""

    def snapshot(self, version: int, step: int) -> Snapshot: ...


class Publisher:
    """Attributes: ``newest`` (the newest version offered), ``served`` (the newest version served: a version
    refused, dropped or failed is not), ``offer_s`` (the background seconds, from offer to served, of the newest
    version served; None before the first)."""

    def __init__(
        self,
        learner: Snapshots,
        weights: WeightSyncServer,
        on_refused: Refused,
        before_serving: Callable[[int], Awaitable[None]] | None = None,
    ):
        """``before_serving(version)``: awaited before a version is served (the run's served-version mark)."""
        self.learner = learner
        self.weights = weights
        self.on_refused = on_refused
        self.before_serving = before_serving
        self.newest = 0
        self.served = 0
        self.offer_s: float | None = None
        self._copied: asyncio.Event | None = None  # set once the newest version's copy was taken
        self._offering: asyncio.Task | None = None  # the newest version's offer
        self._failed: Exception | None = None

    def offer(self, version: int, step: int) -> None:
        """Copy and serve the learner's weights as ``version`` (made at ``step``) in the background."""
        self.newest = version
        self._copied = asyncio.Event()
        self._offering = asyncio.create_task(self._offer(version, step, self._copied, self._offering))

    async def publish(self, version: int, step: int) -> None:
        """Offer ``version`` and wait until it is served (or refused)."""
        self.offer(version, step)
        await self.drain()

    async def released(self) -> None:
        """Wait until the newest version's copy was taken: the learner may change from here."""
        if self._copied is not None:
            await self._copied.wait()
        self._raise_failure()

    async def drain(self) -> None:
        """Wait until every version offered is served, dropped or refused."""
        if self._offering is not None:
            await asyncio.wait([self._offering])
        self._raise_failure()

    def _raise_failure(self) -> None:
        failed, self._failed = self._failed, None
        if failed is not None:
            raise failed

    async def _offer(self, version: int, step: int, copied: asyncio.Event, previous: asyncio.Task | None) -> None:
        took = Stopwatch()
        try:
            try:
                snapshot = await asyncio.to_thread(self.learner.snapshot, version, step)
            finally:
                copied.set()
            if previous is not None:
                await asyncio.wait([previous])  # served in order; what became of it is its own to report
            if version < self.newest:
                snapshot.release()  # overtaken: the newer version is served instead
                return
            if self.before_serving is not None:
                await self.before_serving(version)
            try:
                await self.weights.publish(snapshot)
            except NonFiniteWeights as error:
                await self.on_refused(error, version, step)
                return
            self.served = version
            self.offer_s = took()
        except Exception as error:  # nobody awaits this task: raised at the loop's next wait on the publisher
            self._failed = error
