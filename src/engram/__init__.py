"""Engram."""
