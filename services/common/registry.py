"""The names a config may choose for pluggable functions, and the tables the roles fill with them.

Config validates ``train.algorithm``, ``train.kl.estimator``, ``train.loss_agg``,
``train.off_policy.correction`` and ``reward.functions`` here, without importing the trainer
or the reward role (``common`` never imports a role). Each table starts empty; the role that
implements the functions registers them on import (``services.trainer.learning.algorithms``,
``services.trainer.learning.corrections``, ``services.common.model.reward_rules``).
A name is valid if it is built in (declared below, so a launcher or a rollout that never
imports the trainer's math still accepts ``k3``) or registered before the config is
loaded (a user's own estimator). tests/test_layering.py checks that the built-in names
are exactly what the roles register.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import Any


class Registry(dict[str, Callable[..., Any]]):
    """name -> function, plus the names built into rlpipe whether or not their module is imported yet."""

    def __init__(self, kind: str, builtin: Iterable[str]):
        super().__init__()
        self.kind = kind
        self.builtin = tuple(builtin)

    def names(self) -> list[str]:
        return sorted({*self.builtin, *self})

    def register(self, name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorator: ``@ADVANTAGE_ESTIMATORS.register("median")``."""

        def add(fn: Callable[..., Any]) -> Callable[..., Any]:
            self[name] = fn
            return fn

        return add


ADVANTAGE_ESTIMATORS = Registry("group advantage estimator", ("grpo", "grpo_no_std", "rloo"))
KL_ESTIMATORS = Registry("KL estimator", ("k1", "abs", "k2", "k3"))
AGGREGATIONS = Registry(
    "loss aggregation", ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
)
# Off-policy corrections toward the rollout's logprobs; "none" is no correction, not a function.
OFF_POLICY_CORRECTIONS = Registry("off-policy correction", ("tis", "masked_is", "icepop", "seq_geo_mask"))
REWARD_FUNCTIONS = Registry(
    "reward function",
    ("exact_match", "final_number", "format", "format_penalty", "gsm8k", "length_penalty", "math_verify"),
)

# rollout.environment's built-in names (services.common.episodes.environments implements them).
ENVIRONMENTS = ("calculator", "python", "no-tool")


def import_function(path: str) -> Callable[..., Any]:
    """The callable a ``module:function`` path names (a plugin on the Python path); ValueError says what is wrong."""
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"{path!r} is not an import path of the form 'module:function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # a plugin may fail to import in any way: its own bug, a missing dependency
        raise ValueError(f"{path!r}: module {module_name!r} cannot be imported ({error!r})") from None
    function = getattr(module, attribute, None)
    if not callable(function):
        raise ValueError(f"{path!r}: module {module_name!r} has no function {attribute!r}")
    return function


def reward_function(name: str) -> Callable[..., Any]:
    """A registered reward function by name, or a plugin's by its ``module:function`` import path."""
    if ":" in name:
        return import_function(name)
    if name not in REWARD_FUNCTIONS:
        raise ValueError(f"reward function {name!r} is not one of {REWARD_FUNCTIONS.names()} nor a 'module:function'")
    return REWARD_FUNCTIONS[name]


# Algorithms whose advantages come from elsewhere than a group estimator: PPO from GAE over a critic,
# REINFORCE++ from whitened discounted returns, Dr. GRPO as an alias of grpo_no_std (the trainer's learner).
NON_GROUP_ALGORITHMS = ("ppo", "reinforce_pp", "dr_grpo")


def algorithm_names() -> list[str]:
    """What ``train.algorithm`` accepts: the algorithms above and every group advantage estimator."""
    return sorted({*NON_GROUP_ALGORITHMS, *ADVANTAGE_ESTIMATORS.names()})
