"""OpenAI Responses: protocol (schemas), serving (translation), store (previous_response_id), router (routes)."""
