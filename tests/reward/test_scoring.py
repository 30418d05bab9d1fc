"""A group's reward is the weighted sum of its parts, and each part's own scores travel with it."""

import asyncio

import numpy as np
import pytest

from services.common.config import (
    ConfigError,
    OverlongPenaltyConfig,
    RewardConfig,
    is_live,
    load_config,
    refuse_unsafe_live_change,
)
from services.common.transport.bus import Bus
from services.common.transport.messages import (
    Completion,
    Episode,
    ExperienceGroup,
    RolloutGroup,
    ScoredGroup,
    advance,
    decode,
    encode,
    reward_part_means,
)
from services.common.transport.stage import Stage
from services.common.transport.streams import DEAD, ROLLOUTS, SCORED, stream_name
from services.reward.sandbox import RuleSandbox
from services.reward.service import RewardOutOfBounds, RewardSources, overlong_scores, score_groups
from tests.support.bus import stream_messages, until_messages
from tests.support.messages import answered
from tests.support.runs import QUICK_REDELIVERY, config_file, run_config
from tests.support.servers import create_run_state

pytestmark = pytest.mark.integration


@pytest.fixture
def rules():
    sandbox = RuleSandbox(timeout_s=5.0)
    yield RewardSources(rules=sandbox)
    sandbox.close()


def test_rewards_are_the_weighted_sum_of_the_parts_kept_per_completion(rules):
    reward = RewardConfig(functions={"exact_match": 1.0, "format": 0.5, "examples.reward_plugin:brevity": 0.25})
    scored = asyncio.run(
        score_groups([answered("a", "2", ["2", "x 3 4"]), answered("b", "22", ["22"])], reward, rules, 7)
    )
    first, second = scored
    assert first.reward_parts["exact_match"].tolist() == [1.0, 0.0]
    assert first.reward_parts["format"].tolist() == [1.0, 0.0]
    assert first.reward_parts["examples.reward_plugin:brevity"].tolist() == pytest.approx([1.0, 0.0])
    assert first.rewards.tolist() == pytest.approx([1.75, 0.0])
    assert second.rewards.tolist() == pytest.approx([1.75]) and second.config_version == 7
    assert reward_part_means(scored) == pytest.approx(
        {
            "reward/exact_match/mean": 2 / 3,
            "reward/format/mean": 2 / 3,
            "reward/examples.reward_plugin:brevity/mean": 2 / 3,
        }
    )


def test_reward_parts_survive_the_wire_to_the_trainer(rules):
    (scored,) = asyncio.run(score_groups([answered("a", "2", ["2", "3"])], RewardConfig(), rules))
    experience = advance(
        decode(encode(scored), ScoredGroup), ExperienceGroup, ref_logprobs=[np.array([-1.0], np.float32)] * 2
    )
    assert decode(encode(experience), ExperienceGroup).reward_parts["exact_match"].tolist() == [1.0, 0.0]


@pytest.mark.unit
def test_a_part_of_the_wrong_length_or_not_finite_is_refused():
    scored = {"rewards": np.zeros(1, np.float32)}
    base = answered("a", "2", ["2"]).model_dump() | scored | {"kind": "scored"}
    with pytest.raises(ValueError, match=r"model shape \(2,\) must be \(1,\)"):
        ScoredGroup.model_validate(base | {"reward_parts": {"model": np.zeros(2, np.float32)}})
    with pytest.raises(ValueError, match="http contain NaN"):
        ScoredGroup.model_validate(base | {"reward_parts": {"http": np.array([np.nan], np.float32)}})


