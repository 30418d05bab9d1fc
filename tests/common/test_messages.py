import msgpack
import numpy as np
import pytest

from services.common.transport.messages import (
    Completion,
    DecodeError,
    Episode,
    ExperienceGroup,
    Prompt,
    RolloutGroup,
    ScoredGroup,
    advance,
    decode,
    dedupe_id,
    encode,
    encode_tensor,
)

pytestmark = pytest.mark.unit


def rollout_group(logprobs=(-0.5, -0.25)) -> RolloutGroup:
    prompt = Prompt(group_id="e0-i1", prompt_id="add-1", prompt="1+1=", answer="2")
    completion = Completion(
        text="2",
        token_ids=np.array([7, 1], dtype=np.int32),
        logprobs=np.array(logprobs, dtype=np.float32),
        finish_reason="stop",
    )
    return advance(
        prompt,
        RolloutGroup,
        prompt_ids=np.array([3, 4, 3, 5], dtype=np.int32),
        policy_version=3,
        completions=[completion],
    )


def test_round_trip_keeps_tensors_exact():
    group = advance(rollout_group(), ScoredGroup, rewards=np.array([1.0], dtype=np.float32))
    back = decode(encode(group), ScoredGroup)
    assert back.policy_version == 3 and back.answer == "2"
    assert back.completions[0].logprobs.dtype == np.float32
    np.testing.assert_array_equal(back.completions[0].logprobs, [-0.5, -0.25])
    np.testing.assert_array_equal(back.prompt_ids, [3, 4, 3, 5])


def test_tensors_travel_as_little_endian_raw_bytes():
    raw = msgpack.unpackb(encode(rollout_group()))
    tensor = raw["completions"][0]["logprobs"]
    assert tensor == {"dtype": "float32", "shape": [2], "data": np.array([-0.5, -0.25], dtype="<f4").tobytes()}
    assert raw["v"] == 1


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"\xc1garbage", "not msgpack"),
        (msgpack.packb([1, 2]), "must be a map"),
        (msgpack.packb({"v": 99, "kind": "rollout"}), "schema version 99"),
        (encode(Prompt(group_id="g", prompt_id="p", prompt="1+1=")), "prompt_ids"),
    ],
)
def test_bad_payloads_raise_with_reason(payload, reason):
    with pytest.raises(DecodeError, match=reason):
        decode(payload, RolloutGroup)


def test_nan_and_misaligned_values_are_rejected():
    with pytest.raises(DecodeError, match="NaN"):
        decode(encode(rollout_group()).replace(np.float32(-0.5).tobytes(), np.float32("nan").tobytes()), RolloutGroup)
    scored = msgpack.unpackb(encode(advance(rollout_group(), ScoredGroup, rewards=np.array([1.0], dtype=np.float32))))
    scored["rewards"]["data"] = np.array([np.inf], dtype="<f4").tobytes()
    with pytest.raises(DecodeError, match="rewards contain NaN"):
        decode(msgpack.packb(scored), ScoredGroup)
    experience = msgpack.unpackb(
        encode(advance(rollout_group(), ScoredGroup, rewards=np.array([0.0], dtype=np.float32)))
    )
    experience |= {"kind": "experience", "ref_logprobs": [{"dtype": "float32", "shape": [3], "data": bytes(12)}]}
    with pytest.raises(DecodeError, match="ref_logprobs shape"):
        decode(msgpack.packb(experience), ExperienceGroup)


def test_dedupe_ids_tell_incarnations_and_stages_apart_and_keep_the_old_form_without_one():
    prompt = Prompt(group_id="e0-i3", prompt_id="p3", prompt="1+1=")
    assert dedupe_id(prompt, "prompt") == "e0-i3.prompt"  # as before incarnations: repeats still match
    fed = prompt.model_copy(update={"incarnation": "inc-b"})
    assert dedupe_id(fed, "prompt") == "e0-i3.inc-b.prompt"
    assert dedupe_id(fed, "reward") == "e0-i3.inc-b.reward"


