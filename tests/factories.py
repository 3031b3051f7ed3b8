"""The one factory of test trajectories: a well-formed `Trajectory` whose fields a test overrides by keyword."""

from transport.messages import SCHEMA_VERSION, SpecStats, Trajectory


def trajectory(*, response_ids=(3, 4, 5), behaviour_logprobs=None, policy_versions=None, **fields) -> Trajectory:
    """Defaults: actor 0's sample 0 of group 0 (of 2), prompt [1, 2], reward 1.0, logprob -0.5 and version 0 per
    answer token; `spec` may be given as a SpecStats or as its fields (`spec={"verify_steps": 2}`)."""
    response_ids = list(response_ids)
    n = len(response_ids)
    spec = fields.pop("spec", SpecStats())
    defaults = dict(schema=SCHEMA_VERSION, actor_id=0, seq=0, group_id=0, group_size=2, sample_index=0,
                    prompt_ids=[1, 2], reward=1.0, finish_reason="stop", generate_seconds=0.1)
    return Trajectory(**{**defaults, **fields}, response_ids=response_ids,
                      behaviour_logprobs=[-0.5] * n if behaviour_logprobs is None else list(behaviour_logprobs),
                      policy_versions=[0] * n if policy_versions is None else list(policy_versions),
                      spec=spec if isinstance(spec, SpecStats) else SpecStats(**spec))
