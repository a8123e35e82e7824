"""expertcache.runtime.serve: Decoding: one prefill and one step under `generate`, batched requests, and the OpenAI-compatible server."""
