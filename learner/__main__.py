from learner.cli import main

main()
