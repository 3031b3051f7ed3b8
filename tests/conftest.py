import sys
import threading
import time

import pytest

from actor.engine import set_env_defaults

# In-process vLLM engines, CPU DeepSpeed, and no OpenMP busy-waiting on a 2-core machine (what launch.py sets).
# Ray's token authentication too, as the launcher has it: Ray reads the mode when it is first imported, and test
# modules import it at collection, before any launch could set it (a mismatch fails every later ray.init).
set_env_defaults({"DS_ACCELERATOR": "cpu", "RAY_AUTH_MODE": "token"})


class _ActorInjection(threading.Thread):
    """Waits for a live run's first rollout actor and runs `fn(actor)` inside it (Ray's `__ray_call__`; `fn` is
    shipped by value). It imports nothing of Ray itself: the launcher sets Ray's environment before its first import."""

    def __init__(self, fn):
        super().__init__(daemon=True)
        self.fn, self.injected = fn, False

    def run(self) -> None:
        deadline = time.time() + 300
        while time.time() < deadline:
            ray = sys.modules.get("ray")
            try:
                actor = ray.get_actor("rollout-0") if ray is not None and ray.is_initialized() else None
            except (ValueError, AttributeError):  # not started yet, or Ray still importing
                actor = None
            if actor is not None:
                ray.get(actor.__ray_call__.remote(self.fn))
                self.injected = True
                return
            time.sleep(0.2)


@pytest.fixture
def inject_into_actor():
    """`inject_into_actor(fn)` starts an `_ActorInjection` before a test launches a run; join it after, then check
    `.injected`."""

    def start(fn) -> _ActorInjection:
        injection = _ActorInjection(fn)
        injection.start()
        return injection

    return start
