"""Operator commands run between steps, each once, and never after its caller has gone."""

import asyncio
from types import SimpleNamespace

from services.trainer.service import Trainer


def test_a_command_whose_caller_gave_up_is_skipped_and_the_rest_run_in_order():
    async def scenario():
        loop = SimpleNamespace(commands=asyncio.Queue(), wakeup=asyncio.Event())  # the state run_commands uses
        ran = []
        futures = []
        for name in ("pause", "rollback", "resume"):
            futures.append(asyncio.get_running_loop().create_future())
            await loop.commands.put((lambda name=name: ran.append(name), futures[-1]))
        futures[1].cancel()  # the CLI's deadline passed while the rollback waited for the step to end
        await Trainer.run_commands(loop)
        assert ran == ["pause", "resume"]
        assert futures[0].done() and futures[2].done() and loop.commands.empty()

    asyncio.run(scenario())
