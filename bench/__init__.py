"""Benchmarks for inboxd: scripts that print figures and draw charts, not timed tests.

``python -m bench.run`` (``make bench``), ``python -m bench.sweep`` (``make bench-sweep``) and
``python -m bench.peer_vs_inboxd`` (``make bench-peer``: inboxd against ``bench/peer.py``).
"""
