"""inboxd: watch inbox folders, run a local vision model on each new image, one result each."""

import os

__version__ = "0.2.0"

# torch's CPU thread pool (OpenMP) spins on its cores between parallel regions by default. In a
# daemon whose event loop, claim and decode threads share those cores, the spinning cost more
# CPU per file than the daemon's own work with a small model (docs/decisions.md, "OpenMP
# threads sleep when idle"). Idle threads sleep instead; libgomp reads this
# when torch loads it, hence here, before anything imports torch. A value set by the user wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
