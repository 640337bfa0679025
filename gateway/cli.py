"""`rlhf-gateway` (also started by `rlhf-run gateway.enabled=true`): the OpenAI-compatible front end.

    rlhf-gateway buffer.url=redis://host:6379 buffer.run_id=myrun gateway.port=8000
"""

from rlhf_core.cli import collect_less_while_starting, hydra_entry
from rlhf_core.config import to_object


@hydra_entry()
def main(cfg) -> int:
    collect_less_while_starting()
    from gateway.server import run_gateway

    cfg = to_object(cfg)
    run_gateway(cfg, cfg.run.output_dir)
    return 0


if __name__ == "__main__":
    main()
