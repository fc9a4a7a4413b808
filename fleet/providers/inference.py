"""What a harness's sandbox needs to call models through the inference gateway, shared by the
inspect_ai and Harbor providers (and free of either, so it is checked without them): the
upstream models a sample's or trial's rollout asks for, and the environment a harness hands a
machine's commands.

A machine of a rollout opened for inference finds the gateway and its rollout's token in its
own environment (`OPENAI_BASE_URL`, `OPENAI_API_KEY`, set by the runtime from the rollout's
claim). A harness that also passes these (Harbor's installed agents copy the host's
`OPENAI_API_KEY` into every command) would send the host's provider key to the machine: such
values are dropped before a command leaves the host, so the machine's own stand.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

MODEL_NAME = re.compile(r"[^/\s]+/\S{1,128}")
"""An upstream model as a rollout lists it: `UPSTREAM/MODEL` (or `UPSTREAM/*`)."""
HARNESS_MODEL_VARIABLES = frozenset({"OPENAI_API_KEY", "OPENAI_BASE_URL", "OPENAI_API_BASE"})
"""Set in a machine of an inference rollout by the machine itself; never taken from a harness."""


class ModelListError(ValueError):
    """An upstream model list with an entry that is not `UPSTREAM/MODEL`."""


def upstream_models(names: str | Iterable[str] | None, where: str) -> tuple[str, ...]:
    """`names` (a list, or one comma-separated string as command lines give it) checked and
    without repeats; a bad entry is refused, named by its place in `where`."""
    if names is None:
        return ()
    items = names.split(",") if isinstance(names, str) else [str(n) for n in names]
    out = [n.strip() for n in items if n.strip()]
    for i, name in enumerate(out):
        if not MODEL_NAME.fullmatch(name):
            raise ModelListError(f"{where}[{i}] {name!r} is not UPSTREAM/MODEL")
    return tuple(dict.fromkeys(out))


def command_env(env: Mapping[str, str] | None, inference: bool) -> dict[str, str]:
    """The environment a harness asks for, as sent with a command: for a machine of an
    inference rollout, without the model variables the machine sets itself."""
    if not inference:
        return dict(env or {})
    return {k: v for k, v in (env or {}).items() if k not in HARNESS_MODEL_VARIABLES}
