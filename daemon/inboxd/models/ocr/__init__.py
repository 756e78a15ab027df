"""The built-in OCR task (``model: {name: ocr}``): PP-OCRv4 text detection, the angle
classifier and recognition, run by ONNX Runtime on the decoded photo.

The networks are the ONNX files inside the ``rapidocr-onnxruntime`` wheel (``assets``); the steps
around them follow RapidOCR 1.4.4 so that a photo reads the same: ``detection`` (the DB
probability map to text regions), ``crops`` (each region cut out and rectified, lines in
reading order), ``recognition`` (the angle classifier and the CTC recogniser) and ``reader``
(one photo from pixels to lines, with the bounded fan-out: ``max_regions`` per photo and the
``ocr_crops`` layer of crops waiting for the recogniser).
"""
