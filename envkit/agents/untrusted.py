"""Run untrusted code (model-written programs, graded submissions) so that nothing it starts outlives the run.

:func:`run` starts a command in a session of its own, with a deadline and capped output. Where this process may
switch users (root holding CAP_SETUID, CAP_SETGID and CAP_KILL, as the server in an env image from ``envkit build``
does), pass ``user=``: the command runs as that uid, and when it ends or times out every process of that uid is
stopped and killed, whatever sessions, process groups or daemons it made. Running as another uid, it also cannot
read files only its caller may read (an env image keeps the env packages, hidden tests included, readable by root
only), nor signal, trace or read ``/proc/PID/environ`` / ``mem`` of its caller.

Without that privilege (a plain user on a laptop) ``user`` must be None, and only the command's process group is
killed: a process that calls ``setsid()`` escapes it. That is why envs that grade code run only in containers.

Env authors grading untrusted code do::

    async with untrusted.users.lease() as uid:  # None where users cannot be switched
        result = await untrusted.run([untrusted.python(), "-I", "-c", RUNNER], stdin=job, user=uid, timeout_s=5)
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from typing import IO, Any

from envkit.errors import SnapshotError

EXEC_USER_ENV = "ENVKIT_EXEC_USER"
"""Where ``envkit serve`` reads its default ``--exec-user`` (sandbox containers set it)."""
SAFE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/tmp"}
"""The environment untrusted commands get unless the caller passes one: nothing of the caller's (no tokens)."""
_CAP_KILL, _CAP_SETGID, _CAP_SETUID = 5, 6, 7
UID_LOCK_DIR = "/tmp/envkit-uids"
"""Where uid leases are locked: one fixed path, whatever each process's TMPDIR, so every process of the host sees it."""
_KILL_DEADLINE_S = 5.0
_READ_AFTER_KILL_S = 1.0
_STATUS_FIELDS = re.compile(rb"\nState:\s+(\S).*?\nUid:\s+(\d+)", re.DOTALL)


@dataclass(frozen=True)
class RunResult:
    """What one untrusted command produced."""

    stdout: bytes
    stderr: bytes
    exit_code: int
    """The command's exit status; -1 when it was killed at its deadline."""
    timed_out: bool
    truncated: bool
    """True when stdout or stderr went past ``output_limit`` and was cut."""
    duration_s: float

    def decoded(self) -> dict[str, Any]:
        """These fields with stdout and stderr as text (UTF-8, undecodable bytes replaced): ``/exec``'s answer."""
        return {**asdict(self), "stdout": self.stdout.decode(errors="replace"),
                "stderr": self.stderr.decode(errors="replace")}


def can_switch_user() -> bool:
    """True when this process may run commands as other uids and kill them (root with SETUID, SETGID, KILL)."""
    if os.geteuid() != 0:
        return False
    try:
        with open("/proc/self/status") as f:
            effective = next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))
    except (OSError, StopIteration, ValueError):
        return False
    return all(effective >> bit & 1 for bit in (_CAP_KILL, _CAP_SETGID, _CAP_SETUID))


def python() -> str:
    """The interpreter for untrusted Python: the system's ``python3`` (on :data:`SAFE_ENV`'s PATH), which has none
    of this venv's packages and which other uids may run; this venv's base interpreter where there is none."""
    return shutil.which("python3", path=SAFE_ENV["PATH"]) or os.path.realpath(sys.executable)


class UserPool:
    """Uids handed out one lease at a time across every process of the host, so no two concurrent runs share one
    (and kill, signal or read each other's processes and files).

    A lease holds an exclusive ``flock`` on the uid's file in ``lock_dir``. The kernel drops it when the lease ends or
    its holder dies, however it dies, so a pool per process (xdist workers, Ray env workers, an ``envkit serve``
    child that runs code tools of its own) never hands out a uid another holds. A new lease first kills whatever a
    dead holder left running as its uid."""

    def __init__(self, first: int = 20000, count: int = 1000, lock_dir: str = UID_LOCK_DIR) -> None:
        self._uids = range(first, first + count)
        self._lock_dir = lock_dir
        self._start = 0  # where the next search begins: spread over the range, not retry the same held uids

    @asynccontextmanager
    async def lease(self) -> AsyncIterator[int | None]:
        """A uid of its own for the block (None where users cannot be switched); its processes die at the end."""
        if not can_switch_user():
            yield None
            return
        uid, lock = self._acquire()
        try:
            kill_user(uid)
            yield uid
        finally:
            try:
                kill_user(uid)  # inline for the reason given in _kill_all
            finally:
                os.close(lock)

    def _acquire(self) -> tuple[int, int]:
        """The first uid from the search start whose lock this call takes, with the lock's descriptor."""
        directory = _private_dir(self._lock_dir)
        for step in range(len(self._uids)):
            index = (self._start + step) % len(self._uids)
            lock = os.open(os.path.join(directory, str(self._uids[index])), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                           0o600)
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(lock)
                continue
            self._start = index + 1
            return self._uids[index], lock
        raise RuntimeError("every uid of the pool is leased; too many untrusted runs at once")


