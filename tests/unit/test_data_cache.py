"""The data cache's `build_once` when several machines share it (a cluster's shared home or
data directory): processes on different nodes can have the same process id, and must not
build in one temporary directory."""

from __future__ import annotations

import os
from pathlib import Path

from tessel.data.cache import build_once


def test_two_nodes_whose_builders_share_a_process_id_each_build_their_own(tmp_path: Path,
                                                                         monkeypatch):
    """Node A's build is under way when node B, whose builder has the same pid (containers
    start their processes at the same low pids), builds the same target: each keeps its own
    temporary directory, and the target is one complete build."""
    monkeypatch.setattr(os, "getpid", lambda: 4242)
    target = tmp_path / "corpus-key"

    def on_node_b(tmp: Path) -> None:
        (tmp / "data.bin").write_text("b")
        (tmp / "data.idx").write_text("b")

    def on_node_a(tmp: Path) -> None:
        (tmp / "data.bin").write_text("a")
        build_once(target, on_node_b)  # node B, meanwhile, finishes first
        (tmp / "data.idx").write_text("a")  # node A's build goes on in its own directory

    assert build_once(target, on_node_a) == target
    assert (target / "data.bin").read_text() == (target / "data.idx").read_text() == "b"
    assert [p.name for p in tmp_path.iterdir()] == ["corpus-key"]  # no temporary left behind


def test_a_temporary_directory_a_killed_build_left_is_removed_by_the_next(tmp_path: Path):
    """A process killed while building (the tokenizer aborting for memory, exit 134) left its
    `.tmp-sft-*` directory in the cache for good."""
    import time

    target = tmp_path / "sft-key"
    stale, fresh = tmp_path / ".tmp-sft-key-old", tmp_path / ".tmp-sft-key-busy"
    for d in (stale, fresh):
        d.mkdir()
    day_ago = time.time() - 25 * 3600
    os.utime(stale, (day_ago, day_ago))

    def build(tmp: Path) -> None:
        (tmp / "data.idx").write_text("x")

    assert build_once(target, build) == target
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-sft-key-busy", "sft-key"]
