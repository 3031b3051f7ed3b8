"""Where a run's processes go: one Ray placement group per role, reserved whole before any process starts.

Each learner rank and each rollout actor is one bundle: a CPU, its GPUs (a rollout actor's `tensor_parallel_size`
on one node) and, when the config names one (`cluster.learner_resource`, `cluster.rollout_resource`), a unit of the
custom resource per GPU (one per process on CPU) that only the nodes meant for the role advertise
(`ray start --resources='{"learner": 8}'`). Learner ranks are packed onto as few nodes as possible (their
collectives stay inside a node where they can); rollout actors are spread. A replacement actor takes the bundle
of the actor it replaces. A cluster that cannot hold a role gets an error naming what was asked and what is free.
"""

from __future__ import annotations

import ipaddress
import socket

import ray
from omegaconf import DictConfig
from ray.util.placement_group import PlacementGroup, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from configs.load import ConfigError

WAIT_S = 120  # for the cluster to grant a role's resources (an autoscaler may be adding nodes)


def check_reachable(cfg: DictConfig) -> None:
    """A ConfigError when `transport.host` is a loopback address while the nodes that can hold the run's processes
    (those advertising a role's resource when the config names one, else those with CPUs) are at several
    addresses: a process placed there would dial its own loopback for learner rank 0 until `rollout.start_timeout_s`."""
    if not ipaddress.ip_address(socket.gethostbyname(cfg.transport.host)).is_loopback:
        return
    roles = [name for name in (cfg.cluster.learner_resource, cfg.cluster.rollout_resource) if name] or ["CPU"]
    addresses = sorted({node["NodeManagerAddress"] for node in ray.nodes()
                        if node["Alive"] and any(node["Resources"].get(name, 0) > 0 for name in roles)})
    if len(addresses) > 1:
        raise ConfigError(f"key 'transport.host' = {cfg.transport.host!r} is a loopback address, but the cluster's "
                          f"nodes are at {', '.join(addresses)}: processes there could not reach learner rank 0; set "
                          "transport.host to 0.0.0.0 (peers are given rank 0's outward address) or an address of its")


def gpus_per_device(cfg: DictConfig) -> float:
    """What one learner rank, or one device of a rollout engine, takes of a GPU: 0 on CPU, half with
    `cluster.share_gpu`, else one."""
    return 0.0 if cfg.cluster.device.value != "cuda" else 0.5 if cfg.cluster.share_gpu else 1.0


def bundles(cfg: DictConfig, role: str) -> list[dict[str, float]]:
    """The resources of every process of `role` ("learner" or "rollout")."""
    gpu = gpus_per_device(cfg)
    gpus, count, resource = ((gpu, cfg.learner.num_ranks, cfg.cluster.learner_resource) if role == "learner"
                             else (cfg.rollout.tensor_parallel_size * gpu, cfg.rollout.num_actors,
                                   cfg.cluster.rollout_resource))
    bundle = {"CPU": 1.0, **({"GPU": gpus} if gpus else {}), **({resource: float(max(gpus, 1))}
                                                                         if resource else {})}
    return [dict(bundle) for _ in range(count)]


def reserve(cfg: DictConfig, role: str) -> PlacementGroup:
    """The role's placement group, once the cluster has granted all of it."""
    asked = bundles(cfg, role)
    group = placement_group(asked, strategy="PACK" if role == "learner" else "SPREAD")
    try:
        ray.get(group.ready(), timeout=WAIT_S)
    except ray.exceptions.GetTimeoutError:
        ray.util.remove_placement_group(group)
        free = {k: v for k, v in ray.available_resources().items() if not k.startswith("node:")}
        raise RuntimeError(f"the cluster cannot place the {role} processes within {WAIT_S} s: asked "
                           f"{len(asked)} x {asked[0]}, free {free} (cluster.{role}_resource names the resource the "
                           "nodes for this role advertise)") from None
    return group


def slot(group: PlacementGroup, index: int) -> PlacementGroupSchedulingStrategy:
    """Ray actor `options(scheduling_strategy=...)` for the process of bundle `index`."""
    return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)


def nodes_of(group: PlacementGroup, names: list[str]) -> dict[str, dict[str, str]]:
    """Where the process of each bundle runs (`names[i]` holds bundle i): its node's id and address."""
    table = ray.util.placement_group_table(group)["bundles_to_node_id"]
    addresses = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
    return {name: {"node_id": table[i], "address": addresses.get(table[i], "?")} for i, name in enumerate(names)}
