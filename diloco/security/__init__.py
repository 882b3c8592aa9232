"""A run's mutual-TLS credentials (its CA, certificates, revocation), which addresses stay on this machine,
and strings a client sent made safe to keep and log.
"""
