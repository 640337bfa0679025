"""`rlhf-monitor`: live view of a running run, read from Redis."""

from rlhf_core.cli import hydra_entry, not_built_yet


@hydra_entry("monitor")
def main(cfg) -> int:
    return not_built_yet("rlhf-monitor", "the launcher/monitor issue")


if __name__ == "__main__":
    main()
