"""Deployment targets: sessions and engines built from the artifact directory."""
