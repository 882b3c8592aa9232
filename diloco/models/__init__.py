"""Models: the Llama-style decoder (llama.py) with its mixture-of-experts MLP, the Muon inner optimizer,
the Hugging Face mapping and export, and evaluation (loss, perplexity, multiple choice; checkpoint_eval.py: what `diloco-eval` loads and measures).
"""
