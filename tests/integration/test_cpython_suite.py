"""A real, sizeable third-party test suite passes in a fleet machine wherever it passes in a
plain container: CPython's own regression tests for its OS-facing modules (88 modules: files,
users and groups, sockets, processes, signals, terminals, archives, locales ...), run the way
CPython's developers run them (`python3 -m test -j2`).

The tests come from Debian's `libpython3.11-testsuite` (downloaded with apt once, unpacked,
never installed), merged with the image's own `test` package; the same files are mounted in
both places. The baseline is a plain `bwrap` container run as root (no user namespace, as a
rootful container runtime runs), over a copy of the same image with an `/etc/hosts` and
loopback networking; the fleet machine is a namespace machine from the same image, the tests
given to it as a rollout's inputs are (copied onto its disk, mounted read-only)."""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from fleet.core.smolfile import parse_smolfile
from fleet.runtime.base import ExecResult, MachineSpec
from fleet.runtime.namespace import NamespaceRuntime

pytestmark = pytest.mark.sandbox

MODULES = """
test_os test_posix test_pwd test_grp test_shutil test_tempfile test_socket test_subprocess
test_signal test_pty test_tarfile test_zipfile test_pathlib test_glob test_stat test_getpass
test_locale test_time test_fcntl test_select test_selectors test_mmap test_resource
test_sysconfig test_site test_platform test_posixpath test_genericpath test_fileio test_file
test_filecmp test_fileinput test_fnmatch test_getopt test_hashlib test_threading test_thread
test_socketserver test_httplib test_httpservers test_urllib test_urllib2 test_urllib2_localnet
test_urlparse test_uuid test_mailbox test_shlex test_wsgiref test_xmlrpc test_zipimport
test_zlib test_bz2 test_lzma test_gzip test_compileall test_py_compile test_import test_runpy
test_cmd_line test_cmd_line_script test_sys test_atexit test_faulthandler test_tracemalloc
test_dbm test_shelve test_csv test_json test_calendar test_random test_re test_string
test_struct test_array test_collections test_functools test_contextlib test_exceptions
test_syslog test_netrc test_utf8_mode test_unicode_file test_logging test_tabnanny test_zipapp
test_venv test_pkgutil test_pydoc
""".split()  # noqa: SIM905
TESTS_IN_MACHINE = "/usr/lib/python3.11/test"
CACHE = Path.home() / ".cache" / "fleet" / "cpython-testsuite"
ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
}


def _testsuite() -> Path:
    """Debian's libpython3.11-testsuite, unpacked under CACHE (downloaded once with apt)."""
    unpacked = CACHE / "unpacked"
    if (unpacked / "usr/lib/python3.11/test/test_os.py").exists():
        return unpacked / "usr/lib/python3.11/test"
    CACHE.mkdir(parents=True, exist_ok=True)
    download = ["apt-get", "download", "-q", "libpython3.11-testsuite"]
    done = subprocess.run(download, cwd=CACHE, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:  # (no package lists yet on a fresh machine)
        subprocess.run(["apt-get", "update", "-qq"], check=True, timeout=600)
        done = subprocess.run(download, cwd=CACHE, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    deb = sorted(CACHE.glob("libpython3.11-testsuite_*.deb"))[-1]
    shutil.rmtree(unpacked, ignore_errors=True)
    subprocess.run(["dpkg-deb", "-x", str(deb), str(unpacked)], check=True, timeout=300)
    return unpacked / "usr/lib/python3.11/test"


@pytest.fixture(scope="module")
def suite(rootfs: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The image's own `test` package (regrtest, support) with the suite's modules over it."""
    merged = tmp_path_factory.mktemp("cpython") / "test"
    shutil.copytree(rootfs / TESTS_IN_MACHINE.lstrip("/"), merged, symlinks=True)
    shutil.copytree(_testsuite(), merged, symlinks=True, dirs_exist_ok=True)
    return merged


def passed_modules(output: str) -> set[str]:
    """The modules regrtest reports as passed (its progress lines: `[n/N] test_x passed`)."""
    return set(re.findall(r"\] (test_\w+) passed", output))


def summary(output: str) -> str:
    return output[output.rfind("== Tests result") :][:2000]


def run_in_plain_container(rootfs: Path, suite: Path, work: Path) -> tuple[int, str]:
    root = work / "root"
    subprocess.run(["cp", "-a", f"{rootfs}/.", str(root)], check=True, timeout=600)
    (work / "hosts").write_text("127.0.0.1\tlocalhost\n::1\tlocalhost\n127.0.1.1\tbox\n")
    argv = [
        "bwrap", "--bind", str(root), "/", "--ro-bind", str(suite), TESTS_IN_MACHINE,
        "--ro-bind", str(work / "hosts"), "/etc/hosts", "--proc", "/proc", "--dev", "/dev",
        "--tmpfs", "/tmp", "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
        "--hostname", "box", "--die-with-parent", "--chdir", "/root", "--clearenv",
        *[a for k, v in ENV.items() for a in ("--setenv", k, v)],
        "--", "python3", "-m", "test", "-j2", *MODULES,
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1800, env=ENV, cwd="/")
    return done.returncode, done.stdout + done.stderr


def run_in_fleet_machine(rootfs: Path, suite: Path, work: Path) -> ExecResult:
    async def go() -> ExecResult:
        runtime = NamespaceRuntime(work / "machines")
        spec = MachineSpec(
            name="cpython-suite", smolfile=parse_smolfile('image = "minimal"\n').spec,
            image_digest="sha256:x", rootfs=rootfs, labels={"fleet": "test"},
            inputs=((str(suite), TESTS_IN_MACHINE),),
        )  # fmt: skip
        machine = await runtime.create(spec)
        try:
            return await machine.exec(
                ["python3", "-m", "test", "-j2", *MODULES], workdir="/root", timeout_s=1800,
                max_output_bytes=8 << 20,
            )  # fmt: skip
        finally:
            await machine.delete()

    return asyncio.run(go())


def test_cpythons_own_suite_passes_in_a_machine_wherever_it_passes_in_a_container(
    rootfs: Path, suite: Path, tmp_path: Path
) -> None:
    _, plain = run_in_plain_container(rootfs, suite, tmp_path)
    in_plain = passed_modules(plain)
    assert len(in_plain) >= len(MODULES) - 8, summary(plain)  # the baseline itself is sane
    result = run_in_fleet_machine(rootfs, suite, tmp_path)
    fleet = result.stdout.decode(errors="replace") + result.stderr.decode(errors="replace")
    assert "== Tests result" in fleet, fleet[-3000:]
    only_in_plain = in_plain - passed_modules(fleet)
    assert not only_in_plain, (
        f"fail in a fleet machine but pass in a plain container: {sorted(only_in_plain)}\n"
        f"--- container:\n{summary(plain)}\n--- fleet:\n{summary(fleet)}"
    )
