"""`rlhf-learner`: the training process (one per data-parallel rank under torchrun/deepspeed)."""

from rlhf_core.cli import collect_less_while_starting, hydra_entry
from rlhf_core.config import to_object
from rlhf_core.errors import STOPPED_EARLY_EXIT
from rlhf_core.metric_names import STOP_SIGNAL


@hydra_entry()
def main(cfg) -> int:
    collect_less_while_starting()
    from learner.trainer import run_learner

    result = run_learner(to_object(cfg))
    return STOPPED_EARLY_EXIT if result.stopped_by == STOP_SIGNAL else 0


if __name__ == "__main__":
    main()