def _private_dir(path: str) -> str:
    """``path`` as a directory only this process's user may write (made if missing), or an error saying why not."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise RuntimeError(f"{path} must be a directory of uid {os.getuid()} that no one else may write: a uid "
                           f"lease there would be open to whoever made it")
    return path


users = UserPool()
"""This process's pool of uids for untrusted runs (a lease is exclusive across the host)."""


async def run(argv: Sequence[str], *, stdin: bytes = b"", timeout_s: float = 10.0, output_limit: int = 64 * 1024,
              user: int | None = None, cwd: str | None = None, env: Mapping[str, str] | None = None,
              switch_user: bool = True) -> RunResult:
    """Run ``argv`` with ``stdin``; killed at ``timeout_s`` along with everything it started (see the module doc).
    ``cwd`` is entered before the switch to ``user``, so this process must be able to enter it. With
    ``switch_user=False``, ``argv`` switches to ``user`` itself (after setting up namespaces as root); every process
    of ``user`` is still killed at the end."""
    if not argv or not all(isinstance(a, str) for a in argv):
        raise ValueError(f"run needs a non-empty argv of str, got {argv!r}")
    started = time.monotonic()
    # subprocess.Popen, not the loop's subprocess API: CPython spawns with vfork, uvloop (the server's loop) with
    # fork, which costs milliseconds in a large process. Both pipes and the exit are then awaited on the loop.
    proc = subprocess.Popen(  # noqa: ASYNC220 (vfork and exec: well under a millisecond)
        _as_user(user if switch_user else None, argv), stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd, env=dict(SAFE_ENV if env is None else env),
        start_new_session=True)
    assert proc.stdout is not None and proc.stderr is not None
    out, err = _Captured(output_limit), _Captured(output_limit)
    readers = [asyncio.ensure_future(_read_into(p, kept)) for p, kept in ((proc.stdout, out), (proc.stderr, err))]
    writer = asyncio.ensure_future(_feed(proc.stdin, stdin)) if proc.stdin is not None else None
    timed_out = False
    try:
        async with asyncio.timeout(timeout_s):
            await _exited(proc.pid)
    except TimeoutError:
        timed_out = True
    finally:
        await asyncio.shield(_kill_all(proc, user))
        if writer is not None:
            writer.cancel()
    # With every process of the uid gone the pipes are closed; without a uid, a process that left the group may
    # still hold them, so the reads get a moment, then what came is what there is.
    _, pending = await asyncio.wait(readers, timeout=_READ_AFTER_KILL_S)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    code = -1 if timed_out or proc.returncode is None else proc.returncode
    return RunResult(bytes(out.kept), bytes(err.kept), code, timed_out, out.cut or err.cut,
                     time.monotonic() - started)


@functools.cache
def setpriv_path() -> str | None:
    """util-linux ``setpriv``, where it is installed (looked up once: commands start on hot paths)."""
    return shutil.which("setpriv", path=SAFE_ENV["PATH"])


