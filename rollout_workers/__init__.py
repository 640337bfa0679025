"""Rollout workers: stateless generate-and-score processes feeding the buffer."""
