"""A host whose hypervisor takes from the first timed run of every measurement: for tests of what dostune sets aside
(host_steal.QuietRuns), patched in where a measurement makes its QuietRuns."""
from dostune.host_steal import QuietRuns


class FirstRunStolen(QuietRuns):
    """Half the CPU stolen during the first run, none after; no waiting for a quiet host."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.gather = lambda share: [0.5 if not self.runs else 0.0]
        self.wait_left = 0.0
