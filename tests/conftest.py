from actor.engine import set_env_defaults

# In-process vLLM engines, CPU DeepSpeed, and no OpenMP busy-waiting on a 2-core machine (what launch.py sets).
set_env_defaults({"DS_ACCELERATOR": "cpu"})
