"""The pieces that bound hosts, alone: a join token's `HostBound` and the `RefusalLimiter`
that EnrollHost's refusals go through (on a clock the test moves)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from fleet.core.errors import InvalidArgument, PermissionDenied, ResourceExhausted
from fleet.core.placement import HostCapabilities, HostClass, Isolation, RuntimeKind
from fleet.identity.bounds import (
    DEFAULT_RUNTIMES,
    HostBound,
    no_control,
    parse_runtimes,
    strict_host_id,
    strict_tenant,
)
from fleet.ledger.store import Ledger
from fleet.server.auth import RefusalLimiter


def caps(**update: object) -> HostCapabilities:
    base = HostCapabilities(host_id="h1", host_class=HostClass.CPU, runtime=RuntimeKind.NAMESPACE,
                            isolation=Isolation.NAMESPACE, cpus=2, memory_mib=1024,
                            cuda_devices=0)  # fmt: skip
    return base.model_copy(update=update)


def test_a_bound_refuses_each_claim_beyond_it_by_name() -> None:
    bound = HostBound(HostClass.CPU, {"site": "cloud"}, DEFAULT_RUNTIMES, "join token abc123")
    bound.check(caps())
    bound.check(caps(labels={"site": "cloud"}))
    with pytest.raises(PermissionDenied) as e:
        claim = caps(host_class=HostClass.GPU, labels={"site": "x", "a": "b"},
                     runtime=RuntimeKind.SMOL, isolation=Isolation.VM, cuda_devices=2)  # fmt: skip
        bound.check(claim)
    message = e.value.message
    for part in ("join token abc123", "class gpu (allowed: cpu)",
                 "labels a=b,site=x (allowed: site=cloud)", "runtime smol (allowed: namespace)",
                 "isolation vm (allowed: namespace", "2 CUDA devices"):  # fmt: skip
        assert part in message, message
    # A namespace host may not claim VM isolation either, whatever its runtime says.
    with pytest.raises(PermissionDenied, match="isolation vm"):
        bound.check(caps(isolation=Isolation.VM))
    both = HostBound(HostClass.GPU, {}, parse_runtimes("smol,namespace"), "join token x")
    both.check(caps(host_class=HostClass.GPU, runtime=RuntimeKind.SMOL, isolation=Isolation.VM,
                    cuda_devices=1))  # fmt: skip
    with pytest.raises(InvalidArgument, match="unknown runtime 'vm'"):
        parse_runtimes("vm")


def test_tokens_keep_their_runtimes_and_default_to_namespace(tmp_path: Path) -> None:
    ids = Ledger.sqlite(tmp_path / "l.sqlite3").identities
    now = time.time()
    plain, _ = ids.create_join_token(HostClass.CPU, {}, 60, 1, now)
    vm, _ = ids.create_join_token(HostClass.GPU, {"z": "1"}, 60, 1, now,
                                  runtimes=frozenset({RuntimeKind.SMOL}))  # fmt: skip
    stored = {t.id: t for t in ids.join_tokens()}
    assert stored[plain.id].runtimes == {RuntimeKind.NAMESPACE} == plain.runtimes
    assert stored[vm.id].runtimes == {RuntimeKind.SMOL}
    assert stored[vm.id].bound.labels == {"z": "1"}


def test_names_with_control_characters_are_refused() -> None:
    for bad in ("cpu-a\n", "cpu\ta", "cpu-a\r", "a\x1b[31m"):
        with pytest.raises(InvalidArgument):
            strict_host_id(bad)
        with pytest.raises(InvalidArgument):
            strict_tenant(bad)
        with pytest.raises(InvalidArgument, match="control character"):
            no_control(bad, "tenant")
    assert strict_host_id("cpu-a") == "cpu-a" and strict_tenant("team.a") == "team.a"
    assert no_control("any tenant at all", "tenant") == "any tenant at all"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_limiter_bounds_refusals_per_peer_and_overall() -> None:
    clock = Clock()
    limiter = RefusalLimiter(per_peer=3, per_peer_per_s=1.0, overall=5, overall_per_s=1.0,
                             clock=clock)  # fmt: skip
    a, b, c = "ipv4:10.0.0.1:5000", "ipv4:10.0.0.2:6000", "ipv6:[::1]:7000"
    for port in (1, 2, 3):  # another port is the same peer
        limiter.take(f"ipv4:10.0.0.1:{port}", "EnrollHost")
    with pytest.raises(ResourceExhausted, match=r"from ipv4:10\.0\.0\.1: try again in 1 s") as e:
        limiter.take(a, "EnrollHost")
    assert e.value.retry_after_s == pytest.approx(1.0)
    limiter.take(b, "EnrollHost")
    limiter.take(b, "EnrollHost")
    with pytest.raises(ResourceExhausted, match="from all peers"):
        limiter.take(c, "EnrollHost")  # (5 refused overall)
    # A call that was not refused gives its refusal back.
    limiter.refund(b)
    limiter.take(c, "EnrollHost")
    clock.now += 1.0  # one refill each
    limiter.take(a, "EnrollHost")
    with pytest.raises(ResourceExhausted):
        limiter.take(a, "EnrollHost")
    assert limiter.limited == 3


def test_the_limiter_forgets_peers_that_refilled() -> None:
    clock = Clock()
    limiter = RefusalLimiter(per_peer=1, per_peer_per_s=1.0, overall=10**6, clock=clock)
    limiter.MAX_PEERS = 4
    for i in range(4):
        limiter.take(f"ipv4:10.0.0.{i}:1", "EnrollHost")
    clock.now += 5.0
    limiter.take("ipv4:10.0.1.1:1", "EnrollHost")
    assert len(limiter._peers) == 1