@pytest.mark.parametrize(
    ("loss_mask", "reason"),
    [
        (np.array([1, 0, 1], np.int32), r"loss_mask shape \(3,\) must match token_ids \(2,\)"),
        (np.array([1, 2], np.int32), "loss_mask must be 0/1 with at least one 1"),
        (np.array([0, 0], np.int32), "loss_mask must be 0/1 with at least one 1"),
    ],
)
def test_a_trainer_side_loss_mask_that_cannot_be_trained_on_is_refused_with_the_reason(loss_mask, reason):
    raw = msgpack.unpackb(encode(rollout_group()))
    raw["completions"][0]["loss_mask"] = encode_tensor(loss_mask)
    with pytest.raises(DecodeError, match=reason):
        decode(msgpack.packb(raw), RolloutGroup)


def test_a_loss_mask_and_an_episode_survive_the_wire():
    group = rollout_group()
    completion = group.completions[0].model_copy(
        update={
            "loss_mask": np.array([1, 0], np.int32),
            "episode": Episode(turns=2, tool_calls=1, tool_errors=0, env_seconds=0.5, outcome="done"),
        }
    )
    back = decode(encode(group.model_copy(update={"completions": [completion]})), RolloutGroup).completions[0]
    assert back.loss_mask.dtype == np.int32 and back.loss_mask.tolist() == [1, 0]
    assert back.episode == completion.episode
    assert decode(encode(group), RolloutGroup).completions[0].loss_mask is None


def versioned(group: RolloutGroup, versions) -> RolloutGroup:
    """``group`` with per-token versions on its completion, validated as a stage would build it."""
    completion = group.completions[0].model_copy(update={"token_versions": np.asarray(versions, np.int32)})
    return RolloutGroup.model_validate(group.model_dump() | {"completions": [completion]})


def test_a_group_without_per_token_versions_is_written_exactly_as_schema_1_wrote_it():
    raw = msgpack.unpackb(encode(advance(rollout_group(), ScoredGroup, rewards=np.array([1.0], np.float32))))
    assert raw["v"] == 1
    # A build that reads only schema 1 refuses a key it does not know, even a null one.
    assert set(raw["completions"][0]) == {"text", "token_ids", "logprobs", "finish_reason", "loss_mask", "episode"}


def test_per_token_versions_travel_as_schema_2_and_come_back_exact():
    group = versioned(rollout_group(), [2, 3])
    raw = msgpack.unpackb(encode(group))
    assert raw["v"] == 2
    back = decode(encode(advance(group, ScoredGroup, rewards=np.array([1.0], np.float32))), ScoredGroup)
    assert back.completions[0].token_versions.tolist() == [2, 3]
    assert back.oldest_version() == 2 and back.versions_used() == {2, 3}


def test_a_schema_1_message_is_read_and_every_token_takes_the_group_s_version():
    raw = msgpack.unpackb(encode(rollout_group()))
    raw["completions"][0].pop("loss_mask")  # schema 1 as the first builds wrote it: optional keys may be absent
    group = decode(msgpack.packb(raw | {"v": 1}), RolloutGroup)
    assert group.completions[0].token_versions is None
    assert group.completions[0].versions(group.policy_version).tolist() == [3, 3]
    assert group.oldest_version() == 3 and group.versions_used() == {3}


@pytest.mark.parametrize(
    ("versions", "reason"),
    [
        (np.array([3, 4], np.int32), "token_versions reach 4, past the group's policy_version 3"),
        (np.array([3], np.int32), r"token_versions shape \(1,\) must match token_ids \(2,\)"),
        (np.array([-1, 3], np.int32), "token_versions must be non-negative integers"),
        (np.array([2.0, 3.0], np.float32), "token_versions must be non-negative integers"),
    ],
)
def test_per_token_versions_that_cannot_be_right_are_refused_with_the_reason(versions, reason):
    raw = msgpack.unpackb(encode(rollout_group()))
    raw["completions"][0]["token_versions"] = encode_tensor(versions)
    with pytest.raises(DecodeError, match=reason):
        decode(msgpack.packb(raw | {"v": 2}), RolloutGroup)


def test_the_oldest_version_counts_only_the_tokens_the_model_sampled():
    group = versioned(rollout_group(), [1, 3])
    observed = group.completions[0].model_copy(update={"loss_mask": np.array([0, 1], np.int32)})
    group = RolloutGroup.model_validate(group.model_dump() | {"completions": [observed]})
    assert group.oldest_version() == 3 and group.versions_used() == {3}
