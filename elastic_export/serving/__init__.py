"""Serving: the elastic runtime, its backend registry, budget policies, the sentence-transformers layout."""
