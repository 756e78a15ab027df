"""Untrusted bytes → the pixels a model wants: Pillow decoding, orientation, resize and crop.

Pure functions over bytes and arrays; no disk, no event loop, so they can run in any worker.
"""
