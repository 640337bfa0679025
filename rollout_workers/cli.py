"""`rlhf-worker` (also `python -m rollout_workers`): one rollout worker process.

    rlhf-worker buffer.url=redis://host:6379 buffer.run_id=myrun \
        weight_server.address=tcp://host:5555 weight_server.pub_address=tcp://host:5556
"""

from rlhf_core.cli import collect_less_while_starting, hydra_entry
from rlhf_core.config import to_object


@hydra_entry()
def main(cfg) -> int:
    collect_less_while_starting()
    from rollout_workers.worker import run_worker

    run_worker(to_object(cfg))
    return 0


if __name__ == "__main__":
    main()
