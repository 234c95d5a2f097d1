"""mlx-server: an OpenAI- and Anthropic-compatible LLM server on MLX."""

__version__ = "0.1.0"
