"""The harness's runtime is its constructor's choice: the in-memory one unless a test asks for
real sandboxes, which only a test marked `sandbox` may do (and which is skipped, saying why,
where no sandbox can be made)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fleet.api.pb import types_pb2
from fleet.core.placement import HostClass
from fleet.image.store import ImageStore
from fleet.runtime.namespace import NamespaceRuntime
from fleet.testing import FakeRuntime
from tests import conftest, sandbox
from tests.integration.harness import harness, namespace_runtime, request

PRINT = ["python3", "-c", "print(6 * 7)"]


async def test_a_harness_built_without_a_runtime_runs_its_agents_in_memory(
    tmp_path: Path, images: ImageStore
) -> None:
    async with harness(tmp_path, images) as h:
        agent = await h.start_agent("cpu-a", HostClass.CPU)
        other = await h.start_agent("cpu-b", HostClass.CPU)
        rid = (await h.fleet.SubmitRollout(request('image = "minimal"\n', PRINT))).rollout.id
        done = await h.wait_final(rid)

    assert isinstance(agent.runtime, FakeRuntime) and isinstance(other.runtime, FakeRuntime)
    assert agent.runtime is not other.runtime  # each agent has a runtime of its own
    assert done.state == types_pb2.ROLLOUT_STATE_SUCCEEDED
    # The fake's default script answers with the code's last line: nothing ran Python.
    assert done.results[-1].stdout == b"print(6 * 7)"
    ran = [c for c in (agent.runtime.calls + other.runtime.calls) if c[0] == "exec"]
    assert ("exec", ran[0][1], tuple(PRINT)) in ran


async def test_the_namespace_runtime_is_refused_to_a_test_not_marked_sandbox(
    tmp_path: Path, images: ImageStore
) -> None:
    async with harness(tmp_path, images, runtime=namespace_runtime) as h:
        with pytest.raises(AssertionError, match=r"must carry @pytest\.mark\.sandbox"):
            await h.start_agent("cpu-a", HostClass.CPU)
        assert not h.agents


@pytest.mark.sandbox
async def test_a_harness_asked_for_the_namespace_runtime_runs_real_sandboxes(
    tmp_path: Path, images: ImageStore
) -> None:
    async with harness(tmp_path, images, runtime=namespace_runtime) as h:
        agent = await h.start_agent("cpu-a", HostClass.CPU)
        rid = (await h.fleet.SubmitRollout(request('image = "minimal"\n', PRINT))).rollout.id
        done = await h.wait_final(rid)

    assert isinstance(agent.runtime, NamespaceRuntime)
    assert done.state == types_pb2.ROLLOUT_STATE_SUCCEEDED, done.error
    assert done.results[-1].stdout == b"42\n"


def test_the_sandbox_check_says_root_is_needed_where_it_is_not_root(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Not root: the check says so first (and asks nothing further of the host)."""
    sandbox.unavailable.cache_clear()
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    try:
        assert sandbox.unavailable() == (
            "needs root (cgroups, network namespaces and loop-mounted disks)"
        )
    finally:
        sandbox.unavailable.cache_clear()


class _Marked:
    """A test item as conftest's setup hook sees it: one that carries the marker."""

    def get_closest_marker(self, name: str) -> pytest.Mark | None:
        return pytest.mark.sandbox.mark if name == sandbox.MARKER else None


def test_a_sandbox_test_is_skipped_saying_why_where_no_sandbox_can_be_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sandbox, "unavailable", lambda: "needs root (a stand-in reason)")
    with pytest.raises(pytest.skip.Exception, match=r"real sandboxes: needs root \(a stand-in"):
        conftest.pytest_runtest_setup(_Marked())  # type: ignore[arg-type]
