"""Serving the rollout engine to environments that speak an HTTP protocol."""
