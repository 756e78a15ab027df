"""Everything that touches the disk: which names are ours, claims and moves, durable writes.

Nothing here knows about the pipeline: these functions take paths and bytes and either do one
atomic thing or raise ``OSError``.
"""