def _as_user(uid: int | None, argv: Sequence[str]) -> list[str]:
    """``argv`` run as ``uid`` with no groups and no way to gain privileges. util-linux ``setpriv``, not
    ``Popen(user=)``, with which CPython forks instead of using vfork."""
    if uid is None:
        return list(argv)
    setpriv = setpriv_path()
    if setpriv is None:
        raise FileNotFoundError("running code as another user needs setpriv (util-linux)")
    return [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs", "--", *argv]


async def _exited(pid: int) -> None:
    """Until process ``pid`` exits. Not ``Process.wait()``: that also waits for its pipes, which a child it left
    behind may hold open."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return  # already reaped
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    loop.add_reader(pidfd, lambda: done.done() or done.set_result(None))
    try:
        await done
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)


async def _feed(pipe: IO[bytes], data: bytes) -> None:
    """Write ``data`` to the child's stdin without blocking the loop, then close it."""
    transport, protocol = await asyncio.get_running_loop().connect_write_pipe(
        lambda: asyncio.StreamReaderProtocol(asyncio.StreamReader()), pipe)
    writer = asyncio.StreamWriter(transport, protocol, None, asyncio.get_running_loop())
    try:
        with contextlib.suppress(ConnectionError):
            writer.write(data)
            await writer.drain()
    finally:
        transport.close()


@dataclass
class _Captured:
    """What a pipe gave so far: up to ``limit`` bytes, and whether more came (held by the caller, so a read cut off
    at the deadline still returns what it read)."""

    limit: int
    kept: bytearray = field(default_factory=bytearray)
    cut: bool = False


async def _read_into(pipe: IO[bytes], captured: _Captured) -> None:
    """Read ``pipe`` to its end into ``captured``; past its limit the rest is read and dropped, so the writer never
    blocks on a full pipe."""
    stream = asyncio.StreamReader()
    transport, _ = await asyncio.get_running_loop().connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(stream), pipe)
    try:
        while chunk := await stream.read(1 << 16):
            room = captured.limit - len(captured.kept)
            captured.kept += chunk[:max(room, 0)]
            captured.cut = captured.cut or len(chunk) > room
    finally:
        transport.close()


async def _kill_all(proc: subprocess.Popen[bytes], user: int | None) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    if user is not None:
        # Inline, not in a worker thread: a fork bomb may have taken every pid, so no thread could start. The scan
        # takes a few milliseconds in a container.
        kill_user(user)
    await _exited(proc.pid)
    proc.wait()  # it has exited: this only reaps it


def kill_user(uid: int) -> int:
    """SIGKILL every process whose real uid is ``uid``. Those a scan of /proc sees are stopped first, so none can fork
    while they die; then ``kill(-1)`` as the uid itself, which the kernel carries out under the lock a fork takes,
    gets any process a scan cannot see: a child forked after the scan read /proc's listing, whose parent exited
    before the scan read its status. Returns how many the scans saw; raises RuntimeError if some are still alive
    after a few seconds."""
    if uid == 0 or uid == os.getuid():
        raise ValueError(f"refusing to kill every process of uid {uid}: it is this process's own or root's")
    deadline = time.monotonic() + _KILL_DEADLINE_S
    killed = _kill_seen(uid, deadline)
    _kill_as(uid)
    return len(killed | _kill_seen(uid, deadline))


def _kill_seen(uid: int, deadline: float) -> set[int]:
    """Stop, then SIGKILL, the processes of ``uid`` a scan sees, until a scan sees none; the pids killed."""
    killed: set[int] = set()
    while pids := processes_of(uid):
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            if sig is signal.SIGSTOP:  # children forked between the scan and the stop: stop them too
                while (late := processes_of(uid, running_only=True)) and time.monotonic() < deadline:
                    for pid in late:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGSTOP)
                    pids = sorted({*pids, *late})
        killed.update(pids)
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes of uid {uid} survived SIGKILL for {_KILL_DEADLINE_S:g} s: {pids}")
        time.sleep(0.001)  # SIGKILL is delivered asynchronously: let the kernel finish them before the next scan
    return killed


def _kill_as(uid: int) -> None:
    """``kill(-1, SIGKILL)`` run as ``uid`` (the shell's builtin ``kill``, under setpriv: minbase images have no
    kill binary), which signals every process of the uid but itself, atomically with respect to forks. A few
    milliseconds, inline for the reason :func:`_kill_all` gives."""
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):  # no pid to start it: the scan went first
        subprocess.run(_as_user(uid, ["/bin/sh", "-c", "kill -KILL -1"]), stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(SAFE_ENV), timeout=5)


