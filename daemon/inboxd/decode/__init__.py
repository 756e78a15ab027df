"""Untrusted bytes → the pixels a model wants, in worker processes that can fail alone.

``pillow.py`` and ``spec.py`` are pure functions over bytes and arrays; ``worker.py`` runs them in
a separate process over one file at a time, ``pool.py`` keeps ``preprocess.workers`` of those
processes and turns every way one can fail into that file's error; their framing is
``inboxd.wire`` (shared with the commit process).
"""
