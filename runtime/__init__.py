"""expertcache.runtime"""
