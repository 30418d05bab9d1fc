"""The run's last step is stored once, after the final evaluation, and holds it: deterministic, whatever the timing
of the periodic uploads (the tracker test counts its saves exactly).

A real trainer loop (tiny learner, real nats-server, file:// checkpoint store) fed EXPERIENCE by this test in place
of the stages.
"""

from __future__ import annotations

import asyncio

import pytest

from services.common.observe import metrics as m
from services.common.observe.metrics import check_row
from services.common.observe.records import read_metrics
from services.common.transport.streams import EXPERIENCE
from tests.support.messages import experience_group
from tests.support.runs import run_config
from tests.support.trainer import start_trainer

pytestmark = pytest.mark.integration


async def _stand_in_for_the_stages(trainer, done: asyncio.Task) -> None:
    """Every prompt the trainer feeds comes back as one experience group made by the policy it serves."""
    published: set[str] = set()
    while not done.done():
        for group_id in sorted(set(trainer.ledger.in_flight) - published):
            group = experience_group(
                group_id, [1.0], policy_version=trainer.progress.version, incarnation=trainer.progress.incarnation
            )
            await trainer.bus.publish(EXPERIENCE, group, msg_id=f"{group_id}.experience")
            published.add(group_id)
        await asyncio.sleep(0.05)


@pytest.mark.parametrize(("total_steps", "saved"), [(2, [2]), (3, [2, 3])])
def test_the_last_step_is_saved_once_with_the_final_evaluation(tiny_model, tmp_path, nats_url, total_steps, saved):
    cfg = run_config(
        tmp_path,
        tiny_model,
        nats={"url": nats_url},
        data={"eval_size": 4, "shuffle": False},
        train={"total_steps": total_steps, "batch_size": 2},
        checkpoint={"save_every_steps": 2, "keep_last": 5},
    )

    async def scenario() -> None:
        trainer = await start_trainer(cfg)
        # The baseline and the final evaluation told apart, which the tiny model's accuracies need not be.
        accuracies = iter([0.25, 0.75])
        trainer.learner.evaluate = lambda rows, max_new_tokens: next(accuracies)
        try:
            run = asyncio.create_task(trainer.run(asyncio.Event()))
            stages = asyncio.create_task(_stand_in_for_the_stages(trainer, run))
            await asyncio.wait_for(run, timeout=300)
            await stages
        finally:
            await trainer.bus.close()
        assert trainer.progress.step == trainer.progress.saved_step == total_steps
        assert trainer.checkpoints.steps() == saved
        assert trainer.checkpoints.load(total_steps).state.eval_accuracy == 0.75
        if total_steps > 2:
            assert trainer.checkpoints.load(2).state.eval_accuracy == 0.25  # saved before the final evaluation

    asyncio.run(scenario())
    rows = read_metrics(cfg.metrics_file)
    for row in rows:  # the trainer's step, eval and checkpoint rows carry only keys the metrics contract declares
        check_row(row.raw)
    evaluated = [(row.step, row[m.EVAL_ACCURACY]) for row in rows if row.is_eval]
    assert evaluated == [(0, 0.25), (total_steps, 0.75)]
    # Each stored step uploaded exactly once: the periodic save skipped the last step, which the run's end saved.
    assert len([row for row in rows if row.get(m.CHECKPOINT_SAVED)]) == len(saved)
