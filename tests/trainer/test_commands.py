"""Operator commands run between steps, each once, and never after its caller has gone; holds survive restarts."""

import asyncio

import pytest

from services.common.observe.events import Event, EventLog, Journal
from services.common.observe.records import read_events
from services.common.transport.live_config import Hold, HoldSource
from services.trainer.control import Control, RunState
from services.trainer.progress import Progress
from tests.support.trainer import Holds

pytestmark = pytest.mark.unit


def test_a_command_whose_caller_gave_up_is_skipped_and_the_rest_run_in_order(tmp_path):
    async def scenario():
        control = Control(Holds(), Journal(EventLog(tmp_path / "events.jsonl")), Progress())
        ran = []
        futures = []
        for name in ("pause", "rollback", "resume"):
            futures.append(asyncio.get_running_loop().create_future())
            await control.commands.put((lambda name=name: ran.append(name), futures[-1]))
        futures[1].cancel()  # the CLI's deadline passed while the rollback waited for the step to end
        await control.run_commands()
        assert ran == ["pause", "resume"]
        assert futures[0].done() and futures[2].done() and control.commands.empty()

    asyncio.run(scenario())


def test_a_call_returns_the_commands_result_or_raises_its_error_once_the_loop_runs_it(tmp_path):
    async def scenario():
        control = Control(Holds(), Journal(EventLog(tmp_path / "events.jsonl")), Progress())

        async def failing() -> None:
            raise LookupError("no such step")

        answered = asyncio.ensure_future(control.call(lambda: 42))
        refused = asyncio.ensure_future(control.call(failing))
        await asyncio.sleep(0)
        assert control.wakeup.is_set() and not answered.done()  # nothing runs until the loop gets to it
        await control.run_commands()
        assert await answered == 42
        assert isinstance(refused.exception(), LookupError)
        assert not control.wakeup.is_set()

    asyncio.run(scenario())


def test_a_pause_is_stored_and_holds_a_restarted_trainer_until_an_operator_resumes(tmp_path):
    async def scenario():
        holds, events = Holds(), Journal(EventLog(tmp_path / "events.jsonl"))
        first = Control(holds, events, Progress(step=3))
        resumed_hooks = []
        first.on_unpause.append(lambda: resumed_hooks.append("clocks"))
        await first.pause("operator looks at KL")
        stored = {"paused": True, "reason": "operator looks at KL", "by": "operator"}
        assert (first.state, holds.stored) == (RunState.PAUSED, stored)

        restarted = Control(holds, events, Progress(step=3))
        await restarted.restore_hold()
        assert restarted.state == RunState.PAUSED
        assert restarted.paused_reason == "operator looks at KL (still paused after a restart)"
        await first.unpause()
        assert (first.state, holds.stored["paused"], resumed_hooks) == (RunState.RUNNING, False, ["clocks"])

        await first.request_stop("done for today")
        assert first.state == RunState.STOPPING
        assert holds.stored == {"paused": True, "reason": "stopped: done for today", "by": "operator"}
        events = read_events(tmp_path / "events.jsonl")
        assert [event.kind for event in events] == [Event.PAUSE, Event.UNPAUSE, Event.STOP]

    asyncio.run(scenario())


def test_a_hold_an_alert_set_says_so_and_stays_the_alerts_through_a_restart_and_a_stop(tmp_path):
    """``rlpipe run --resume`` leaves a hold whose source is an alert (``Hold.outlives_resume``): the source must
    survive what may happen to the hold before that, a trainer restart and an operator's stop."""

    async def scenario():
        holds, events = Holds(), Journal(EventLog(tmp_path / "events.jsonl"))
        first = Control(holds, events, Progress(step=3))
        await first.pause("alert kl_high: [critical] kl_high at step 3", by=HoldSource.ALERT)
        assert Hold.of_record(holds.stored) == Hold(
            True, "alert kl_high: [critical] kl_high at step 3", HoldSource.ALERT
        )
        assert Hold.of_record(holds.stored).outlives_resume

        restarted = Control(holds, events, Progress(step=3))
        await restarted.restore_hold()
        assert (restarted.state, restarted.held_by) == (RunState.PAUSED, HoldSource.ALERT)
        await restarted.request_stop("stopped by operator")
        stopped = Hold.of_record(holds.stored)
        assert stopped.by == HoldSource.ALERT and stopped.outlives_resume
        assert stopped.reason.startswith("stopped: stopped by operator, while held: alert kl_high: [critical]")

        # An operator's pause, a start held with --paused: --resume clears them.
        operator = Control(Holds(), events, Progress(step=3))
        await operator.pause("looking")
        await operator.request_stop("done")
        assert not Hold.of_record(operator.holds.stored).outlives_resume
        assert not Hold(True, "started with --paused", HoldSource.START).outlives_resume
        # A record from before holds named their source reads as none, and --resume clears it as it did.
        assert Hold.of_record({"paused": True, "reason": "alert x: y"}) == Hold(True, "alert x: y", None)

    asyncio.run(scenario())
