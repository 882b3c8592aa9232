"""Security probes: the attacks of issues 15 and 30 and the RPC fuzzer, run against a real coordinator.

tests/ imports them (tests/test_fuzz.py, tests/test_benchmark_cli.py), and each prints the figures the README's
results table and docs/security.md cite when run from the repository root as `python -m tests.probes.attack`,
`python -m tests.probes.member_attacks --seeds 0,1,2` or `python -m tests.probes.fuzz --seed 0`. Like benchmarks/,
they are not installed with the package.
"""