def test_a_plugin_that_cannot_be_imported_stops_the_start_naming_the_entry(tiny_model, tmp_path):
    model_dir, data_dir = tiny_model
    settings = {"model": {"path": str(model_dir)}, "data": {"train_path": str(data_dir / "train.jsonl")}}
    with pytest.raises(ConfigError, match=r"reward.functions: 'examples.nope:score': module 'examples.nope' cannot"):
        load_config(None, **settings, reward={"functions": {"examples.nope:score": 1.0}})
    with pytest.raises(ConfigError, match=r"'examples.reward_plugin:nothing': module .* has no function 'nothing'"):
        load_config(None, **settings, reward={"functions": {"examples.reward_plugin:nothing": 1.0}})
    assert load_config(None, **settings, reward={"functions": {"examples.reward_plugin:brevity": 1.0}})


def test_http_headers_come_from_the_environment_the_config_names(tiny_model, monkeypatch):
    model_dir, data_dir = tiny_model
    settings = {"model": {"path": str(model_dir)}, "data": {"train_path": str(data_dir / "train.jsonl")}}
    http = {"url": "http://127.0.0.1:1/score", "headers_from_env": {"Authorization": "TEST_REWARD_TOKEN"}}
    with pytest.raises(ConfigError, match=r"reward.http: .*not set: \['TEST_REWARD_TOKEN'\]"):
        load_config(None, **settings, reward={"http": http})
    monkeypatch.setenv("TEST_REWARD_TOKEN", "Bearer s3cret")
    cfg = load_config(None, **settings, reward={"http": http})
    assert cfg.reward.http.headers == {"Authorization": "Bearer s3cret"}
    assert "s3cret" not in cfg.model_dump_json()


def minimal_settings(tmp_path) -> dict:
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "train.jsonl").write_text("")
    return {"model": {"path": str(tmp_path / "model")}, "data": {"train_path": str(tmp_path / "train.jsonl")}}


def test_a_token_file_must_exist_at_start_and_is_the_one_source_of_the_authorization_header(tmp_path):
    settings = minimal_settings(tmp_path)
    http = {"url": "http://127.0.0.1:1/score", "token_file": str(tmp_path / "token")}
    with pytest.raises(ConfigError, match=r"reward.http.token_file: '.*/token' cannot be read \(No such file"):
        load_config(None, **settings, reward={"http": http})
    (tmp_path / "token").write_text("s3cret")
    both = http | {"headers_from_env": {"authorization": "HOME"}}
    with pytest.raises(ConfigError, match=r"reward.http: .*token_file and headers_from_env both set the Authoriz"):
        load_config(None, **settings, reward={"http": both})
    cfg = load_config(None, **settings, reward={"http": http})
    assert "s3cret" not in cfg.model_dump_json()  # the path is in the config, the token is not
    # The file's contents rotate live (read before each batch); the path is a security setting, never the admin's.
    assert not is_live("reward.http.token_file")
    with pytest.raises(ConfigError, match=r"reward.http.token_file: is not changeable live \(a security setting"):
        refuse_unsafe_live_change(cfg, cfg, {"reward.http.token_file": "/proc/self/environ"})


@pytest.mark.unit
@pytest.mark.parametrize(
    ("contents", "problem"),
    [
        ("LEAKED-first-line\nLEAKED-second-line\n", "holds a line break"),
        ("LEAKED-t\u00f6ken", "holds a character outside ASCII"),
        ("LEAKED-\u4e2d\u6587", "holds a character outside ASCII"),
        ("LEAKED has a space", "holds a space or a control character"),
        ("LEAKED\x00nul", "holds a space or a control character"),
        ("\n", "is empty"),
    ],
)
def test_a_token_that_cannot_go_into_a_header_stops_the_start_naming_the_field_not_the_token(
    tmp_path, contents, problem
):
    settings = minimal_settings(tmp_path)
    (tmp_path / "token").write_text(contents)
    http = {"url": "http://127.0.0.1:1/score", "token_file": str(tmp_path / "token")}
    with pytest.raises(ConfigError, match=rf"reward.http.token_file: the token in '.*/token' {problem}") as refused:
        load_config(None, **settings, reward={"http": http})
    assert "LEAKED" not in str(refused.value)


