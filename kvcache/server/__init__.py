"""The OpenAI-compatible HTTP server: API, engine loop, Prometheus metrics, `kvcache top`."""
