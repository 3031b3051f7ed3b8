"""`launch.py --plan`: what a run will need and whether the cluster holds it, before any process starts.

From the validated config and the model's `config.json` (the model is built on PyTorch's meta device: exact
parameter counts, no weights read) it places the roles as `driver/placement.py` will (learner ranks packed, one
GPU each; rollout actors on `tensor_parallel_size` GPUs of one node; each on the nodes that offer its
`cluster.<role>_resource` when named), and prints per GPU the memory each role holds: weights, gradients and Adam
state under the ZeRO stage for a learner rank (activations come on top), weight shard and KV cache budget
(`rollout.kv_cache_mib`) for a rollout GPU; the bytes of one weight sync and its time at the bandwidth
`bench/weight_sync.py` measured (`bench/results/weight_sync_cpu2.json`). The cluster is a described one
(`--cluster 2x8:80`, nodes x GPUs : GiB per GPU), the one at `cluster.address`, or this machine. It returns 3
naming the first shortfall when the run does not fit.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig

from configs.load import draft_model
from driver.preflight import check_prompts_fit
from models.zoo import resolve

GIB = 1 << 30
WEIGHT_SYNC_RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results" / "weight_sync_cpu2.json"
# a packed NCCL broadcast between nodes: NeMo-RL refits Qwen3-30B-A3B (61 GB in bf16) in 0.74-1.6 s; this is the
# slow end, a published figure, not one this project measured (README, "Running on GPUs")
NCCL_GB_S = 38.0


@dataclass
class Node:
    name: str
    gpus: int
    memory_gib: float  # per GPU on cuda; the host's on cpu
    resources: dict[str, float] = field(default_factory=dict)  # custom ones; a described node offers every role


MAX_NODES, MAX_GPUS, MAX_GIB = 100_000, 64, 65_536  # what a described cluster may have: per node, per GPU


def described(spec: str) -> list[Node]:
    """`NODESxGPUS[:GIB]`, e.g. `2x8:80`: that many identical GPU nodes (80 GiB per GPU unless given)."""
    match = re.fullmatch(r"(\d+)x(\d+)(?::(\d+(?:\.\d+)?))?", spec)
    if match is None or not (1 <= int(match[1]) <= MAX_NODES and 1 <= int(match[2]) <= MAX_GPUS):
        raise argparse.ArgumentTypeError(f"{spec!r} is not NODESxGPUS[:GIB_PER_GPU] with 1-{MAX_NODES} nodes of "
                                         f"1-{MAX_GPUS} GPUs, e.g. 2x8:80")
    return [Node(f"node-{i}", int(match[2]), gib(match[3] or "80")) for i in range(int(match[1]))]


def gib(text: str) -> float:
    """Memory per GPU in GiB, as `--gpu-gib` and `--cluster` give it: a number in (0, MAX_GIB]."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= MAX_GIB:  # (NaN compares false)
        raise argparse.ArgumentTypeError(f"{text!r} is not a memory per GPU in (0, {MAX_GIB}] GiB")
    return value


class NoCluster(RuntimeError):
    pass


def connected(address: str, gpu_gib: float) -> tuple[list[Node], str]:
    """The alive nodes of the Ray cluster at `address` (Ray does not report GPU memory: `gpu_gib` is assumed) and
    the address of the cluster it joined (`auto` joins whichever one runs on this machine: the plan names it)."""
    import ray

    try:
        context = ray.init(address=address, include_dashboard=False, configure_logging=False, log_to_driver=False)
    except ConnectionError as e:
        raise NoCluster(f"no Ray cluster at cluster.address={address!r} ({e}); start it (ray start --head on this "
                        "node, ray start --address=HEAD:6379 on the others), or plan on a described one with "
                        "--cluster NODESxGPUS[:GIB]") from None
    try:
        joined = context.address_info.get("gcs_address", address)
        nodes = [n for n in ray.nodes() if n["Alive"]]
    finally:
        ray.shutdown()
    standard = {"CPU", "GPU", "memory", "object_store_memory"}
    return [Node(f"{n['NodeManagerAddress']} ({n['NodeID'][:8]})", int(n["Resources"].get("GPU", 0)),
                 gpu_gib if n["Resources"].get("GPU") else
                 n["Resources"].get("memory", 0) / GIB,
                 {k: v for k, v in n["Resources"].items() if k not in standard and not k.startswith(("node:",
                                                                                                      "accelerator"))})
            for n in nodes], joined


def this_machine() -> list[Node]:
    import psutil
    import torch

    gpus = torch.cuda.device_count()
    memory = torch.cuda.get_device_properties(0).total_memory / GIB if gpus else psutil.virtual_memory().total / GIB
    return [Node("this machine", gpus, memory)]


