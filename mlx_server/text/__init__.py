"""Streaming text post-processing shared by every protocol (stop strings, ...)."""
