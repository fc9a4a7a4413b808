"""`fleet.heap.settle`: what a daemon holds from its start is out of the collector's walks;
what it makes afterwards is collected as before. Run in a process of its own: a frozen heap
is frozen for the rest of its process."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import gc, json
from fleet import heap
kept = [[i] for i in range(50_000)]  # (alive at the start, as a daemon's modules are)
before = len(gc.get_objects())
frozen = heap.settle()
after = len(gc.get_objects())
class Cycle:
    pass
a, b = Cycle(), Cycle()
a.other, b.other = b, a
del a, b
collected = gc.collect()
print(json.dumps({"before": before, "after": after, "frozen": frozen, "collected": collected,
                  "freeze_count": gc.get_freeze_count()}))
"""


def test_settle_freezes_the_start_and_leaves_later_garbage_to_the_collector() -> None:
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                          timeout=120, check=True)  # fmt: skip
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["frozen"] == seen["freeze_count"] >= 50_000
    assert seen["after"] < seen["before"] - 50_000  # (the collector no longer walks them)
    assert seen["collected"] >= 2  # (the cycle made after settling: both objects)
