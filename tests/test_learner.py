"""The learner's GRPO step moves the policy the right way: after a few steps on one batch, the rewarded
response of each group is more likely and the unrewarded ones less likely (real DeepSpeed, built-in policy)."""

import pytest
import torch
import transformers

from configs.load import load_config
from learner.grpo import token_logprobs
from models.zoo import resolve
from transport.messages import SCHEMA_VERSION, Trajectory

GROUPS = [("Question: 3+4=?\nAnswer:", [" 3+4=7\n#### 7", " 3+4=8\n#### 8", " 3+4=9\n#### 9", " 3+4=6\n#### 6"]),
          ("Question: 9-2=?\nAnswer:", [" 9-2=7\n#### 7", " 9-2=6\n#### 6", " 9-2=5\n#### 5", " 9-2=8\n#### 8"])]


def test_grpo_steps_raise_rewarded_and_lower_unrewarded_responses(monkeypatch):
    from learner.learner import Learner

    model_dir = resolve("builtin:dense")
    cfg = load_config("grpo_tiny", ["rollout.prompts_per_step=2", "rollout.group_size=4",
                                    "learner.micro_batch_size=4", "learner.lr=1e-5"])
    learner = Learner(cfg, str(model_dir))
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)

    def logprob(prompt: list[int], response: list[int]) -> float:
        with torch.no_grad():
            logits = learner.engine.module(input_ids=torch.tensor([prompt + response])).logits[0]
        return token_logprobs(logits[len(prompt) - 1 : -1], torch.tensor(response), 1.0).sum().item()

    groups = []
    for g, (prompt, responses) in enumerate(GROUPS):
        p = tok(prompt, add_special_tokens=False).input_ids
        group = []
        for i, text in enumerate(responses):  # the first response of each group is the correct one
            r = tok(text, add_special_tokens=False).input_ids + [tok.eos_token_id]
            with torch.no_grad():
                logits = learner.engine.module(input_ids=torch.tensor([p + r])).logits[0]
            behaviour = token_logprobs(logits[len(p) - 1 : -1], torch.tensor(r), 1.0).tolist()
            group.append(Trajectory(SCHEMA_VERSION, 0, i, g, 4, i, p, r, behaviour, [0] * len(r),
                                    1.0 if i == 0 else 0.0, "stop", 0.1))
        groups.append(group)
    before = [[logprob(t.prompt_ids, t.response_ids) for t in g] for g in groups]
    monkeypatch.setattr(learner, "collect", lambda: (groups, 0.0))
    monkeypatch.setattr(learner, "publish", lambda: 0)
    for _ in range(3):
        metrics = learner.step()
    after = [[logprob(t.prompt_ids, t.response_ids) for t in g] for g in groups]
    assert metrics["rl/reward_mean"] == pytest.approx(0.25)
    for b, a in zip(before, after):
        assert a[0] > b[0]  # rewarded: more likely
        assert sum(a[1:]) < sum(b[1:])  # unrewarded: less likely overall
