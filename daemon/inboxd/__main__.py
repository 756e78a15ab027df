from inboxd.cli import entry

entry()
