"""The HTTP surface: one sub-package per protocol, translating to and from engine requests."""
