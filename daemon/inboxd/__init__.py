"""inboxd: watch inbox folders, run a local vision model on each new image, one result each."""

__version__ = "0.1.0"
