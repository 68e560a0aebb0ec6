"""Displaced versions of the layers that mix information across rows, installed as diffusers hooks."""
