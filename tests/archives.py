"""Hostile tar archives for a sandbox's ``load_files``: each tries to put a file named ``marker`` outside the
directory it is extracted into, or to make something other than a file, a directory or a symlink."""

from __future__ import annotations

import io
import tarfile


def _tar(*members: tuple[tarfile.TarInfo, bytes]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as archive:
        for info, data in members:
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data) if data else None)
    return out.getvalue()


def _member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, link, 0o644
    return info


def hostile_archives(marker: str) -> dict[str, bytes]:
    """Each attack by name: its archive, which names ``marker`` where a successful attack would write it in /tmp.
    Each starts with a harmless file, ``before``, which a refused archive must not leave behind either."""
    attacks: dict[str, list[tuple[tarfile.TarInfo, bytes]]] = {
        "climbs out with ..": [(_member(f"../../../../../../tmp/{marker}"), b"x")],
        "an absolute name": [(_member(f"/tmp/{marker}"), b"x")],
        "a symlink out, then a file through it": [(_member("out", tarfile.SYMTYPE, "/tmp"), b""),
                                                  (_member(f"out/{marker}"), b"x")],
        "a symlink up, then a file through it": [(_member("up", tarfile.SYMTYPE, "../../../../../../tmp"), b""),
                                                 (_member(f"up/{marker}"), b"x")],
        "a hard link to a host file": [(_member(marker, tarfile.LNKTYPE, "/etc/passwd"), b"")],
        "a device": [(_member(marker, tarfile.CHRTYPE), b"")],
        "a fifo": [(_member(marker, tarfile.FIFOTYPE), b"")],
    }
    return {name: _tar((_member("before"), b"harmless"), *members) for name, members in attacks.items()}


def setuid_archive() -> bytes:
    """One file, ``tool``, with the setuid and setgid bits set."""
    info = _member("tool")
    info.mode = 0o6755
    return _tar((info, b"#!/bin/sh\nid\n"))
