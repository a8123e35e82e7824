"""expertcache.runtime: run a MoE checkpoint whose experts do not fit in fast memory.

`load(path_or_hub_id, capacity=, tier=, device=, dtype=)` is the entry point; `offload(model, source, cfg)`
attaches the engine to a model already in memory.
"""

from expertcache.runtime.engine.config import EngineConfig
from expertcache.runtime.engine.engine import OffloadEngine, offload
from expertcache.runtime.engine.stats import Stats
from expertcache.runtime.storage.loader import load, reattach

__all__ = ["EngineConfig", "OffloadEngine", "Stats", "load", "offload", "reattach"]
