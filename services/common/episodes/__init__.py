"""Multi-turn episodes, shared by the rollout that plays them and the trainer's held-out evaluation that replays them:
environments and their tools, the HTTP environment client, observation formatting, turn batching and the episode loop.
Neither role imports the other; both import this."""
