"""The command-line entry points of the core library (`diloco-data`, `diloco-certs`, `diloco-export`,
`diloco-eval`) and the plumbing every command shares (common.py: one-line errors, exit 2, config flags).
"""
