"""fleet's Python client: rollouts and interactive sessions over gRPC, as typed values.

    from fleet.client import Fleet

    fleet = Fleet()                      # $FLEET_SERVER / $FLEET_KEY, or `fleet up`'s files
    with fleet.session("smolfiles/minimal.smolfile") as box:
        box.write_file("/root/task.py", b"print(6 * 7)")
        result = box.exec(["python3", "/root/task.py"])
        print(result.stdout)             # b"42\\n"
    rollout = fleet.submit("smolfiles/minimal.smolfile", [["echo", "hi"]],
                           inputs={"/data": "./data"}, outputs=["/out"])
    print(fleet.wait(rollout.id).state)  # "SUCCEEDED", as soon as the server says so
    fleet.download_outputs(rollout.id, "got")

The same calls, awaitable: `AsyncFleet` and `AsyncSession` (the blocking client runs them).
Both take and return the values in `fleet.client.models`; refusals raise fleet's own errors
(`fleet.core.errors`: InvalidArgument, NotFound, ResourceExhausted with `retry_after_s` ...),
never raw gRPC ones. This is the one way into a server: the command line, the demo and the
harness providers use it too.
"""

from fleet.client.aio import AsyncFleet, AsyncSession
from fleet.client.models import (
    AttemptRecord,
    Egress,
    EgressEvent,
    Event,
    ExecResult,
    InputFile,
    Output,
    Page,
    Rollout,
    SessionInfo,
    Smolfile,
    Step,
    StepResult,
    Submission,
)
from fleet.client.sync import Fleet, Session
from fleet.client.wire import CommonOptions, SubmitOptions
from fleet.connect import DEFAULT_SERVER, default_server

__all__ = [
    "DEFAULT_SERVER",
    "AsyncFleet",
    "AsyncSession",
    "AttemptRecord",
    "CommonOptions",
    "Egress",
    "EgressEvent",
    "Event",
    "ExecResult",
    "Fleet",
    "InputFile",
    "Output",
    "Page",
    "Rollout",
    "Session",
    "SessionInfo",
    "Smolfile",
    "Step",
    "StepResult",
    "Submission",
    "SubmitOptions",
    "default_server",
]  # fmt: skip
