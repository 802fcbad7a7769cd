"""Checkpoint and tokenizer I/O: Hugging Face directories in and out."""
