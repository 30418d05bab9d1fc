"""The recovery simulation's scenarios (tests/trainer/simulation.py runs them): the ops a seed draws, the features of
the world that add ops of their own, and the holes the simulation found, each with the scenario that ran into it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

SCENARIO_OPS = 40  # ops in a default scenario
REINJECT_SHARE = 0.08  # how often an operator re-injects a dead letter after an op (rlpipe dead-letters --reinject)


@dataclass(frozen=True)
class Features:
    """What of the world a scenario simulates besides feeds, deliveries, steps, saves, purges, rollbacks, outages
    and crashes. Each adds ops drawn from a random stream of its own, so a seed's other ops stay as they were. Off by
    default: a feature added later leaves the ``FOUND_HOLES`` replaying as they were found."""

    # The loop as the service runs it: a save every checkpoint.save_every_steps steps, and an empty read of
    # EXPERIENCE waits out its timeout (the intake's once-a-second write-off check then sees what it read past).
    loop: bool = False
    reinjects: bool = False  # operators re-inject dead letters
    lease: bool = False  # the lease and the store's fence, and a trainer paused past its lease that wakes (a zombie)
    mirror: bool = False  # the checkpoint mirror, its outages, and bitrot in either store
    dynamic_sampling: bool = False  # train.dynamic_sampling, and rollouts whose groups have all rewards alike
    broker_loss: bool = False  # a broker back without its last unsynced EXPERIENCE writes


ALL = Features(loop=True, reinjects=True, lease=True, mirror=True, dynamic_sampling=True, broker_loss=True)
FEEDS_ONLY = Features()
REINJECTS = Features(reinjects=True)
WITH_ORACLE = Features(loop=True, reinjects=True, lease=True, mirror=True, dynamic_sampling=True, broker_loss=True)
# What the simulation found, each once a hole and now fixed, with a (seed, ops, features) that ran into it; the
# tests replay each as a regression case beside the seeded run, with the features the simulation had then.
FOUND_HOLES = {
    # GroupLedger.forget_through dropped the fates settled at or before the oldest kept checkpoint; a rollout that
    # computed such a group again after the broker's duplicate window got it applied a second time. Fixed by the
    # ledger's settled-through watermark.
    "a forgotten group computed again past the duplicate window was applied twice": (26, 60, FEEDS_ONLY),
    # A rollback to a step that read less of EXPERIENCE than the run purged left the groups the abandoned steps had
    # applied from the purged part (their fates already forgotten) with no fate. Fixed by reopening what the
    # lineage says the abandoned steps settled (GroupLedger.rewind's ``abandoned``). The oracle then
    # found a second hole in the same seed: after a resume from a later checkpoint, the rollback took the
    # watermark back below a group written off as lost, which the ledger knew only by it, and would have applied
    # a late copy. Fixed by keeping the higher watermark.
    "a rollback behind the purge left the abandoned steps' groups without a fate": (151, 60, FEEDS_ONLY),
    # A rollback to a checkpoint that saw a group dead, after an operator re-injected it, settled the group again
    # while it stayed in flight. Fixed by GroupLedger.rewind leaving groups in flight out of the checkpoint's
    # settled ones. Found once re-injects were drawn.
    "a rollback after a re-inject left the reopened group both in flight and settled": (923, 40, REINJECTS),
    # A feed publishing its prompts together had one refused and the next land; the next settled and the
    # watermark passed the refused one, which the feeder then skipped as known. Fixed by the watermark staying
    # below the feeder's cursor (GroupLedger.unfed_from). Found once a broker outage failed every other publish.
    "a refused prompt behind one that landed was skipped as known": (625, 40, REINJECTS),
    # Found by the independent oracle, each fixed in GroupLedger. A rollback to a checkpoint that saw
    # a group dead, after a re-inject and a step (abandoned by the rollback) that applied its copy, restored the
    # checkpoint's fate: the copy, re-read, was refused, and the group had none (``rewind``'s ``dead``).
    "a rollback restored the dead fate of a group re-injected and applied since": (56, 40, WITH_ORACLE),
    # A broker back without its unsynced writes lost messages read into a batch that was then dropped: their groups
    # stayed read, neither re-read nor written off (``unread``: in flight again).
    "groups read into a dropped batch whose messages the broker lost never got a fate": (1, 40, WITH_ORACLE),
    # A dead letter of a second copy of a group whose fate the ledger had forgotten under its watermark settled it
    # again as dead; a re-inject reopened it and it was applied (``settle`` refuses a group under the watermark).
    "a dead letter settled again a group whose fate was under the watermark": (450, 40, WITH_ORACLE),
}


@dataclass(frozen=True)
class Op:
    kind: str
    arg: int = 0

    def __str__(self) -> str:
        return f"{self.kind}({self.arg})"


OP_WEIGHTS = {
    "generate": 45,  # a rollout turns a prompt (any of those waiting: reordered) into EXPERIENCE
    "recompute": 5,  # a rollout computes a prompt it took before again (late, maybe past the duplicate window)
    "poison": 3,  # a malformed group: the trainer dead-letters it
    "drop": 3,  # a prompt that never comes back
    "step": 20,  # the trainer collects a batch and applies it
    "save": 8,
    "purge": 3,
    "mark_stable": 2,
    "rollback": 3,
    "tick": 6,  # time passes: past the lost bound or the duplicate window
    "store_down": 3,  # the store fails its next ``arg`` calls
    "broker_down": 2,  # the broker fails its next ``arg`` calls
    "crash": 3,  # the trainer dies now, or after ``arg`` more effects (between any two of them)
}
# The ops a feature adds: how often one follows an op, and which (by weight).
EXTRA_OPS = {
    # The trainer pauses just after its lease check before a store write, a successor takes the lease over and
    # claims the fence, and the paused one wakes to make that write (a save or a STABLE mark): it must be refused.
    "lease": (0.03, {"zombie": 1}),
    "mirror": (0.06, {"mirror_down": 2, "bitrot": 1}),  # the mirror fails its next calls; an object rots
    "broker_loss": (0.015, {"broker_loss": 1}),  # the broker restarts without its last ``arg`` EXPERIENCE writes
}
EXTRA_ARGS = {"mirror_down": (1, 4), "broker_loss": (1, 3)}  # the range of each extra op's ``arg``; others 0..12


def draw_scenario(seed: int, length: int = SCENARIO_OPS, features: Features = ALL) -> list[Op]:
    """``length`` ops drawn from ``seed``, with each feature's ops between them from a stream of its own."""
    rng = random.Random(seed)
    kinds, weights = zip(*OP_WEIGHTS.items(), strict=True)
    ops = []
    for _ in range(length):
        kind = rng.choices(kinds, weights)[0]
        arg = {"tick": rng.choice([1, 5, 25, 40]), "store_down": rng.randint(1, 4), "broker_down": rng.randint(1, 3)}
        ops.append(Op(kind, arg.get(kind, rng.randint(0, 12))))
    operator = random.Random(f"reinject-{seed}")
    extras = {name: random.Random(f"{name}-{seed}") for name in EXTRA_OPS if getattr(features, name)}
    drawn = []
    for op in ops:
        drawn.append(op)
        if features.reinjects and operator.random() < REINJECT_SHARE:
            drawn.append(Op("reinject", operator.randint(0, 12)))
        for name, stream in extras.items():
            share, choices = EXTRA_OPS[name]
            if stream.random() < share:
                kind = stream.choices(list(choices), list(choices.values()))[0]
                drawn.append(Op(kind, stream.randint(*EXTRA_ARGS.get(kind, (0, 12)))))
    return drawn


def describe(seed: int, ops: list[Op]) -> str:
    return f"seed={seed} ops=[{', '.join(map(str, ops))}]"
