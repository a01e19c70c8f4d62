"""Policy name -> policy object."""
from __future__ import annotations

from kvcache.compress.h2o import H2O
from kvcache.compress.policy import EvictionPolicy
from kvcache.compress.pyramidkv import PyramidKV
from kvcache.compress.random_floor import RandomEviction
from kvcache.compress.snapkv import SnapKV
from kvcache.compress.streaming import StreamingLLM
from kvcache.compress.tova import TOVA

POLICY_CLASSES: dict[str, type[EvictionPolicy]] = {
    c.name: c for c in (StreamingLLM, H2O, SnapKV, TOVA, PyramidKV, RandomEviction)}


def get_policy(name: str) -> EvictionPolicy:
    """The policy called `name` (one of compress.spec.POLICIES other than none)."""
    return POLICY_CLASSES[name]()
