"""The executor seam: one registry of executors by cluster.name, each with its own keys, and the
job facts the runtime reads through launcher/job_env.py instead of a scheduler's variables."""

from __future__ import annotations

import dataclasses

import pytest

from launcher.config.executors import EXECUTOR_NAMES, cluster_key_problems
from launcher.config.schema import ClusterConfig, ClusterKeys, SlurmKeys
from launcher.job_env import job_facts
from launcher.launch.executor import EXECUTORS, executor_for
from launcher.checkpoint.folder import describe_holder, holder_record


def test_every_executor_has_key_checks_and_every_key_checker_an_executor():
    assert set(EXECUTORS) == set(EXECUTOR_NAMES) == {"local", "slurm"}
    assert all(executor_for(name).name == name for name in EXECUTORS)
    with pytest.raises(ValueError, match="Fix: cluster=local"):
        executor_for("kubernetes")


def test_cluster_keys_are_the_common_keys_plus_each_executors_own_flat():
    names = [f.name for f in dataclasses.fields(ClusterConfig)]
    assert names == [f.name for f in dataclasses.fields(ClusterKeys)] + [f.name for f in dataclasses.fields(SlurmKeys)]
    assert len(set(names)) == len(names)  # no key declared by two executors


def test_each_executor_checks_only_its_keys():
    local = ClusterConfig(name="local", nodes=2, setup=["module load cuda"], spare_nodes=1)
    problems = cluster_key_problems(local, "run")
    assert len(problems) == 3 and all("Fix" in p for p in problems)
    assert cluster_key_problems(local, "plan") == problems[1:]  # a plan may describe several nodes
    assert "cluster.spare_nodes=1, but cluster=local" in problems[1]
    slurm = ClusterConfig(name="slurm", nodes=2, setup=["module load cuda"], max_requeues=-1, spare_nodes=1)
    assert [p.split("=")[0] for p in cluster_key_problems(slurm, "run")] == ["cluster.max_requeues"]
    # Spares: fewer than the nodes that train (a second copy of the job is no spare), never negative.
    for spares, nodes in ((2, 2), (-1, 4)):
        problems = cluster_key_problems(ClusterConfig(name="slurm", nodes=nodes, spare_nodes=spares), "run")
        assert [p.split("=")[0] for p in problems] == ["cluster.spare_nodes"] and "Fix:" in problems[0]
    # Keys every executor reads are checked whichever executor runs.
    for name in EXECUTOR_NAMES:
        problems = cluster_key_problems(ClusterConfig(name=name, max_restarts=-1), "run")
        assert [p.split("=")[0] for p in problems] == ["cluster.max_restarts"] and "Fix:" in problems[0]


def test_job_facts_from_slurm_and_from_a_local_run():
    slurm = job_facts({"SLURM_JOB_ID": "4242", "SLURMD_NODENAME": "n2", "SLURM_RESTART_COUNT": "1"})
    assert (slurm.executor, slurm.job_id, slurm.node_name, slurm.restart_count) == ("slurm", "4242", "n2", 1)
    local = job_facts({})
    assert (local.executor, local.job_id, local.restart_count) == ("local", None, 0)


def test_lock_records_name_the_job_through_the_facts_and_old_records_still_read(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    record = holder_record(tmp_path)
    assert (record["executor"], record["job_id"]) == ("slurm", "77")
    assert "SLURM job 77" in describe_holder(record)
    assert "SLURM job 12" in describe_holder({"slurm_job_id": "12", "pid": 1})  # written before the seam
    monkeypatch.delenv("SLURM_JOB_ID")
    assert "no scheduler job" in describe_holder(holder_record(tmp_path))
