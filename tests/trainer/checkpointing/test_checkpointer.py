"""The checkpointer's choices for a save: which saves keep the optimizer state, and the dtype of the weights."""

from __future__ import annotations

import pytest
import torch

from services.trainer.checkpointing.checkpointer import holds_optimizer, in_saved_dtype

pytestmark = pytest.mark.unit


def test_optimizer_state_goes_into_every_kth_periodic_save_counted_by_step():
    kept = [step for step in range(5, 65, 5) if holds_optimizer(step, save_every=5, optimizer_every=3, final=False)]
    assert kept == [15, 30, 45, 60]


def test_a_save_at_a_stop_at_the_end_or_on_request_always_keeps_the_optimizer_state():
    assert holds_optimizer(7, save_every=5, optimizer_every=3, final=True)
    assert holds_optimizer(5, save_every=0, optimizer_every=3, final=False)  # only the end saves: always whole
    assert all(holds_optimizer(step, save_every=5, optimizer_every=1, final=False) for step in range(5, 30, 5))


def test_serving_dtype_narrows_every_floating_tensor_and_names_the_dtype_while_integers_stay():
    model = {"w": torch.randn(3, 3), "b": torch.randn(3), "ids": torch.arange(3)}
    saved, dtype = in_saved_dtype(model, "serving", "bfloat16")
    assert dtype == "bfloat16"
    assert {name: t.dtype for name, t in saved.items()} == {
        "w": torch.bfloat16,
        "b": torch.bfloat16,
        "ids": torch.int64,
    }
    assert torch.equal(saved["w"], model["w"].to(torch.bfloat16))


def test_master_weights_and_weights_already_in_the_serving_dtype_are_saved_as_they_are_and_resume_exactly():
    model = {"w": torch.randn(3, 3)}
    assert in_saved_dtype(model, "master", "bfloat16") == (model, "")
    assert in_saved_dtype(model, "serving", "float32") == (model, "")  # a float32 model: nothing to narrow