def parameters(model_path: str) -> tuple[str, int]:
    """The architecture name and parameter count of the model at `model_path` (built on the meta device)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(resolve(model_path)))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return config.model_type, sum(p.numel() for p in model.parameters())


def learner_bytes(cfg: DictConfig, params: int) -> dict[str, float]:
    """Per learner rank: weights and gradients in the training dtype, AdamW's fp32 state (and fp32 master weights
    under bf16), each divided over the ranks as the ZeRO stage shards it; the frozen reference when kl_coef > 0."""
    ranks, stage = cfg.learner.num_ranks, cfg.learner.zero_stage
    width = 2 if cfg.learner.dtype.value == "bfloat16" else 4
    out = {"weights": width * params / (ranks if stage >= 3 else 1),
           "gradients": width * params / (ranks if stage >= 2 else 1),
           "optimizer": (8 + (4 if width == 2 else 0)) * params / (ranks if stage >= 1 else 1)}
    if cfg.algorithm.kl_coef > 0:
        out["reference"] = out["weights"]
    return out


def rollout_bytes(cfg: DictConfig, params: int) -> dict[str, float]:
    """Per rollout device: its tensor-parallel share of the weights and the KV cache budget."""
    width = 2 if cfg.model.dtype.value in ("bfloat16", "float16") else 4
    tp = cfg.rollout.tensor_parallel_size if cfg.cluster.device.value == "cuda" else 1
    return {"weights": width * params / tp, "kv_cache": cfg.rollout.kv_cache_mib * float(1 << 20)}


def distiller_bytes(cfg: DictConfig) -> float:
    """The draft LM distiller's memory (0 without distillation): fp32 weights, gradients and AdamW's two moments of
    the draft LM it trains, and the running, starting and candidate copies it replays (learner/distill.py)."""
    if cfg.speculation.distill.every_versions == 0:
        return 0.0
    return 28.0 * parameters(draft_model(cfg.speculation))[1]


def place(cfg: DictConfig, nodes: list[Node]) -> tuple[dict[str, list[str]], str | None]:
    """Node name -> the processes placed there, and the first shortfall (None when everything is placed)."""
    cuda = cfg.cluster.device.value == "cuda"
    free = {n.name: (n.gpus if cuda else 1 << 30) for n in nodes}
    placed: dict[str, list[str]] = {n.name: [] for n in nodes}
    share = 0.5 if cfg.cluster.share_gpu else 1  # of a GPU, per learner rank and rollout device
    roles = [("learner", cfg.learner.num_ranks, share if cuda else 1, cfg.cluster.learner_resource),
             ("rollout", cfg.rollout.num_actors, cfg.rollout.tensor_parallel_size * share if cuda else 1,
              cfg.cluster.rollout_resource)]
    for role, count, width, resource in roles:
        offering = [n for n in nodes if not resource or not n.resources or resource in n.resources]
        units = {n.name: n.resources.get(resource, 1 << 30) if resource and n.resources else 1 << 30
                 for n in offering}
        for i in range(count):
            node = next((n for n in offering if free[n.name] >= width and units[n.name] >= width), None)
            if node is None:
                what = f"{width} GPU(s)" if cuda else "a slot"
                named = resource and any(n.resources for n in nodes)
                return placed, (f"no node has {what} left for {role}-{i} ({count} x {width} asked"
                                + (f", on the nodes offering resource '{resource}'" if named else "") + ")")
            free[node.name] -= width
            units[node.name] -= width
            placed[node.name].append(f"{role}-{i}")
    return placed, None


def weight_sync(cfg: DictConfig, gb: float) -> str:
    """The plan's line on sending one policy version of `gb` GB to the engines by `transport.weights`."""
    measured = json.loads(WEIGHT_SYNC_RESULTS.read_text())["systems"]
    cuda, actors = cfg.cluster.device.value == "cuda", cfg.rollout.num_actors
    zmq_rate = measured["weights_curve" if cfg.transport.auth.value == "curve" else "weights"]["gb_per_s"]
    over_zmq = (f"~{gb / zmq_rate:.1f} s over ZeroMQ ({cfg.transport.auth.value}) at the {zmq_rate:.2f} GB/s "
                "bench/weight_sync.py measured on one host")
    if cfg.transport.weights.value == "zmq":
        nccl = f"; transport.weights nccl: ~{gb / NCCL_GB_S:.1f} s per engine" if cuda and not cfg.cluster.share_gpu \
            else ""
        return f"  weight sync: {gb:.2f} GB per version, {over_zmq}{nccl}"
    rate, how = (NCCL_GB_S, "NCCL at a published packed-broadcast rate between nodes") if cuda else \
        (measured["collective"]["gb_per_s"], "gloo at the rate bench/weight_sync.py measured on one host")
    return (f"  weight sync: {gb:.2f} GB per version, ~{gb / rate:.1f} s per engine by {how} ({rate:.2f} GB/s); "
            f"rank 0 sends each of the {actors} engines its own copy, ~{actors * gb / rate:.1f} s where they share "
            f"its link ({over_zmq})")


