"""Detection's geometry and post-processing (``geometry``), free of any one detector: the
letterbox, raw outputs → boxes, NMS, boxes → the displayed photo's pixels. The detectors users
bring are loaded and run by ``models/detect_model.py``, as ``models/ocr/`` is by
``models/ocr_model.py``."""
