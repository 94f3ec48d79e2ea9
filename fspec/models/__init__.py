"""Functional target models and draft heads."""
