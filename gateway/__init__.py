"""The inference gateway (see README.md); the only package that imports torch."""

import warnings

# torch's CPU wheel without numpy warns when imported; nothing here converts tensors to numpy.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")


def require_torch() -> None:
    """Refuses, saying what to install, where torch is not: a CPU host's agent installs fleet
    without it, and only the gateway needs it (the `gateway` extra)."""
    import importlib.util

    from fleet.core.errors import FailedPrecondition

    if importlib.util.find_spec("torch") is None:
        raise FailedPrecondition(
            "the inference gateway serves its model with torch, which this installation "
            "lacks: pip install 'fleet[gateway]' (it pins torch==2.13.0)"
        )