def plan(cfg: DictConfig, cluster: list[Node] | None, gpu_gib: float) -> int:
    """Prints the plan on `cluster` (a described one), or else the one at `cluster.address` or this machine; 0 if it
    holds the run, 3 naming the first shortfall, 2 with no cluster to plan on (ConfigError: a prompt too long)."""
    check_prompts_fit(cfg, resolve(cfg.model.path))
    where = "described" if cluster else "this machine (embedded Ray)"
    nodes = cluster or this_machine()
    if cluster is None and cfg.cluster.address:
        try:
            nodes, joined = connected(cfg.cluster.address, gpu_gib)
        except NoCluster as e:
            print(f"plan: {e}", file=sys.stderr)
            return 2
        where = f"the Ray cluster at {joined} (cluster.address={cfg.cluster.address!r})"
    cuda = cfg.cluster.device.value == "cuda"
    kind, params = parameters(cfg.model.path)
    sync_bytes = rollout_bytes(cfg, params)["weights"] * (cfg.rollout.tensor_parallel_size if cuda else 1)
    print(f"plan: model {cfg.model.path} ({kind}), {params / 1e9:.3f} B parameters ({params:,})\n"
          f"  cluster: {where}, {len(nodes)} node(s): " + ", ".join(
              f"{n.name} {n.gpus} GPU x {n.memory_gib:.0f} GiB" if cuda else f"{n.name} {n.memory_gib:.0f} GiB"
              for n in nodes))
    placed, shortfall = place(cfg, nodes)
    for node, names in placed.items():
        if names:
            print(f"  {node}: {', '.join(names)}")
    learner, rollout = learner_bytes(cfg, params), rollout_bytes(cfg, params)
    budget = min(n.memory_gib for n in nodes) * GIB
    lines = [("learner rank", learner, f"ZeRO-{cfg.learner.zero_stage} over {cfg.learner.num_ranks} rank(s), "
                                       "activations on top"),
             ("rollout " + ("GPU" if cuda else "actor"), rollout, f"tensor parallel {cfg.rollout.tensor_parallel_size}"
              if cuda else "one engine")]
    for name, parts, note in lines:
        total = sum(parts.values())
        print(f"  {name}: " + " + ".join(f"{k} {v / GIB:.2f}" for k, v in parts.items())
              + f" = {total / GIB:.2f} GiB of {budget / GIB:.0f} ({note})")
        if cuda and total > budget and shortfall is None:
            shortfall = f"a {name} needs {total / GIB:.2f} GiB, a GPU has {budget / GIB:.0f}"
    if distiller := distiller_bytes(cfg):  # (0 without distillation, counted below all the same)
        share = cfg.speculation.distill.num_gpus  # 0 unless cluster.device is cuda (configs/load.py)
        on_gpu = f"a {share:g} share of rank 0's GPU" if share else "rank 0's node, CPU"
        print(f"  draft LM distiller: {distiller / 2**20:.1f} MiB on {on_gpu} (28 bytes per draft parameter: fp32 "
              "weights, gradients, AdamW, three copies to judge with)")
        rank0 = sum(learner.values()) + distiller
        if share and rank0 > budget and shortfall is None:
            shortfall = f"learner rank 0 with the distiller needs {rank0 / GIB:.2f} GiB, a GPU has {budget / GIB:.0f}"
    if cfg.cluster.share_gpu:  # the learner rank and the engine on one GPU
        both = sum(learner.values()) + sum(rollout.values()) + distiller
        print(f"  shared GPU: learner rank and rollout engine together {both / GIB:.2f} GiB of {budget / GIB:.0f}")
        if both > budget and shortfall is None:
            shortfall = f"the shared GPU needs {both / GIB:.2f} GiB, it has {budget / GIB:.0f}"
    if not cuda:  # one host: every process's memory together
        total = (cfg.learner.num_ranks * sum(learner.values()) + cfg.rollout.num_actors * sum(rollout.values())
                 + distiller)
        if total > budget and shortfall is None:
            shortfall = f"the processes need {total / GIB:.2f} GiB, the machine has {budget / GIB:.0f}"
    print(weight_sync(cfg, sync_bytes / 1e9))
    if shortfall is not None:
        print(f"plan: the cluster cannot hold the run: {shortfall}")
        return 3
    print("plan: the cluster holds the run")
    return 0
