"""expertcache.runtime.kernels: Computing from what a slot holds: the C++ CPU kernels and model patches, the triton experts, the quantized
formats (int8, int4) and the GGUF import."""
