"""HTTP: the OpenAI-compatible API, the network API, the dashboard and /metrics."""
