"""Tier: model. It imports leaves and core."""
