"""A run's mutual-TLS credentials (its CA, certificates, revocation), which addresses stay on this machine,
and strings a client sent made safe to keep and log; the HTTP server of a process's observability port, which
callers that send half a request cannot take from the others (httpserve.py).
"""
