"""Training data: the embedded synthetic language and byte-level text (sources.py), token corpora read as
numbered samples from shards or MDS datasets through a local cache, `diloco-data prepare`'s tokenizer
and writer, and `diloco-data inspect`'s check of a dataset (inspect.py).
"""
