"""The Redis-backed buffer: leased prompts, acked samples, pacing, replay, dead letters."""
