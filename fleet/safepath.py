"""Host-side file operations on trees a tenant controls, none of which can reach outside them.

A tenant hands fleet archives (inputs, image layers, outputs made inside a machine) and trees
(a machine's root, a fork's copy). The agent and the client work on those as root or as the
user who runs them, so a tenant-made symlink, a `..` or an absolute name must never make them
touch a path beyond the tree. Every operation here works relative to a root directory (a path
fleet chose, or an open directory fd) and walks one component at a time with
`os.open(name, O_NOFOLLOW | O_DIRECTORY, dir_fd=parent)`: a symlink anywhere on the way is
refused, not followed, and a tree that changes while it is walked (a running machine swapping a
directory for a link) cannot redirect the walk, because each step starts from an fd already
held.

Archives are unpacked by fleet's own code, not `tarfile.extractall`: its `data` filter resolves
names against the host's file system and was bypassable on CPython releases before the mid-2025
fix (a symlink chain past PATH_MAX, then a hard link through it). Here `tarfile` only parses
headers; every name is normalised lexically, symlinks are created and never followed, hard
links name only regular files this archive already placed, and device nodes, setuid bits and
owners are kept only when the policy says so.

Refusals raise `UnsafePath` or `UnsafeArchive` (both `InvalidArgument`) with a message naming
the member or path and why; errors of the host itself (a full disk) stay `OSError`.

This module is the face the rest of fleet names every such operation through
(`safepath.<name>`); the code is in three parts below it: `fleet.safepath_paths` walks and
works on one path, `fleet.safepath_tree` copies a tree and writes one as a tar, and
`fleet.safepath_archive` unpacks and repacks a tar.
"""

from __future__ import annotations

from fleet.safepath_archive import ExtractPolicy, extract_tar, repack_tar
from fleet.safepath_paths import (
    Limits,
    UnsafeArchive,
    UnsafePath,
    chmod,
    member_name,
    open_dir,
    open_file,
    read_bytes,
    remove,
    write_bytes,
)
from fleet.safepath_tree import copy_tree, write_tar

__all__ = [
    "ExtractPolicy", "Limits", "UnsafeArchive", "UnsafePath", "chmod", "copy_tree",
    "extract_tar", "member_name", "open_dir", "open_file", "read_bytes", "remove",
    "repack_tar", "write_bytes", "write_tar",
]  # fmt: skip
