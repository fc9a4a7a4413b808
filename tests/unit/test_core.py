"""Pure decisions: submissions, manifests, routing, lifecycle, retry backoff."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

import pytest

from fleet.core.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from fleet.core.lifecycle import FINAL_STATES, TRANSITIONS, RolloutState, check_transition
from fleet.core.manifest import (
    MAX_STEPS,
    Step,
    SubmitRequest,
    Versions,
    build_manifest,
    validate_request,
)
from fleet.core.placement import (
    HostCapabilities,
    HostClass,
    Isolation,
    Requirements,
    RuntimeKind,
    host_class_for,
    refusal,
    unservable_reason,
)
from fleet.core.retry import RetryPolicy
from fleet.core.smolfile import parse_smolfile

NOW = datetime(2026, 1, 1, tzinfo=UTC)
SMOL = 'image = "minimal"\n'


def request(**kw: object) -> SubmitRequest:
    base: dict[str, object] = {
        "idempotency_key": "k",
        "smolfile": SMOL,
        "steps": (Step(argv=("true",)),),
    }
    base.update(kw)
    return SubmitRequest.model_validate(base)


def host(
    host_class: HostClass, isolation: Isolation = Isolation.NAMESPACE, cuda: int = 0
) -> HostCapabilities:
    return HostCapabilities(
        host_id=f"{host_class}-{isolation}-{cuda}",
        host_class=host_class,
        runtime=RuntimeKind.NAMESPACE,
        isolation=isolation,
        cpus=2,
        memory_mib=1024,
        cuda_devices=cuda,
    )


@pytest.mark.parametrize(
    ("kw", "error", "text"),
    [
        ({"steps": ()}, InvalidArgument, "no steps"),
        ({"steps": (Step(argv=()),)}, InvalidArgument, "step 0: argv is empty"),
        ({"steps": (Step(argv=("",)),)}, InvalidArgument, "argv[0] (the program) is empty"),
        (
            {"steps": (Step(argv=("x",), timeout_s=0),)},
            InvalidArgument,
            "timeout_s must be positive",
        ),
        ({"steps": (Step(argv=("x",), workdir="rel"),)}, InvalidArgument, "not an absolute path"),
        ({"deadline": NOW - timedelta(seconds=1)}, InvalidArgument, "is in the past"),
        ({"idempotency_key": " "}, InvalidArgument, "idempotency_key is empty"),
        ({"smolfile": "cpu = 1\n"}, InvalidArgument, "unknown key 'cpu'"),
        (
            {"steps": tuple(Step(argv=("x",)) for _ in range(MAX_STEPS + 1))},
            ResourceExhausted,
            "steps",
        ),
        ({"steps": (Step(argv=("x" * 300_000,)),)}, ResourceExhausted, "over the"),
    ],
)
def test_bad_submissions_are_refused(
    kw: dict[str, object], error: type[Exception], text: str
) -> None:
    """Each malformed submission is refused with a message saying what is wrong."""
    with pytest.raises(error) as info:
        validate_request(request(**kw), NOW)
    assert text in str(info.value)


def test_fingerprint_covers_the_body_but_not_the_key() -> None:
    """The same body under two keys has one fingerprint; any change to the body changes it."""
    assert request().fingerprint() == request(idempotency_key="other").fingerprint()
    assert request().fingerprint() != request(labels={"a": "b"}).fingerprint()
    assert request().fingerprint() != request(versions=Versions(policy="v2")).fingerprint()
    first = request()
    assert first.model_copy(update={"priority": 5}).fingerprint() != first.fingerprint()


def test_fingerprints_stay_byte_for_byte_what_stored_rollouts_hold() -> None:
    """A retry of a key stored by an earlier fleet must match its stored fingerprint: the
    digests of these bodies (text beyond ASCII, escapes, floats written with exponents, maps in
    no order, a deadline) are the ones fleet has always written."""
    plain = SubmitRequest(idempotency_key="a", smolfile=SMOL, steps=(Step(argv=("true",)),))
    full = SubmitRequest(
        idempotency_key="b",
        smolfile='image = "python"\n[network]\nallow = ["pypi.org"]\n',
        steps=(
            Step(argv=("python3", "-c", "print('\u00e9 \u2713')"), env={"Z": "1", "A": "\u00fc"},
                 timeout_s=1e-5, name="run"),
            Step(argv=("sh",), workdir="/w", timeout_s=12345678901234567.0),
        ),
        deadline=datetime(2031, 2, 3, 4, 5, 6, 789000, tzinfo=UTC),
        retry=RetryPolicy(max_attempts=5, initial_backoff_s=0.25, max_backoff_s=1e3),
        labels={"zeta": "1", "alpha": "\u2713", "mid": 'x"y\\z\n'},
        tenant="team-b",
        priority=-3,
        outputs=("/out",),
    )  # fmt: skip
    assert plain.fingerprint() == (
        "sha256:26900823c65aa493299d6faca713c4a462d0689b1d249635286ab5f9f83146cb"
    )
    assert full.fingerprint() == (
        "sha256:2338af99db25df1504cccf32a7aaccd2c1217d958cb6642d8ae01d742791bf25"
    )


def test_manifest_pins_everything_a_retry_reuses() -> None:
    """The manifest digest changes with the image, versions or plan; not with the file name."""
    req = request(versions=Versions(policy="p1", environment="e1", evaluator="s1"))
    parsed = validate_request(req, NOW)
    m = build_manifest(req, parsed, "sha256:aa", NOW)
    assert m.versions.policy == "p1" and m.image_digest == "sha256:aa"
    assert m.deadline > NOW
    assert m.digest == build_manifest(req, parsed, "sha256:aa", NOW).digest
    assert m.digest != build_manifest(req, parsed, "sha256:bb", NOW).digest
    other = request(versions=Versions(policy="p2", environment="e1", evaluator="s1"))
    assert m.digest != build_manifest(other, validate_request(other, NOW), "sha256:aa", NOW).digest
    renamed = m.model_copy(update={"smolfile_name": "elsewhere"})
    assert renamed.digest == m.digest
    # Digests are computed once per object; a copy with a different plan gets its own.
    replanned = m.model_copy(update={"steps": (Step(argv=("false",)),)})
    assert replanned.digest != m.digest


def test_cuda_work_routes_to_gpu_hosts_only() -> None:
    """cuda = true needs the gpu class; everything else the cpu class."""
    assert host_class_for(parse_smolfile(SMOL + "cuda = true\n").spec) == HostClass.GPU
    assert host_class_for(parse_smolfile(SMOL).spec) == HostClass.CPU
    needs = Requirements()
    assert refusal(host(HostClass.GPU), HostClass.GPU, needs) is None
    assert refusal(host(HostClass.CPU), HostClass.GPU, needs) is not None
    assert refusal(host(HostClass.GPU), HostClass.CPU, needs) is not None


def test_vm_and_cuda_device_requirements() -> None:
    """vm isolation never lands on a namespace host; a CUDA device requirement needs one."""
    vm = Requirements(isolation=Isolation.VM)
    assert refusal(host(HostClass.CPU), HostClass.CPU, vm) is not None
    assert refusal(host(HostClass.CPU, Isolation.VM), HostClass.CPU, vm) is None
    dev = Requirements(cuda_device=True)
    assert refusal(host(HostClass.GPU), HostClass.GPU, dev) is not None
    assert refusal(host(HostClass.GPU, cuda=1), HostClass.GPU, dev) is None


def test_gateway_work_needs_a_host_that_knows_the_gateway_and_near_means_the_gpu_host() -> None:
    """Inference rollouts go only to agents with a gateway; near_gateway picks the gpu class."""
    needs = Requirements(inference=True)
    plain = host(HostClass.CPU)
    assert "no inference gateway" in (refusal(plain, HostClass.CPU, needs) or "")
    assert refusal(plain.model_copy(update={"gateway": True}), HostClass.CPU, needs) is None
    reason = unservable_reason([plain], HostClass.CPU, needs) or ""
    assert "knows the inference gateway" in reason
    near = Requirements(inference=True, near_gateway=True)
    assert host_class_for(parse_smolfile(SMOL).spec, near) == HostClass.GPU


def test_unservable_reason_names_the_gap() -> None:
    """With no gpu host the reason says the rollout needs one and what the fleet has."""
    reason = unservable_reason(
        [host(HostClass.CPU), host(HostClass.CPU)], HostClass.GPU, Requirements()
    )
    assert reason is not None
    assert "needs a gpu-class host" in reason and "cuda = true" in reason
    assert "2 cpu-class namespace-isolation" in reason
    assert unservable_reason([], HostClass.CPU, Requirements()) is not None
    assert unservable_reason([host(HostClass.CPU)], HostClass.CPU, Requirements()) is None


def test_lifecycle_allows_only_listed_moves() -> None:
    """Final states are terminal; a retry moves RUNNING back to QUEUED."""
    check_transition(RolloutState.QUEUED, RolloutState.RUNNING)
    check_transition(RolloutState.RUNNING, RolloutState.QUEUED)
    for final in FINAL_STATES:
        assert TRANSITIONS[final] == frozenset()
        with pytest.raises(FailedPrecondition):
            check_transition(final, RolloutState.RUNNING)
    with pytest.raises(FailedPrecondition):
        check_transition(RolloutState.QUEUED, RolloutState.SUCCEEDED)


def test_backoff_grows_with_jitter_and_is_capped() -> None:
    """Backoff is within [ceiling/2, ceiling], doubling per attempt up to the cap."""
    policy = RetryPolicy(max_attempts=5, initial_backoff_s=1.0, max_backoff_s=4.0)
    rng = random.Random(7)
    for attempt, ceiling in [(1, 1.0), (2, 2.0), (3, 4.0), (4, 4.0)]:
        delay = policy.backoff_s(attempt, rng)
        assert ceiling / 2 <= delay <= ceiling
    assert policy.may_retry(4) and not policy.may_retry(5)


def test_work_items_move_only_along_their_table() -> None:
    from fleet.core.errors import FailedPrecondition
    from fleet.core.lifecycle import ITEM_TRANSITIONS, WorkItemState, check_item_transition
    from fleet.ledger.raw import DONE, LEASED, QUEUED

    assert (QUEUED, LEASED, DONE) == ("QUEUED", "LEASED", "DONE")  # what the SQL holds
    allowed = {(a, b) for a, targets in ITEM_TRANSITIONS.items() for b in targets}
    for a in WorkItemState:
        for b in WorkItemState:
            if (a, b) in allowed:
                check_item_transition(a, b)
            else:
                with pytest.raises(FailedPrecondition, match=f"from {a} to {b}"):
                    check_item_transition(a, b)
    assert not ITEM_TRANSITIONS[WorkItemState.DONE]  # done is final
