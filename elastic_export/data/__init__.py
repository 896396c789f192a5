"""Data in: calibration samples (with the held-out split) and retrieval pairs."""
