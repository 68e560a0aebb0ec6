"""Test helpers for paradiff: a reusable pool of gloo ranks on loopback (see ``workers``)."""
