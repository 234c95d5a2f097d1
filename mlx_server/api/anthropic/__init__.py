"""Anthropic Messages: protocol (schemas), serving (translation), router (routes)."""
