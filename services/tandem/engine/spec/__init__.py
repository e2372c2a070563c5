"""Speculative decoding: draft proposers, verification of drafts, the per-sequence k policy."""
