"""`rlhf-learner`: the training process."""

from rlhf_core.cli import hydra_entry, not_built_yet


@hydra_entry()
def main(cfg) -> int:
    return not_built_yet("rlhf-learner", "the learner issue")


if __name__ == "__main__":
    main()
