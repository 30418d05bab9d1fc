"""The learner's ``perf/mfu`` step key: absent on a CPU, and the step's model FLOPs over its time at the peak."""

import pytest

from services.common.model.datasets import load_jsonl
from services.trainer.learning.batch import Batch
from services.trainer.learning.learner import Learner
from tests.support.runs import run_config
from tests.support.trainer import experience

pytestmark = pytest.mark.integration


def test_a_cpu_step_has_no_mfu_and_a_step_on_a_device_of_known_peak_reports_its_flops_over_the_peak(
    tiny_model, tmp_path
):
    _, data_dir = tiny_model
    cfg = run_config(tmp_path, tiny_model, train={"epochs": 2})
    learner = Learner(cfg)
    groups = experience(cfg, load_jsonl(data_dir / "train.jsonl")[:4])
    assert learner.peak_flops is None  # a CPU has no entry in the peak table
    assert "perf/mfu" not in learner.step(groups, 0)
    learner.peak_flops = 1e9  # as a GPU of that peak would have it: the rest is the same arithmetic
    metrics = learner.step(groups, 1)
    lengths = Batch.of(groups).lengths.tolist()  # prompt + response of every row, both epochs
    expected = learner.arithmetic.step_flops(lengths, passes=2) / (metrics["step_time_s"] * 1e9)
    assert metrics["perf/mfu"] == pytest.approx(expected, rel=1e-3)
    assert learner.arithmetic.parameters == sum(p.numel() for p in learner.model.parameters())
