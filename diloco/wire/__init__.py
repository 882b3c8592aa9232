"""The wire: codecs (fp32, bf16, int8, e3m0, top-k, zstd) and their numba kernels, error feedback, the one
module that turns tensors into protocol messages and back (messages.py), its hand-framed hot path
(frames.py), and the typed refusals both sides read (refusal.py).
"""
