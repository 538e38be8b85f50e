"""The HTTP gateway: OpenAI-compatible API, pre-encode API, metrics."""
