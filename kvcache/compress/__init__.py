"""Token eviction: which cached tokens a sequence drops when its KV budget is reached, and how they are scored.

One module per published policy (streaming, h2o, snapkv, tova, pyramidkv), plus a random floor. The
engine compacts the survivors into fewer blocks and returns the rest to the pool (engine/eviction.py).
"""
