from actor.engine import set_env_defaults

# In-process vLLM engines, CPU DeepSpeed, and no OpenMP busy-waiting on a 2-core machine (what launch.py sets).
# Ray's token authentication too, as the launcher has it: Ray reads the mode when it is first imported, and test
# modules import it at collection, before any launch could set it (a mismatch fails every later ray.init).
set_env_defaults({"DS_ACCELERATOR": "cpu", "RAY_AUTH_MODE": "token"})
