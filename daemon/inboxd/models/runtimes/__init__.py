"""How the network runs: the choice of runtime and precision (``choice``), the runners
(``runner``: torch or ONNX Runtime; ``onnx``: the exported artifact and its cache), and the
check that a faster one agrees with the plain model on a probe batch (``agreement``). The export
runs in a child process (``models/onnx_export.py``); the swap in the background is
``models/fast_path.py``.
"""
