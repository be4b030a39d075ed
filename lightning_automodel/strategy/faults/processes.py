"""What one rank can see of another's process on the same machine: whether it runs, is stopped, or is gone."""

from __future__ import annotations

import os
import socket

GONE, FROZEN = "gone", "frozen"


def machine() -> str:
    """This boot of this machine and this pid namespace: processes sharing it see each other's process ids."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            return boot.read().strip() + ":" + os.readlink("/proc/self/ns/pid")
    except OSError:
        return socket.gethostname()


def process_state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return state_of(stat.read())
    except FileNotFoundError:
        return GONE
    except OSError:  # no /proc: whether the process exists is all that can be seen
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return GONE
        except PermissionError:
            pass
        return "running"


PF_EXITING = 0x4  # the kernel's flag on a process tearing itself down (set before its sockets close)


def state_of(stat: str) -> str:
    """GONE, FROZEN or "running" from a /proc/<pid>/stat line. A killed process closes its sockets, which fails its
    peers' collectives, before it becomes a zombie ("Z", exited, not yet reaped): while exiting (a large process
    under load takes a while) it is gone too."""
    fields = stat.rsplit(")", 1)[1].split()
    letter, flags = fields[0], int(fields[6])
    if letter in "ZX" or flags & PF_EXITING:
        return GONE
    return FROZEN if letter in "Tt" else "running"
