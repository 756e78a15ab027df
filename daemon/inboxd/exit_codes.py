"""Every exit status of ``inboxd``, declared once (the CLI's help, the units'
``RestartPreventExitStatus=`` and the tests all mean these).

The sysexits.h values are systemd's vocabulary too: ``RestartPreventExitStatus=78`` stops a
restart loop on a configuration that cannot work, while ``Restart=on-failure`` restarts on the
others.
"""

from __future__ import annotations

OK = 0
# ``once`` finished, but some file failed (its .error.json says why).
SOME_FAILED = 1
# The command line itself is wrong (argparse's own status).
USAGE = 2
# EX_SOFTWARE: a stage crashed; the files in flight are back on disk.
EX_SOFTWARE = 70
# EX_TEMPFAIL: a condition that may clear by itself: this instance name is already running on
# the inbox, or the inbox's filesystem is full or out of inodes at start-up. Restart=on-failure
# tries again, and systemd's start limit stops one that never clears.
EX_TEMPFAIL = 75
# Ours, not sysexits.h's 76: the GPU failed in a way that poisons this process's CUDA context
# (illegal address, Xid, ECC); only a new process can use the device again.
EX_DEVICE = 76
# EX_CONFIG: the configuration cannot work; restarting into the same error would not help.
EX_CONFIG = 78
