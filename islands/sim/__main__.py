from islands.sim.cli import main

main()
