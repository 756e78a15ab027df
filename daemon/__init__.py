"""inboxd: watch inbox folders, run a local vision model on each new image, write one result per file."""

__version__ = "0.1.0"
