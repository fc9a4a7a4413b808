"""Shared fixtures: the real image store, a SQLite ledger, an in-process server and agents."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import structlog

from fleet.config import Paths
from fleet.image.store import ImageStore
from fleet.ledger.store import Ledger
from tests import sandbox
from tests.pgserver import create_database, drop_database, postgres_server

REPO = Path(__file__).resolve().parent.parent
SMOLFILES = REPO / "smolfiles"


def _mounts_under(root: Path) -> set[str]:
    prefix = f"{root}/"
    with open("/proc/mounts") as mounts:
        points = [line.split()[1] for line in mounts]
    # (/proc/mounts writes a space in a path as \040)
    return {p.replace("\\040", " ") for p in points if p.startswith(prefix)}


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test marked `sandbox` is skipped, saying why, where no namespace sandbox can be made
    (not root, no bubblewrap, no cgroups, namespaces denied); the rest run on the in-memory
    runtime anywhere. Whether the test is marked is recorded for the harness
    (`tests.sandbox.require_marked`)."""
    marked = item.get_closest_marker(sandbox.MARKER) is not None
    sandbox.entered(marked)
    if marked and (why := sandbox.unavailable()) is not None:
        pytest.skip(f"real sandboxes: {why}")


def pytest_runtest_teardown(item: pytest.Item) -> None:
    sandbox.left()


CHATTY = ("sqlalchemy", "alembic", "urllib3", "httpx", "httpcore", "asyncio")


@pytest.fixture(autouse=True)
def logging_left_as_found() -> Iterator[None]:
    """A test that runs the command line in-process (`fleet.cli.main.main`) has it configure
    logging for the process: a level filter on structlog, a handler on the root logger. Left
    so, every later test that captures info events (`structlog.testing.capture_logs`) would
    see none: logging is put back as the test found it."""
    saved = structlog.get_config()
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    chatty = {name: logging.getLogger(name).level for name in CHATTY}
    yield
    structlog.configure(**saved)
    root.handlers[:] = handlers
    root.setLevel(level)
    for name, was in chatty.items():
        logging.getLogger(name).setLevel(was)


@pytest.fixture(autouse=True)
def nothing_left_mounted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A test leaves nothing mounted under the tests' temporary directories (a machine's
    disk, say): what it left is unmounted, and the test fails naming it. Left there, it would
    hold a loop device for good and fail every later run on the machine, whose clean-up of old
    temporary directories cannot remove it."""
    root = tmp_path_factory.getbasetemp()
    before = _mounts_under(root)
    yield
    left = sorted(_mounts_under(root) - before)
    for point in reversed(left):  # (the deepest first)
        subprocess.run(["umount", "--lazy", point], capture_output=True, timeout=60)
    assert not left, f"the test left mounted: {', '.join(left)}"


@pytest.fixture(scope="session")
def paths() -> Paths:
    return Paths.from_env()


@pytest.fixture(scope="session")
def images(paths: Paths) -> ImageStore:
    store = ImageStore(paths.images, paths.recipes)
    if store.record("minimal") is None:
        pytest.fail("the default image is not built: run scripts/setup (scripts/test does)")
    return store


@pytest.fixture(scope="session")
def rootfs(images: ImageStore) -> Path:
    record = images.record("minimal")
    assert record is not None
    return images.rootfs(record.digest)


@pytest.fixture(scope="session")
def postgres() -> Iterator[str]:
    """One real PostgreSQL server for the session (loopback only), stopped at the end."""
    with postgres_server() as url:
        yield url


@pytest.fixture(params=["sqlite", "postgres"])
def ledger_target(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """Where a fresh ledger lives: a SQLite file, or a new database on the test server."""
    if request.param == "sqlite":
        yield str(tmp_path / "ledger.sqlite3")
        return
    server: str = request.getfixturevalue("postgres")
    url = create_database(server)
    yield url
    drop_database(server, url)


@pytest.fixture
def ledger(ledger_target: str) -> Iterator[Ledger]:
    """The contract suite runs against every backend: SQLite and PostgreSQL."""
    led = Ledger.open(ledger_target)
    yield led
    led.engine.dispose()


@contextlib.asynccontextmanager
async def running(awaitables: list[asyncio.Task[None]]) -> AsyncIterator[None]:
    try:
        yield
    finally:
        for task in awaitables:
            task.cancel()
        await asyncio.gather(*awaitables, return_exceptions=True)
