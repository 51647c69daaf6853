"""The world the agent acts in: tasks, sandboxes, tools, chat templates, scaffolds, verifiers,
trajectories, and the rollout queue and workers that carry episodes to the trainer (no JAX)."""
