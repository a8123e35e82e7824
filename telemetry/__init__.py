"""expertcache.telemetry"""
