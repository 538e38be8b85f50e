"""Finds, fetches and decodes the stored KV chunks of a request's prefix.

Imports flow one way: scheduler -> {codec, storage, engine}; never app.
"""
