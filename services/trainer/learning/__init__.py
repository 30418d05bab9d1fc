"""The learner: the policy (and critic) with their optimizer, one step over a batch, the pure RL math it calls, how a
batch becomes forward passes, and the same step spread over ranks (torchrun, FSDP2)."""
