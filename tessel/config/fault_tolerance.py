"""The [fault_tolerance] section: replica groups that keep training when one of them fails
(torchft, `pip install 'tessel[ft]'`; docs/parallelism.md, "Fault-tolerant replicas").

The names are torchtitan's (`[fault_tolerance]` enable, replica_id, group_size,
min_replica_size), so a torchtitan user's settings carry over. What a layout may combine
with the mode is checked when the run starts (`tessel.parallel.replica_group.check_replicas`).
"""

from __future__ import annotations

from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from tessel.config.base import Section


class FaultToleranceConfig(Section):
    enable: bool = False
    """Train as one of `group_size` data-parallel replica groups coordinated by a torchft
    Lighthouse: when a group fails the others keep stepping, and a restarted group takes the
    current weights, optimizer state, step and data position from a healthy peer (not from a
    checkpoint), then rejoins. Off: nothing of torchft is imported."""
    replica_id: int = Field(0, ge=0)
    """This replica group's number, 0 to group_size - 1 (each group is one `tessel train`
    with its own run.dir; a restarted group keeps its number). It picks the group's share of
    every global batch; a group started while another running group holds its number is
    refused (exit code 2)."""
    group_size: int = Field(0, ge=0)
    """The number of replica groups the global batch is split over (each group's share:
    train.global_batch_size / group_size sequences per step). Required (>= 1) when enable."""
    min_replica_size: int = Field(1, gt=0)
    """The fewest replica groups a step may commit with; with fewer, the step is discarded
    and retried on the same data. Start the Lighthouse with at least this --min_replicas."""
    lighthouse: str = ""
    """Address of the torchft Lighthouse (`torchft_lighthouse --min_replicas N`, e.g.
    http://host:29510); empty: the TORCHFT_LIGHTHOUSE environment variable."""
    timeout_s: int = Field(60, gt=0)
    """Seconds a quorum, a cross-group collective or a peer's state transfer may take before
    the step is given up (a stuck peer is then left out of the next quorum); a group that
    finds no quorum for this long stops (exit code 3). Keep it below watchdog.timeout_s."""

    @field_validator("lighthouse")
    @classmethod
    def _address(cls, value: str) -> str:
        problem = lighthouse_problem(value) if value else None
        if problem:
            raise ValueError(problem)
        return value

    @model_validator(mode="after")
    def _check(self) -> FaultToleranceConfig:
        if not self.enable:
            return self
        if self.group_size < 1:
            raise ValueError("fault_tolerance.enable needs fault_tolerance.group_size, the "
                             "number of replica groups (>= 1)")
        if self.replica_id >= self.group_size:
            raise ValueError(f"fault_tolerance.replica_id={self.replica_id} is not below "
                             f"fault_tolerance.group_size={self.group_size}; number the "
                             f"groups 0 to {self.group_size - 1}")
        if self.min_replica_size > self.group_size:
            raise ValueError(f"fault_tolerance.min_replica_size={self.min_replica_size} "
                             f"exceeds fault_tolerance.group_size={self.group_size}; no step "
                             "could commit")
        return self


def lighthouse_problem(address: str) -> str | None:
    """What is wrong with a Lighthouse address (fault_tolerance.lighthouse or
    TORCHFT_LIGHTHOUSE), or None: it must be http(s)://HOST:PORT, as torchft_lighthouse prints
    it. Checked when the config is read, so a typo is one line rather than a quorum that never
    forms (which waited timeout_s and exited 3, as a Lighthouse that died does)."""
    try:
        url = urlsplit(address)
        port = url.port
    except ValueError:
        port, url = None, None
    if url is None or url.scheme not in ("http", "https") or not url.hostname or port is None:
        return (f"{address!r} is not a Lighthouse address: give http://HOST:PORT, as "
                "torchft_lighthouse prints it (e.g. http://10.0.0.5:29510)")
    return None
