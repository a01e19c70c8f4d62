"""Tensor parallelism: sharding a model over ranks (sharding.py), the ranks' processes (group.py), the error
they raise (errors.py) and what the machine's processes share (host.py). Below the engine: it sees one engine."""