def processes_of(uid: int | None, *, running_only: bool = False) -> list[int]:
    """Live (not zombie) processes whose real uid is ``uid`` (None: any); with ``running_only``, those not stopped."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status", "rb") as f:
                fields = _STATUS_FIELDS.search(f.read(1024))  # State and Uid are in the first 10 lines
        except OSError:
            continue  # gone meanwhile
        if fields is None:
            continue
        state, real_uid = fields[1], int(fields[2])
        if state in b"ZX" or (uid is not None and real_uid != uid) or (running_only and state in b"Tt"):
            continue
        found.append(int(entry.name))
    return found


def process_start_ticks(pid: int) -> int:
    """When ``pid`` started (clock ticks since boot, from /proc), so a reused pid is not taken for its owner; 0 if
    it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # The command name (field 2) may hold spaces and parentheses: split after its closing one.
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return 0


def owner_tag() -> str:
    """This process as ``PID:START``: what :func:`kill_orphans` finds in the environment of processes it started."""
    return f"{os.getpid()}:{process_start_ticks(os.getpid())}"


def kill_orphans(variable: str) -> int:
    """SIGKILL this uid's processes whose environment sets ``variable`` to the :func:`owner_tag` of a process that
    is gone: what an owner killed with no chance to clean up (SIGKILL, OOM) left running. Returns how many."""
    killed = 0
    marker = f"{variable}=".encode()
    for pid in processes_of(os.getuid()):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read()
        except OSError:
            continue  # gone, or not ours to read
        tag = next((v[len(marker):] for v in environ.split(b"\0") if v.startswith(marker)), None)
        owner, _, start = (tag or b"").decode(errors="replace").partition(":")
        if not (owner.isdigit() and start.isdigit()) or process_start_ticks(int(owner)) == int(start):
            continue
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            killed += 1
    return killed


def _parent(pid: int) -> int | None:
    """The parent pid of ``pid`` as this PID namespace sees it (0: outside it), None if it is gone."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            found = re.search(rb"\nPPid:\s+(\d+)", f.read(1024))
    except OSError:
        return None
    return int(found[1]) if found else None


async def remove_files(uid: int, *dirs: str) -> None:
    """Delete what ``uid`` owns under ``dirs`` (its processes must be gone), as ``uid`` itself; directories it
    locked (``chmod 000``) are opened first."""
    script = ('find "$@" -mindepth 1 -user "$0" -type d -exec chmod u+rwx {} \\; ;'
              ' find "$@" -mindepth 1 -user "$0" -delete')
    await run(["sh", "-c", script, str(uid), *dirs], user=uid, timeout_s=30)


ARCHIVE_LIMIT = 128 << 20
"""The largest archive of a directory's files that :func:`pack` writes and :func:`unpack` takes."""
_PACK = """
import os, sys, tarfile
with tarfile.open(fileobj=sys.stdout.buffer, mode="w|") as archive:
    for name in sorted(os.listdir(".")):
        archive.add(name, filter=lambda m: m if m.isfile() or m.isdir() or m.issym() else None)
"""
# Python 3.11.2 (Debian's, in the env images) has no tarfile extraction filters: the members are checked here. A
# name or link that is absolute or climbs with ".." is refused, as is anything but files, directories and symlinks,
# so whatever the archive holds lands under the directory (symlinks that never leave it cannot lead out of it). All
# members are checked before the first is written: a refused archive writes nothing.
_UNPACK = """
import io, os, sys, tarfile
dirs = []
with tarfile.open(fileobj=io.BytesIO(sys.stdin.buffer.read()), mode="r:") as archive:
    members = archive.getmembers()
    for m in members:
        names = [m.name] + ([m.linkname] if m.issym() else [])
        if any(n.startswith("/") or ".." in n.split("/") for n in names) or not (m.isfile() or m.isdir() or m.issym()):
            sys.exit(f"refused archive member {m.name!r}: only files, directories and symlinks inside the directory")
    for m in members:
        m.mode &= 0o777
        m.uid, m.gid, m.uname, m.gname = os.getuid(), os.getgid(), "", ""
        if m.isdir():
            dirs.append((m.name, m.mode))
            m.mode = 0o700
        archive.extract(m, ".")
for name, mode in reversed(dirs):
    os.chmod(name, mode)
"""