@pytest.mark.unit
def test_a_header_value_from_the_environment_that_cannot_be_sent_stops_the_start_naming_its_variable(
    tmp_path, monkeypatch
):
    settings = minimal_settings(tmp_path)
    monkeypatch.setenv("TEST_REWARD_KEY", "LEAKED-key\r\nX-Injected: 1")
    http = {"url": "http://127.0.0.1:1/score", "headers_from_env": {"X-Api-Key": "TEST_REWARD_KEY"}}
    with pytest.raises(ConfigError, match=r"headers_from_env: TEST_REWARD_KEY .*holds a line break") as refused:
        load_config(None, **settings, reward={"http": http})
    assert "LEAKED" not in str(refused.value)


def test_a_reward_beyond_max_abs_reward_fails_the_group_naming_the_completion_and_its_parts(rules):
    reward = RewardConfig(functions={"exact_match": 3.0, "format": 1.0}, max_abs_reward=2.0)
    groups = [answered("a", "2", ["3", "x"]), answered("b", "2", ["x", "2"])]
    with pytest.raises(RewardOutOfBounds) as error:
        asyncio.run(score_groups(groups, reward, rules))
    assert str(error.value) == (
        "group b: completion 1 has reward 4, outside [-2, 2] (reward.max_abs_reward); "
        "its parts: exact_match 1, format 1"
    )
    # Within the bound, the same completions are scored as usual.
    assert len(asyncio.run(score_groups(groups, reward.model_copy(update={"max_abs_reward": 4.0}), rules))) == 2


def test_a_non_finite_max_abs_reward_is_refused_naming_the_field(tiny_model):
    model_dir, data_dir = tiny_model
    settings = {"model": {"path": str(model_dir)}, "data": {"train_path": str(data_dir / "train.jsonl")}}
    with pytest.raises(ConfigError, match=r"reward.max_abs_reward"):
        load_config(None, **settings, reward={"max_abs_reward": float("inf")})


def test_a_group_beyond_max_abs_reward_goes_to_dead_letters_with_the_reason_and_the_rest_is_scored(
    rules, tiny_model, tmp_path, nats_url
):
    nats = {"url": nats_url, **QUICK_REDELIVERY}
    cfg = run_config(tmp_path, tiny_model, nats=nats)
    reward = RewardConfig(functions={"exact_match": 3.0}, max_abs_reward=2.0)

    async def scenario() -> None:
        await create_run_state(cfg)
        bus = await Bus(cfg, "reward").connect()
        for item in (answered("calm", "2", ["x"]), answered("wild", "2", ["2"])):
            await bus.publish(ROLLOUTS, item, msg_id=f"{item.group_id}.rollout")

        async def compute(groups: list[RolloutGroup]) -> list[ScoredGroup]:
            return await score_groups(groups, reward, rules)

        stop = asyncio.Event()
        task = asyncio.create_task(Stage(bus, ROLLOUTS, SCORED, RolloutGroup, compute, 2, "reward").run(stop))
        await until_messages(bus, DEAD, 1)
        stop.set()
        await task
        assert await stream_messages(bus, SCORED) == 1 and await stream_messages(bus, DEAD) == 1
        letter = await bus.js.get_msg(stream_name(cfg.run_id, DEAD), seq=1)
        assert letter.headers["Rlpipe-Group-Id"] == "wild"
        assert (
            "group wild: completion 0 has reward 3, outside [-2, 2] (reward.max_abs_reward)"
            in (letter.headers["Rlpipe-Reason"])
        )
        await bus.close()

    asyncio.run(scenario())


@pytest.mark.unit
def test_overlong_scores_are_zero_then_fall_linearly_to_minus_one_at_the_limit_by_hand():
    penalty = OverlongPenaltyConfig(max_tokens=10, buffer_tokens=4)
    # Soft zone (6, 10]: 7 tokens is 1/4 of the way to the limit, 8 half, 10 the whole; past it -1.
    lengths = np.array([0, 6, 7, 8, 10, 11, 100])
    assert overlong_scores(lengths, penalty).tolist() == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0]


