"""`deepspeed.zero`'s name for Init and GatheredParameters (zero/sharding/init.py)."""
from .sharding.init import GatheredParameters, Init

__all__ = ["GatheredParameters", "Init"]
