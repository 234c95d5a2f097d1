"""OpenAI Chat Completions: protocol (schemas), serving (translation), router (routes)."""