@pytest.mark.unit
def test_an_overlong_buffer_past_the_limit_is_refused_naming_both_fields():
    with pytest.raises(ValueError, match=r"buffer_tokens \(5\) must be at most max_tokens \(4\)"):
        OverlongPenaltyConfig(max_tokens=4, buffer_tokens=5)


def test_the_overlong_penalty_is_a_weighted_part_counting_only_the_model_tokens(rules):
    def completion(length: int, inserted: int = 0) -> Completion:
        return Completion(
            text="2",
            token_ids=np.arange(length + inserted, dtype=np.int64),
            logprobs=np.zeros(length + inserted, np.float32),
            finish_reason="stop",
            loss_mask=np.array([1] * length + [0] * inserted, np.int32) if inserted else None,
        )

    # 3 model tokens and 20 an environment inserted: no penalty, however long the episode's text.
    rollout = answered("a", "2", ["2"]).model_copy(
        update={"completions": [completion(2), completion(5), completion(9), completion(3, inserted=20)]}
    )
    reward = RewardConfig(overlong_penalty={"max_tokens": 6, "buffer_tokens": 2, "weight": 0.5})
    (scored,) = asyncio.run(score_groups([rollout], reward, rules))
    assert scored.reward_parts["overlong"].tolist() == [0.0, -0.5, -1.0, 0.0]
    assert scored.rewards.tolist() == [1.0, 0.75, 0.5, 1.0]  # exact_match 1 each, plus 0.5 * overlong
    assert reward_part_means([scored])["reward/overlong/mean"] == -0.375


def test_overlong_may_not_name_a_rule_function(tiny_model):
    with pytest.raises(ValueError, match="may not use the names \\['overlong'\\]"):
        RewardConfig(functions={"overlong": 1.0})


def test_the_environments_own_reward_is_a_weighted_part_when_given_a_weight(rules):
    def episode(env_reward: float) -> Completion:
        return Completion(
            text="2",
            token_ids=np.arange(3, dtype=np.int64),
            logprobs=np.zeros(3, np.float32),
            finish_reason="stop",
            loss_mask=np.array([1, 0, 1], np.int32),
            episode=Episode(
                turns=2, tool_calls=1, tool_errors=0, env_seconds=0.1, env_reward=env_reward, outcome="done"
            ),
        )

    rollout = answered("a", "2", ["2"]).model_copy(update={"completions": [episode(1.0), episode(-0.5), episode(0.0)]})
    reported_only = asyncio.run(score_groups([rollout], RewardConfig(), rules))[0]
    assert "environment" not in reported_only.reward_parts and reported_only.rewards.tolist() == [1.0, 1.0, 1.0]

    (scored,) = asyncio.run(score_groups([rollout], RewardConfig(environment_weight=0.5), rules))
    assert scored.reward_parts["environment"].tolist() == [1.0, -0.5, 0.0]
    assert scored.rewards.tolist() == [1.5, 0.75, 1.0]  # exact_match 1 each, plus 0.5 * the environment's
    # An environment's reward alone is a reward.
    alone = asyncio.run(score_groups([rollout], RewardConfig(functions={}, environment_weight=1.0), rules))[0]
    assert alone.rewards.tolist() == [1.0, -0.5, 0.0]


def test_an_environment_weight_without_an_environment_is_refused_naming_the_field(tmp_path, config_only_model):
    config = config_file(tmp_path, config_only_model, reward={"environment_weight": 1.0})
    with pytest.raises(ConfigError, match=r"reward\.environment_weight=1 weighs an environment's reward"):
        load_config(config)
    with pytest.raises(ValueError, match=r"may not use the names \['environment'\]"):
        RewardConfig(functions={"environment": 1.0})
