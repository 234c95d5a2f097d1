"""OpenAI legacy Completions: protocol (schemas), serving (translation), router (routes)."""
