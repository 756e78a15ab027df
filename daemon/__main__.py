from daemon.cli import entry

entry()
