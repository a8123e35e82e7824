"""expertcache.runtime.bench: Benchmarks: `bench decode`, `bench big` (systems in one memory cgroup), the trace replay, the bandwidth model,
and the peers (llama.cpp)."""
