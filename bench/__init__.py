"""Benchmarks for inboxd: scripts that print figures and draw charts, not timed tests.

``python -m bench.run`` (``make bench``) and ``python -m bench.sweep`` (``make bench-sweep``).
"""
