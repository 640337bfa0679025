"""`rlhf-run`: start a whole run on one machine (Redis, weight server, learner, workers)."""

from rlhf_core.cli import hydra_entry, not_built_yet


@hydra_entry()
def main(cfg) -> int:
    return not_built_yet("rlhf-run", "the launcher issue")


if __name__ == "__main__":
    main()