async def pack(directory: str, *, user: int | None) -> bytes:
    """The files, directories and symlinks under ``directory`` as an uncompressed tar, read as ``user``
    (SnapshotError when it cannot be read whole or is over :data:`ARCHIVE_LIMIT`); empty bytes for an empty one."""
    if not os.listdir(directory):
        return b""
    result = await run([python(), "-I", "-c", _PACK], user=user, cwd=directory, timeout_s=60,
                       output_limit=ARCHIVE_LIMIT)
    if result.exit_code or result.truncated:
        why = f"over {ARCHIVE_LIMIT} bytes" if result.truncated else result.stderr.decode(errors="replace")[-500:]
        raise SnapshotError(f"the files in {directory} could not be archived: {why}")
    return result.stdout


async def unpack(directory: str, archive: bytes, *, user: int | None) -> None:
    """Extract an archive :func:`pack` made into ``directory`` as ``user``; SnapshotError for one that is not such
    a tar (a member that would land outside ``directory``, a device, a link to elsewhere)."""
    if len(archive) > ARCHIVE_LIMIT:
        raise SnapshotError(f"an archive of {len(archive)} bytes is over the limit of {ARCHIVE_LIMIT}")
    if not archive:
        return
    result = await run([python(), "-I", "-c", _UNPACK], stdin=archive, user=user, cwd=directory, timeout_s=60)
    if result.exit_code:
        raise SnapshotError(f"the archive was not extracted into {directory}: "
                            f"{result.stderr.decode(errors='replace').strip()[-500:]}")


class Workspace:
    """A uid and a directory for untrusted commands run one at a time (what ``envkit serve --exec-user`` serves):
    files persist between commands, processes never do; :meth:`scrub` empties it for the next user.

    This process enters the directory before switching users, so it must be able to: env images make it root's,
    group ``user``, mode 0770, which also keeps the user from locking it (``chmod 000``) for the next lease."""

    def __init__(self, user: int, workdir: str) -> None:
        if not can_switch_user():
            raise PermissionError("running commands as another user needs root with CAP_SETUID, CAP_SETGID and "
                                  "CAP_KILL (a DockerSandbox's container has them)")
        if user == 0:
            raise ValueError("the exec user must not be root")
        self.user, self.workdir = user, workdir
        self._lock = asyncio.Lock()

    async def run(self, argv: Sequence[str], *, stdin: bytes = b"", timeout_s: float = 10.0,
                  output_limit: int = 64 * 1024) -> RunResult:
        """Run ``argv`` in the workspace; everything it started is dead when this returns."""
        async with self._lock:
            return await run(argv, stdin=stdin, timeout_s=timeout_s, output_limit=output_limit, user=self.user,
                             cwd=self.workdir, env={**SAFE_ENV, "HOME": self.workdir})

    async def scrub(self) -> tuple[list[int], list[str]]:
        """Kill the user's processes, delete its files in the workspace and /tmp; returns what is left: processes
        other than this one and init, and up to 20 paths the user still owns."""
        async with self._lock:
            await self._clear()
            # What a lease can leave is what its uid owns: /tmp may hold other users' files (on a host, plenty).
            listing = await run(["find", self.workdir, "/tmp", "-mindepth", "1", "-user", str(self.user)],
                                user=self.user, timeout_s=5)
        # Not a lease's leftovers: this server, and init and what the container engine starts from outside (its
        # HEALTHCHECK probe, `docker exec`), whose parent is outside this PID namespace (PPid 0). A lease's processes
        # descend from this server and are reparented to init, never to 0.
        others = [pid for pid in processes_of(None) if pid != os.getpid() and _parent(pid) not in (0, None)]
        return others, listing.stdout.decode(errors="replace").splitlines()[:20]

    async def pack(self) -> bytes:
        """The workspace's files as a tar (see :func:`pack`), read as the user."""
        async with self._lock:
            return await pack(self.workdir, user=self.user)

    async def unpack(self, archive: bytes) -> None:
        """Kill the user's processes, delete its files in the workspace and /tmp (:meth:`pack` saves only the
        workspace), and write ``archive``'s files into the workspace as the user."""
        async with self._lock:
            await self._clear()
            await unpack(self.workdir, archive, user=self.user)

    async def _clear(self) -> None:
        """Kill the user's processes and delete its files in the workspace and /tmp (the lock held)."""
        kill_user(self.user)  # inline for the reason given in _kill_all
        await remove_files(self.user, self.workdir, "/tmp")
