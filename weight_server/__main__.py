from weight_server.cli import main

main()
