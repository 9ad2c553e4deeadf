"""Speculative decoding: draft trees, verification (greedy and lossless sampling), the generation loop, metrics."""
