"""The learner's ranks as Ray actors: rank 0 owns the inbox and the weight publisher; calls that every rank takes
part in (train, publish, a checkpoint) go to all of them."""

from __future__ import annotations

import ray
from omegaconf import DictConfig

from configs.load import ConfigError
from driver.placement import reserve, slot
from learner.base import longer_deadline
from learner.checkpoint import SHARED_WAIT_S
from learner.learner import Learner
from tasks.schedule import CursorPlan
from transport.auth import KeyPair


class LearnerGroup:
    def __init__(self, cfg: DictConfig, policy_dir: str, reference_dir: str, plan: CursorPlan, num_gpus: int,
                 keys: KeyPair | None = None, distiller: tuple[int, bool] = (0, False)):
        """Places the ranks and builds them (`start` joins them). `keys`: the CURVE pair of rank 0's sockets (None:
        plain TCP); actors dial with `server_public`. `distiller`: the run's distiller restarts so far and whether
        distillation is off (before a learner restart), which rank 0's distiller goes on from."""
        cls = ray.remote(num_cpus=1, num_gpus=num_gpus, max_concurrency=2)(Learner)
        self.cfg = cfg
        self.group = reserve(cfg, "learner")  # every rank's resources at once, packed onto the learner nodes
        d = cfg.speculation.distill  # rank 0 leaves the distiller its share of its GPU (0 unless cuda: configs/)
        share = d.num_gpus if d.every_versions > 0 else 0.0
        self.ranks = [cls.options(name=f"learner-{r}", scheduling_strategy=slot(self.group, r),
                                  num_gpus=num_gpus - (share if r == 0 else 0.0)).remote(
                          cfg, policy_dir, reference_dir, plan, r, **({"keys": keys, "distiller": distiller}
                                                                      if r == 0 else {}))
                      for r in range(cfg.learner.num_ranks)]
        self.server_public = None if keys is None else keys.public
        self.rank0 = self.ranks[0]

    def start(self, resume: str | None) -> None:
        """Every rank joins the process group and builds its DeepSpeed engine, loading checkpoint `resume` if given;
        a TimeoutError past `longer_deadline` (ranks that hang while starting are lost like ones in a step)."""
        timeout = longer_deadline(self.cfg)
        try:
            self.trajectory_endpoint, self.weight_endpoint = ray.get(self.rank0.endpoints.remote(), timeout=timeout)
            master = ray.get(self.rank0.master_address.remote(), timeout=timeout)
            ray.get([r.start.remote(master, resume) for r in self.ranks], timeout=timeout)  # process group, engines
            self.check_shared_dir(self.cfg.logging.dir, timeout)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"the learner ranks did not start within {timeout:g} s") from None

    def check_shared_dir(self, run_dir: str, timeout: float | None) -> None:
        """Every rank writes into the run's directory, rank 0 seals the checkpoints: it must see what the others
        wrote (ranks on several nodes need a shared file system)."""
        marks = f"{run_dir}/.learner_ranks"
        seen_by_rank = ray.get(self.all("mark_directory", marks), timeout=timeout)
        try:
            ray.get(self.rank0.check_shared.remote(marks, seen_by_rank),  # (it waits for a shared listing itself)
                    timeout=None if timeout is None else timeout + SHARED_WAIT_S)
        except ray.exceptions.RayTaskError as e:
            raise ConfigError(f"key 'logging.dir' = {run_dir!r}: {e.cause}") from None

    def all(self, method: str, *args) -> list[ray.ObjectRef]:
        """Calls `method` on every rank; rank 0's result comes first."""
        return [getattr(r, method).remote(*args) for r in self.ranks]
