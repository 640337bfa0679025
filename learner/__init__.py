"""The learner: PPO-family updates with off-policy corrections, checkpoints, weight publishing."""
