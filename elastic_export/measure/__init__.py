"""Measurement: retrieval evaluation, the main job's quick eval, latency benchmarks, the Pareto frontier."""
