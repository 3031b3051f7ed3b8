"""A real multi-node Ray cluster on one machine (a head and two worker nodes, each its own raylet with its own
resources, as `ray start` makes them) with Ray's token authentication on: the run's learner and rollout actor are
placed by the role resources the config names, each on its own node, and the run is correct there (counters
balance, reward logged). The cluster and the launcher run in a fresh process, as from an operator's shell."""

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
CLUSTER_AND_LAUNCH = """
import json, sys
from ray.cluster_utils import Cluster
import launch
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})  # the head holds no role
try:
    learner = cluster.add_node(num_cpus=1, resources={"learner": 1})
    rollout = cluster.add_node(num_cpus=1, resources={"rollout": 1})
    cluster.wait_for_nodes()
    rc = launch.main([*sys.argv[1:], f"cluster.address={cluster.address}"])
    print(json.dumps({"rc": rc, "learner": learner.node_id, "rollout": rollout.node_id}))
finally:
    cluster.shutdown()
"""


def test_multinode_roles_run_on_the_nodes_their_resources_name(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logdir = tmp_path / "run"
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    done = subprocess.run(
        [sys.executable, "-c", CLUSTER_AND_LAUNCH, "--config", "grpo_tiny", "trainer.steps=2", f"logging.dir={logdir}",
         "cluster.learner_resource=learner", "cluster.rollout_resource=rollout", "rollout.prompts_per_step=2",
         "rollout.group_size=4", "rollout.max_tokens=96", "learner.micro_batch_size=4"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    nodes = json.loads(done.stdout.strip().splitlines()[-1])
    assert nodes["rc"] == 0 and nodes["learner"] != nodes["rollout"]
    summary = json.loads((logdir / "summary.json").read_text())
    assert summary["placement"]["learner-0"]["node_id"] == nodes["learner"]
    assert summary["placement"]["rollout-0"]["node_id"] == nodes["rollout"]
    assert f"node {nodes['learner'][:8]}" in done.stdout  # the launcher's placement line
    learner = summary["learner"]
    assert learner["trained"] == 2 * 2 * 4 and learner["received"] == (
        learner["trained"] + learner["dropped_stale"] + learner["pending"] + learner["dropped_duplicate"]
        + learner["dropped_reissued"] + learner["dropped_invalid"])
    assert learner["lost"] == 0 and learner["dropped_messages"] == {}
    rewards = EventAccumulator(str(logdir)).Reload().Scalars("rl/reward_mean")
    assert [e.step for e in rewards] == [0, 1] and all(0 <= e.value <= 1 for e in rewards)
