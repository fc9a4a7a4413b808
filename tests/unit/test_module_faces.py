"""Modules split along their seams keep their public face: `fleet.image.oci` still offers the
references, policy and registry client it was written with, and `fleet.agent.attempt` the
attempt's state and warm planning, `fleet.safepath` the tree and archive operations,
`fleet.runtime.smol` the host checks and `fleet.runtime.warm_child` a child's file helpers, as the
same objects their new modules define (so an `isinstance` or a monkeypatch through either name
sees one thing). Each part stays readable."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

from fleet import safepath, safepath_archive, safepath_paths, safepath_tree
from fleet.agent import attempt, machine_making, running
from fleet.image import oci, registry_client, registry_policy
from fleet.runtime import child_files, smol, smol_preflight, warm_child

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 600

# What the rest of fleet, the tests and the benchmarks reach through each face.
OCI_USED = {
    "Credentials": registry_policy,
    "Reference": registry_policy,
    "RegistryPolicy": registry_policy,
    "looks_like_archive": registry_policy,
    "looks_like_reference": registry_policy,
    "Registry": registry_client,
    "hashed_file": registry_client,
    "OCI_MANIFEST": registry_client,
}
ATTEMPT_USED = {
    "Running": running,
    "Finished": running,
    "parent_key": machine_making,
    "warm_plan": machine_making,
    "with_warm_up": machine_making,
}
SAFEPATH_USED = {
    "ExtractPolicy": safepath_archive,
    "extract_tar": safepath_archive,
    "repack_tar": safepath_archive,
    "copy_tree": safepath_tree,
    "write_tar": safepath_tree,
}
SMOL_USED = {
    name: smol_preflight
    for name in (
        "KVM_DEVICE", "VM_UID_BASE", "VmmIdentity", "boot_id", "canary_boot",
        "kvm_access_verdict", "kvm_group", "sdk_availability", "static_kvm_verdict",
        "vmm_identity",
    )
}  # fmt: skip
WARM_CHILD_USED = {
    name: child_files for name in ("open_beneath", "open_dir_beneath", "read_step_output")
}


@pytest.mark.parametrize(
    ("face", "name", "home"),
    [(oci, n, m) for n, m in OCI_USED.items()]
    + [(attempt, n, m) for n, m in ATTEMPT_USED.items()]
    + [(safepath, n, m) for n, m in SAFEPATH_USED.items()]
    + [(smol, n, m) for n, m in SMOL_USED.items()]
    + [(warm_child, n, m) for n, m in WARM_CHILD_USED.items()],
)
def test_a_moved_name_is_still_offered_by_its_old_module(
    face: ModuleType, name: str, home: ModuleType
) -> None:
    assert name in face.__all__
    assert getattr(face, name) is getattr(home, name)


def test_every_name_a_face_declares_is_there() -> None:
    for face in (
        oci,
        attempt,
        safepath,
        safepath_archive,
        safepath_paths,
        safepath_tree,
        smol,
        warm_child,
    ):
        missing = [n for n in face.__all__ if not hasattr(face, n)]
        assert missing == [], f"{face.__name__} declares but lacks {missing}"


def test_the_image_operations_stay_in_oci() -> None:
    for name in ("push", "resolve", "fetch", "layer_of", "pull_layer", "image_manifest"):
        assert getattr(oci, name).__module__ == "fleet.image.oci"


def test_the_path_operations_are_offered_by_safepath() -> None:
    # The walking, and the bounds and errors every part takes and raises, are defined in one
    # part, below the other two, and offered by the face.
    for name in (
        "open_dir", "open_file", "read_bytes", "write_bytes", "remove", "chmod", "member_name",
        "Limits", "UnsafePath", "UnsafeArchive",
    ):  # fmt: skip
        assert getattr(safepath, name) is getattr(safepath_paths, name)
        assert getattr(safepath_paths, name).__module__ == "fleet.safepath_paths"
    assert safepath_paths._Chain.__module__ == "fleet.safepath_paths"


def test_the_preflight_verdict_stays_in_smol() -> None:
    # (it calls each check through smol's own names, which the runtime's tests replace)
    assert smol.preflight.__module__ == "fleet.runtime.smol"


def test_an_attempt_makes_its_machine_through_its_base() -> None:
    assert issubclass(attempt.Attempt, machine_making.MachineMaking)
    # The base only declares how an early end is reported; the attempt gives it.
    assert attempt.Attempt._ended is not machine_making.MachineMaking._ended


@pytest.mark.parametrize(
    "module",
    [
        "fleet/image/oci.py",
        "fleet/image/registry_client.py",
        "fleet/image/registry_policy.py",
        "fleet/agent/attempt.py",
        "fleet/agent/machine_making.py",
        "fleet/agent/running.py",
        "fleet/safepath.py",
        "fleet/safepath_paths.py",
        "fleet/safepath_archive.py",
        "fleet/safepath_tree.py",
        "fleet/runtime/smol.py",
        "fleet/runtime/smol_preflight.py",
        "fleet/runtime/warm_child.py",
        "fleet/runtime/child_files.py",
    ],
)
def test_the_split_modules_stay_readable(module: str) -> None:
    lines = len((ROOT / module).read_text().splitlines())
    assert lines <= MAX_LINES, f"{module}: {lines} lines; split it along a seam"
