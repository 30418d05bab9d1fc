"""Observations as chat messages (rollout.observation_role): the wrapping read off the model's chat template makes an
episode's tokens exactly what the template renders for the same conversation, the model's EOS ends its message and
not the episode, and a template that cannot do this is refused naming the field."""

import asyncio

import pytest

from services.cli.build.tiny_model import ALPHABET, build_char_tokenizer
from services.common.episodes.environments import Calculator, Task
from services.common.episodes.episode_environment import LocalEnvironment
from services.common.episodes.episode_state import EpisodeState
from services.common.episodes.observations import ChatObservations, VerbatimObservations, observation_format
from services.common.episodes.runner import EpisodeRunner, run_episodes, start_episodes
from services.common.refusal import StartRefused
from tests.support.episodes import EOS, LIMITS, SAMPLED_LOGPROB, CharTokenizer, ScriptedEngine
from tests.support.runs import run_config

pytestmark = pytest.mark.unit

# SmolLM2-135M-Instruct's template (ChatML with a default system message), as its tokenizer ships it.
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def chat_tokenizer(template: str = CHATML, eos: str = "<|im_end|>"):
    tokenizer = build_char_tokenizer(ALPHABET + "\n<>/?AIY")  # every character the tests' chats spell
    tokenizer.add_special_tokens({"eos_token": eos, "additional_special_tokens": ["<|im_start|>"]})
    tokenizer.chat_template = template
    return tokenizer


def test_the_wrapping_of_a_tool_message_is_read_off_the_chat_template():
    tokenizer = chat_tokenizer()
    chat = ChatObservations.of(tokenizer, "tool")
    assert (chat.before, chat.after) == ("\n<|im_start|>tool\n", "<|im_end|>\n<|im_start|>assistant\n")
    assert chat.eos_token_id == tokenizer.eos_token_id and not chat.eos_ends_episode
    message = tokenizer.encode("\n<|im_start|>tool\n<result>6</result><|im_end|>\n<|im_start|>assistant\n")
    assert chat.tokens("<result>6</result>", turn_ended_with_eos=True) == message
    # A turn cut by a stop string never sampled its EOS: the message is closed first.
    assert chat.tokens("<result>6</result>", turn_ended_with_eos=False) == [tokenizer.eos_token_id, *message]


def test_an_episodes_tokens_are_what_the_template_renders_for_the_same_conversation():
    """Token in, token out, and the template applied the same way at every turn: the prompt, two model messages
    each ended by EOS and the tool's reply between them decode to the template's own rendering of that chat."""
    tokenizer = chat_tokenizer()
    chat = ChatObservations.of(tokenizer, "tool")
    eos = tokenizer.eos_token_id
    question = [{"role": "user", "content": "2*3?"}]
    ids = tokenizer.encode(tokenizer.apply_chat_template(question, tokenize=False, add_generation_prompt=True))
    ids += [*tokenizer.encode("<calc>2*3</calc>"), eos]  # the model's first message, as sampled
    ids += chat.tokens("<result>6</result>", turn_ended_with_eos=True)
    ids += [*tokenizer.encode("6"), eos]
    conversation = [
        *question,
        {"role": "assistant", "content": "<calc>2*3</calc>"},
        {"role": "tool", "content": "<result>6</result>"},
        {"role": "assistant", "content": "6"},
    ]
    rendered = tokenizer.apply_chat_template(conversation, tokenize=False)
    assert tokenizer.decode(ids, skip_special_tokens=False) == rendered.removesuffix("\n")  # the model stops at EOS


@pytest.mark.parametrize(
    ("tokenizer", "reason"),
    [
        (build_char_tokenizer(), "and the model has none"),
        # An assistant message ends with a marker that is not the EOS token: a turn the model ended with EOS
        # could not be continued as the template continues it.
        (chat_tokenizer(CHATML.replace("'<|im_end|>' + '\n'", "'</s>' + '\n'")), "does not end an assistant"),
        (chat_tokenizer("{{ raise_exception('no tool messages') }}"), "cannot render such a message: no tool"),
    ],
)
def test_a_template_that_cannot_wrap_observations_is_refused_naming_the_field(tokenizer, reason):
    with pytest.raises(ValueError, match=r"rollout\.observation_role='tool'") as error:
        ChatObservations.of(tokenizer, "tool")
    assert reason in str(error.value)


def test_an_empty_role_keeps_observations_verbatim():
    assert isinstance(observation_format(build_char_tokenizer(), ""), VerbatimObservations)


def played(script: list[str], observations) -> EpisodeState:
    tokenizer = CharTokenizer()
    engine = ScriptedEngine(script, tokenizer)

    async def episode() -> EpisodeState:
        [[state]] = await start_episodes(
            [Task("p0", "Q", "6")], lambda: LocalEnvironment(Calculator(), 5.0), 1, tokenizer
        )
        await run_episodes([state], engine.generate, LIMITS, tokenizer, observations)
        return state

    return asyncio.run(episode())


CHAR_CHAT = ChatObservations(CharTokenizer(), EOS, before="\n[t]", after="[/t][a]")


def test_with_a_role_the_models_eos_ends_its_message_and_the_environment_ends_the_episode():
    script = ["<calc>2*3</calc>\0", "6\0"]  # a tool call closed by EOS, as a chat model writes one
    verbatim = played(script, VerbatimObservations(CharTokenizer()))
    # EOS is the answer: the episode ends on the first turn, no observation appended.
    assert (verbatim.turns, verbatim.outcome, verbatim.generated) == (1, "done", len(script[0]))

    state = played(script, CHAR_CHAT)
    completion = state.completion(CharTokenizer())
    message = "\n[t]<result>6</result>[/t][a]"
    assert completion.text == "<calc>2*3</calc>" + message + "6"
    model_1, model_2 = len("<calc>2*3</calc>") + 1, len("6") + 1  # each with its EOS
    assert completion.loss_mask.tolist() == [1] * model_1 + [0] * len(message) + [1] * model_2
    assert completion.logprobs.tolist() == [SAMPLED_LOGPROB if m else 0.0 for m in completion.loss_mask]
    assert (completion.episode.turns, completion.episode.tool_calls, completion.episode.outcome) == (2, 1, "done")


def test_a_turn_cut_by_its_stop_string_gets_its_eos_before_the_message_masked_out():
    state = played(["<calc>2*3</calc>", "6\0"], CHAR_CHAT)  # the engine stopped at </calc>: no EOS sampled
    first = len("<calc>2*3</calc>")
    assert state.context[state.prompt_len + first] == EOS
    assert state.mask[first : first + 2] == [0, 0]  # the inserted EOS and the message's first token
    assert state.mask.count(1) == first + 2  # the model's tokens only: its two turns, the second with EOS


def test_a_rollout_whose_model_cannot_wrap_observations_refuses_to_start(tmp_path, config_only_model):
    rollout = {"environment": "calculator", "observation_role": "tool"}
    cfg = run_config(tmp_path, config_only_model, rollout=rollout)
    with pytest.raises(StartRefused, match=r"rollout\.observation_role='tool' wraps observations in the model's chat"):
        EpisodeRunner(cfg, build_char_tokenizer(), on_engine=None, generate_turns=None)
