"""The bounds on a host's labels (and on those a join token or a pool names hosts by).

Labels arrive from the wire (a host's registration) and from operators (join tokens, pools),
and are kept in the ledger and matched on every placement; bounding them here, in one pure
place, lets the wire boundary and the ledger refuse the same labels with the same words.
"""

from __future__ import annotations

from fleet.core.errors import InvalidArgument

MAX_LABELS = 32
"""How many labels one host, token or pool may carry."""
MAX_LABEL_BYTES = 256
"""The longest a label's key and value may be together, in characters."""


def check_labels(labels: dict[str, str]) -> dict[str, str]:
    """`labels`, unchanged, or InvalidArgument naming the first label out of bounds."""
    if len(labels) > MAX_LABELS:
        raise InvalidArgument(f"labels: at most {MAX_LABELS}, got {len(labels)}")
    for key, value in labels.items():
        if not key or len(key) + len(value) > MAX_LABEL_BYTES:
            raise InvalidArgument(f"label {key[:40]!r}: empty key or longer than {MAX_LABEL_BYTES}")
    return labels
