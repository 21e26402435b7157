"""Terminology: glossaries, translation memories and the segment cache (issue 31)."""
