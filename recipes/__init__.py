"""expertcache.recipes"""
