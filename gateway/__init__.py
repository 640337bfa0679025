"""``rlhf-gateway``: an OpenAI-compatible HTTP front end whose calls the rollout workers serve
and whose rewarded sessions become training samples (docs/gateway.md)."""
