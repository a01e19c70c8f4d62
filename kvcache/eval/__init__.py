"""Quality evaluations: what a KV cache format costs in model quality, against a baseline in the same run."""
