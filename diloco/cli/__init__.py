"""The command-line entry points of the core library (`diloco-data`, `diloco-certs`, `diloco-export`,
`diloco-eval`): each parses its arguments and then imports its work, so `--help` and a bad flag answer at once;
and the plumbing every command shares (common.py: one-line errors, exit 2, config flags; lifetime.py: the children a
launcher starts die with it).
"""
