"""``children.HelperProcess``, the one way the daemon starts and ends a helper, on real child
interpreters: EOF ends a well-behaved one, one that ignores EOF is killed after the wait and
reaped, a stopped one is seen as stopped, a helper inherits only the descriptors it is given,
and a one-shot helper that runs past its time is killed and reaped."""

from __future__ import annotations

import os
import signal

import pytest
from inboxd.children import HelperProcess

# Reads its requests until EOF, then exits 0; a helper's lifetime in miniature.
UNTIL_EOF = ("-c", "import sys\nfor _ in sys.stdin.buffer: pass\n")
# Ignores EOF (and every stop signal the daemon could send short of SIGKILL).
STUCK = ("-c", "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
               "import sys\nsys.stdin.buffer.read()\ntime.sleep(600)\n")


def test_eof_ends_a_helper_and_its_pipes_are_closed() -> None:
    helper = HelperProcess(UNTIL_EOF)
    assert helper.alive() and helper.exit_code() is None
    assert helper.stop(30) == 0
    assert not helper.alive() and helper.describe_exit() == "exit status 0"
    assert helper.popen.stdin is not None and helper.popen.stdin.closed
    assert helper.popen.stdout is not None and helper.popen.stdout.closed


def test_a_helper_that_ignores_eof_is_killed_after_the_wait_and_reaped() -> None:
    helper = HelperProcess(STUCK)
    assert helper.stop(0.5) == -signal.SIGKILL
    assert helper.describe_exit() == "SIGKILL"
    with pytest.raises(ChildProcessError):
        os.waitpid(helper.pid, os.WNOHANG)  # reaped: no zombie left


def test_a_stopped_helper_is_seen_as_stopped() -> None:
    helper = HelperProcess(UNTIL_EOF)
    try:
        os.kill(helper.pid, signal.SIGSTOP)
        assert helper.wait(0.2) is None
        for _ in range(100):
            if helper.stopped():
                break
            helper.wait(0.05)
        assert helper.stopped()
        os.kill(helper.pid, signal.SIGCONT)
    finally:
        helper.kill()


def test_a_helper_inherits_only_the_descriptors_it_is_given() -> None:
    kept_r, kept_w = os.pipe()
    other_r, other_w = os.pipe()
    os.set_inheritable(other_w, True)  # inheritable, yet not named: must not reach the child
    try:
        probe = ("-c", f"import os\nprint(sorted(int(f) for f in os.listdir('/proc/self/fd')"
                       f" if int(f) in ({kept_w}, {other_w})))")
        helper = HelperProcess(probe, pass_fds=(kept_w,))
        out, _ = helper.communicate(b"", 60)
        assert out.decode().strip() == str([kept_w])
    finally:
        for fd in (kept_r, kept_w, other_r, other_w):
            os.close(fd)


def test_a_one_shot_helper_past_its_time_is_killed_and_reaped() -> None:
    helper = HelperProcess(STUCK, capture_stderr=True)
    with pytest.raises(TimeoutError):
        helper.communicate(b"", 0.5)
    assert helper.exit_code() == -signal.SIGKILL
