"""expertcache.evals"""
