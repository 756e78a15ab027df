"""systemd around the pipeline: sd_notify, the journal handler, the service's lifecycle
(signals, watchdog, reload) and reading the journal back for ``inboxd stats`` and ``report``."""
