"""Above the server: data-parallel replicas behind one address (Ray Serve, replicas.py), the KV-aware router that
sends a request to the replica holding its prefix, and the index of which replica holds which blocks (kv_index.py)."""
