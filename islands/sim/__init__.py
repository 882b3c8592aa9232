"""The one-node harness: a coordinator and N islands as processes, failure injection, emulated WAN links.

It sits above what it launches: it starts `python -m coordinator` and
`python -m islands` as processes and talks to them over the public protocol;
nothing in `diloco`, `coordinator` or the rest of `islands` imports it.
"""
