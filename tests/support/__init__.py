"""Helpers only tests use: fake datasets in their published layouts."""
