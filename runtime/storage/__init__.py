"""expertcache.runtime.storage: Reading a checkpoint without holding it: the meta-device loader, the expert store and its checkpoint views,
the tiers that move bytes (disk with O_DIRECT, host, cuda, throttled), the load queue, and `verify`."""
