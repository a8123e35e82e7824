"""expertcache.trainer"""
