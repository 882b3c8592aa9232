from coordinator.cli import main

main()
