"""The benchmarks behind the README's results table: each a module run from the repository root as
`python -m benchmarks.NAME` (convergence, exchange, streaming, heterogeneous, codecs, data, chaos, faults,
observe_cost, island_throughput, muon_memory), its helpers beside it (convergence_*, transfer). They measure;
they are not part of the installed distribution (pyproject.toml ships diloco, coordinator and islands only),
and the security probes (attacks, the fuzzer) live with the tests, in tests/probes/. Write-ups:
docs/benchmarks.md.
"""
