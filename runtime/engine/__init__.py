"""expertcache.runtime.engine: The offload engine: the bounded expert cache on the fast tier, miss policies, predictors and prefetch."""
