"""`python -m packbench`: the command line, as the `packbench` console script runs it."""

from packbench.cli.main import main

main()
