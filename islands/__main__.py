from islands.cli import main

main()
