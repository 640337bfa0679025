from rollout_workers.cli import main

main()
