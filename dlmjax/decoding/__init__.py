"""Decoders and the engine. Importing the package registers every decoder: spec.py holds the
registry and the baseline decoders, each accelerated decoder module registers its own."""

from dlmjax.decoding import fast_dllm, llada2, mrp, psd, spec, tspd  # noqa: F401
