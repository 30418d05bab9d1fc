"""An example reward plugin: name it in a config as ``examples.reward_plugin:brevity`` (see docs/rewards.md).

A reward function takes the completion's text, the reference answer and the finish reason
("stop" or "length") and returns a float. It runs in the reward role's rule sandbox, under
``reward.function_timeout_s``; an exception fails the group (retried, then dead-lettered),
so raise only when the input cannot be judged.

    reward:
      functions:
        exact_match: 1.0
        examples.reward_plugin:brevity: 0.1
"""


def brevity(text: str, answer: str, finish_reason: str) -> float:
    """1 for a completion no longer than its reference answer, falling linearly to 0 at four times as long."""
    excess = max(0, len(text.strip()) - len(answer)) / max(1, 3 * len(answer))
    return max(0.0, 1.0 - excess)
