"""The parts of the lossless core and of the distiller that are plain torch, measured on one CUDA GPU: what a GPU
machine without vLLM can check (the coupled sampler, verification against plain decoding, the distiller).

    python -m bench.gpu_torch --out runs/bench/gpu_torch.json [--quick] [--prompts N --task-seed S --max-tokens T]
                              [--sections noise sampler verify group distiller] [--attention sdpa|eager]
                              [--settings bfloat16,T=1 bfloat16,T=0 float32,T=1]

1. `noise`: the coupled sampler's noise and samples are the same on the GPU as on the CPU (its contract says they
   are: integer hashing only), over every token of a 152k vocabulary, at T = 1 and under top-k / top-p.
2. `sampler`: the coupled sampler at rollout-engine shapes (rows x a 151,936-token vocabulary, bf16 logits in):
   milliseconds per call, GPU memory it takes beyond its input and output, host synchronisations per call, and
   whether its fused noise kernel's samples equal the contract's definition computed unfused.
3. `verify_vs_decode`: speculative decoding (oracle drafts: plain decoding's own tokens, k = 4, so every verify step
   runs k + 1 query tokens) against plain decoding (one token per forward), same seeds, with Hugging Face
   transformers (sdpa attention unless --attention eager, batch 1) on the GPU preset's cost-padded target
   (bench/padded_target.py), in bf16 and fp32: the fraction of identical sequences, and of positions whose logits
   are bit-identical. A verify forward and a decode forward may take different matmul and attention kernels; this
   measures what that does to the tokens. vLLM's kernels are not these (vLLM is not installed on the GPU machines
   lent here).
4. `group_vs_alone`: plain decoding of a GRPO group (one prompt, G seeds) as one batch against each of its
   sequences decoded alone (batch 1), in bf16 and fp32: how often batching alone changes a token, the scale against
   which `verify_vs_decode`'s flips are read (a rollout engine batches requests whether or not it speculates).
5. `distiller`: one step of `learner/distill.py` (128 trajectories of grpo_tiny-like lengths) on the GPU
   (`speculation.distill.num_gpus` > 0) against one CPU thread (the default, idle-scheduled actor), with the
   built-in draft LM and with each `--draft-shapes` HIDDEN,LAYERS one (a Qwen3 of that shape with the built-in
   draft LM's tokenizer, random weights: what a larger draft LM costs to distil, not what it learns).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from sampling.coupled import coupled_sample, gumbel, noise_bits, processed_logits, verify

VOCAB = 151_936  # Qwen's
SECTIONS = ("noise", "sampler", "verify", "group", "distiller")
SETTINGS = ("bfloat16,T=1", "bfloat16,T=0", "float32,T=1")


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - start)
    return out


def noise(rows: int) -> dict:
    seeds = torch.randint(0, 2**62, (rows,))
    positions = torch.randint(0, 4096, (rows,))
    cpu, gpu = gumbel(seeds, positions, VOCAB), gumbel(seeds.cuda(), positions.cuda(), VOCAB).cpu()
    logits = torch.randn(rows, VOCAB) * 3
    result = {"rows": rows, "vocab": VOCAB,
              "bits_identical": torch.equal(noise_bits(seeds, positions, VOCAB),
                                            noise_bits(seeds.cuda(), positions.cuda(), VOCAB).cpu()),
              "noise_bit_identical_fraction": float((cpu == gpu).double().mean()),
              "noise_max_relative_diff": float(((cpu - gpu).abs() / cpu.abs().clamp(min=1e-300)).max()),
              "noise_max_abs_diff": float((cpu - gpu).abs().max())}
    settings = {"T=1": (1.0, None, None), "T=0.7,top_k=20": (0.7, 20, None), "T=1,top_p=0.9": (1.0, None, 0.9)}
    for name, (t, k, p) in settings.items():
        args = [torch.full((rows,), t), None if k is None else torch.full((rows,), k),
                None if p is None else torch.full((rows,), p)]
        cpu, _ = coupled_sample(logits, seeds, positions, *args)
        gpu, _ = coupled_sample(logits.cuda(), seeds.cuda(), positions.cuda(),
                                *[a if a is None else a.cuda() for a in args])
        result[f"samples_equal_{name}"] = float((cpu == gpu.cpu()).float().mean())
    return result


def sampler(rows: int, top_p: bool) -> dict:
    logits = torch.randn(rows, VOCAB, device="cuda", dtype=torch.bfloat16) * 3
    seeds = torch.randint(0, 2**62, (rows,), device="cuda")
    positions = torch.randint(0, 4096, (rows,), device="cuda")
    temperature = torch.ones(rows, device="cuda")
    p = torch.full((rows,), 0.9, device="cuda") if top_p else None

    def call():
        return coupled_sample(logits, seeds, positions, temperature, None, p)

    start = time.perf_counter()
    tokens = call()[0]
    first = time.perf_counter() - start  # includes compiling the fused kernel for a new shape class
    masked = processed_logits(logits, temperature, None, p)
    reference = torch.cat([(masked[i : i + 64].double() + gumbel(seeds[i : i + 64], positions[i : i + 64], VOCAB))
                           .argmax(-1) for i in range(0, rows, 64)])  # the contract's definition, unfused
    equal = float((tokens == reference).float().mean())
    del masked, reference
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = call()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - out[1].numel() * out[1].element_size()
    del out
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    torch.cuda.set_sync_debug_mode(0)
    seconds = timed(call, 10)
    return {"rows": rows, "top_p": 0.9 if top_p else 1.0, "ms_median": 1e3 * statistics.median(seconds),
            "first_call_s": first, "tokens_equal_unfused": equal,
            "workspace_mib": extra / 2**20, "output_mib": rows * VOCAB * 4 / 2**20,
            "host_syncs_per_call": sum("synchroniz" in str(w.message) for w in caught)}


@torch.no_grad()
def decode(model, prompt: list[int], seed: int, temperature: float, max_tokens: int, eos: int,
           oracle: list[int] | None, k: int) -> tuple[list[int], list[torch.Tensor]]:
    """Plain decoding (`oracle` None: one token per forward) or coupled speculative decoding drafting `oracle`'s
    next k tokens. The tokens and each token's logits row."""
    from transformers import DynamicCache

    cache, device = DynamicCache(), next(model.parameters()).device

    def forward(ids: list[int]) -> torch.Tensor:
        return model(input_ids=torch.tensor([ids], device=device), past_key_values=cache, use_cache=True).logits[0]

    def sample(rows: torch.Tensor, first: int) -> torch.Tensor:
        n = rows.shape[0]
        return coupled_sample(rows.float(), torch.full((n,), seed, device=device),
                              torch.arange(first, first + n, device=device),
                              torch.full((n,), temperature, device=device))[0]

    logits = forward(prompt)[-1:]
    tokens, rows = [int(sample(logits, 0))], [logits[0].float().cpu()]
    while tokens[-1] != eos and len(tokens) < max_tokens:
        drafts = [] if oracle is None else oracle[len(tokens) : len(tokens) + min(k, max_tokens - len(tokens) - 1)]
        logits = forward([tokens[-1], *drafts])
        samples = sample(logits, len(tokens))
        if drafts:
            samples = verify(samples, torch.tensor(drafts, device=device), torch.tensor([len(drafts)], device=device),
                             len(drafts))[0]
        committed = [int(s) for s in samples if s >= 0]
        for j, token in enumerate(committed):
            tokens.append(token)
            rows.append(logits[j].float().cpu())
            if token == eos or len(tokens) == max_tokens:
                break
        extra = cache.get_seq_length() - (len(prompt) + len(tokens) - 1)  # rejected drafts' entries
        if extra:
            cache.crop(-extra)
    return tokens, rows


def compared(pairs: list[tuple[list[int], list[torch.Tensor], list[int], list[torch.Tensor]]]) -> dict:
    """Two decodings of each sequence (tokens and logits rows each): the fraction identical, and over the positions
    both reached with the same tokens before them, the fraction of bit-identical logits rows and the largest
    difference."""
    identical = positions = bit_identical = 0
    worst = 0.0
    for tokens, rows, other_tokens, other_rows in pairs:
        identical += tokens == other_tokens
        for j, (a, b) in enumerate(zip(rows, other_rows)):
            if tokens[:j] != other_tokens[:j]:
                break
            positions += 1
            bit_identical += torch.equal(a, b)
            worst = max(worst, float((a - b).abs().max()))
    return {"identical_sequences": identical / len(pairs), "positions_compared": positions,
            "bit_identical_logits": bit_identical / max(positions, 1), "max_abs_logit_diff": worst}


def verify_vs_decode(model, prompts: list[list[int]], eos: int, max_tokens: int, temperature: float) -> dict:
    pairs = []
    for i, prompt in enumerate(prompts):
        plain, plain_rows = decode(model, prompt, 1000 + i, temperature, max_tokens, eos, None, 4)
        pairs.append((plain, plain_rows, *decode(model, prompt, 1000 + i, temperature, max_tokens, eos, plain, 4)))
    return {"sequences": len(prompts), **compared(pairs)}


@torch.no_grad()
def decode_group(model, prompt: list[int], seeds: list[int], temperature: float, max_tokens: int,
                 eos: int) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """Plain decoding of one prompt under several seeds as one batch (one row per seed, one token per forward;
    a finished row keeps decoding its eos, unrecorded). Each row's tokens and each token's logits row."""
    from transformers import DynamicCache

    cache, device, n = DynamicCache(), next(model.parameters()).device, len(seeds)
    seed_rows, temperatures = torch.tensor(seeds, device=device), torch.full((n,), temperature, device=device)
    ids = torch.tensor([prompt] * n, device=device)
    tokens: list[list[int]] = [[] for _ in seeds]
    rows: list[list[torch.Tensor]] = [[] for _ in seeds]
    for position in range(max_tokens):
        live = [i for i, t in enumerate(tokens) if not t or t[-1] != eos]
        if not live:
            break
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1]
        samples = coupled_sample(logits.float(), seed_rows, torch.full((n,), position, device=device),
                                 temperatures)[0]
        for i in live:
            tokens[i].append(int(samples[i]))
            rows[i].append(logits[i].float().cpu())
        ids = torch.tensor([[t[-1]] for t in tokens], device=device)
    return tokens, rows


def group_vs_alone(model, prompts: list[list[int]], eos: int, max_tokens: int, temperature: float,
                   group: int) -> dict:
    pairs = []
    for i, prompt in enumerate(prompts):
        seeds = [1000 + group * i + j for j in range(group)]
        batched, batched_rows = decode_group(model, prompt, seeds, temperature, max_tokens, eos)
        for seed, together, together_rows in zip(seeds, batched, batched_rows):
            pairs.append((*decode(model, prompt, seed, temperature, max_tokens, eos, None, 4), together, together_rows))
    return {"groups": len(prompts), "group_size": group, **compared(pairs)}


def draft_shape(text: str) -> tuple[int, int]:
    """`--draft-shapes` HIDDEN,LAYERS: two positive integers."""
    try:
        hidden, layers = (int(x) for x in text.split(","))
    except ValueError:
        hidden = layers = 0
    if min(hidden, layers) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not HIDDEN,LAYERS (two positive integers)")
    return hidden, layers


def draft_of_shape(hidden: int, layers: int, directory: Path) -> int:
    """Writes a Qwen3 draft LM of `hidden` x `layers` (heads of 64, a quarter as many key-value heads, MLP 3x wide;
    random weights) with the built-in draft LM's tokenizer to `directory`; returns its parameter count."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    from models.zoo import resolve

    builtin = resolve("builtin:draft")
    heads = max(1, hidden // 64)
    config = AutoConfig.from_pretrained(str(builtin))
    config.hidden_size, config.num_hidden_layers, config.intermediate_size = hidden, layers, 3 * hidden
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = heads, max(1, heads // 4), 64
    config.layer_types = ["full_attention"] * layers
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(builtin / name, directory / name)
    return sum(p.numel() for p in model.parameters())


def distiller_step(device: str, steps: int, draft: Path | None = None) -> dict:
    from configs.load import load_config
    from learner.distill import DraftDistiller, teacher_batch
    from learner.grpo import Packed
    from transport.messages import SCHEMA_VERSION, Trajectory

    gpu = ["cluster.device=cuda", "speculation.distill.num_gpus=0.5"] if device == "cuda" else []
    model = [f"speculation.options.model={draft}"] if draft else []
    cfg = load_config("grpo_tiny", ["speculation.method=draft_lm", "speculation.distill.every_versions=2", *gpu,
                                    *model])
    torch.set_num_threads(1)  # the CPU distiller's actor runs one thread
    distiller = DraftDistiller(cfg)
    rng = random.Random(0)

    def trajectory(group: int, index: int) -> Trajectory:
        response = [rng.randrange(1, 270) for _ in range(min(45, max(2, int(rng.expovariate(1 / 16)))))]
        return Trajectory(schema=SCHEMA_VERSION, actor_id=0, seq=0, group_id=group, group_size=8, sample_index=index,
                          prompt_ids=[rng.randrange(1, 270) for _ in range(20)], response_ids=response,
                          behaviour_logprobs=[0.0] * len(response), policy_versions=[0] * len(response),
                          reward=0.0, finish_reason="stop", generate_seconds=0.0)

    seconds = []
    for version in range(1, steps + 1):
        trajectories = [trajectory(g, i) for g in range(16) for i in range(8)]
        batches = []
        for start in range(0, len(trajectories), 8):
            part = trajectories[start : start + 8]
            teacher = torch.randn(8, Packed(part).targets.shape[1], 272).log_softmax(-1)
            batches.append(teacher_batch(cfg, part, teacher))
        begin = time.perf_counter()
        metrics = distiller.step(version, batches)
        seconds.append(time.perf_counter() - begin)
    return {"device": device, "draft": str(draft or "builtin:draft"), "trajectories_per_step": 128, "steps": steps,
            "step_s_median_after_first": statistics.median(seconds[1:]), "step_s": seconds,
            "last_replayed_acceptance": metrics["draft/replayed_acceptance"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench/gpu_torch.json"))
    parser.add_argument("--quick", action="store_true", help="small shapes and counts (a check of the script)")
    parser.add_argument("--prompts", type=int, default=24, help="verify_vs_decode: sequences per setting")
    parser.add_argument("--task-seed", type=int, default=7, help="verify_vs_decode: the arithmetic task's seed")
    parser.add_argument("--max-tokens", type=int, default=48, help="verify_vs_decode: tokens per sequence at most")
    parser.add_argument("--groups", type=int, default=8, help="group_vs_alone: GRPO groups (prompts) decoded")
    parser.add_argument("--group-size", type=int, default=8, help="group_vs_alone: sequences per group")
    parser.add_argument("--attention", choices=("sdpa", "eager"), default="sdpa",
                        help="verify/group: the transformers attention implementation")
    parser.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS),
                        help="verify/group: which dtype and temperature settings to run (default: all)")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                        help="which measurements to run (default: all)")
    parser.add_argument("--draft-shapes", nargs="*", default=[], type=draft_shape, metavar="HIDDEN,LAYERS",
                        help="distiller: larger draft LMs to time beside the built-in one (e.g. 512,4 1024,8)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.gpu_torch needs a CUDA GPU; this machine has none (torch.cuda.is_available() is False)",
              file=sys.stderr)
        return 2
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench.padded_target import build_padded_target, parameter_count
    from models.zoo import resolve
    from tasks.arithmetic import ArithmeticTask

    quick, sections = args.quick, set(args.sections)
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "sections": args.sections,
                    "settings": args.settings,
                    "attention": args.attention,
                    "verify_workload": {"prompts": args.prompts, "task_seed": args.task_seed,
                                        "max_tokens": args.max_tokens, "groups": args.groups,
                                        "group_size": args.group_size}}
    if "noise" in sections:
        result["noise"] = noise(64 if quick else 256)
        print("noise", result["noise"], flush=True)
    if "sampler" in sections:
        result["sampler"] = [sampler(rows, top_p) for rows in ([64] if quick else [256, 1024, 4096])
                             for top_p in (False, True)]
        for row in result["sampler"]:
            print("sampler", row, flush=True)

    if sections & {"verify", "group"}:
        policy = resolve("builtin:dense")
        tokenizer = AutoTokenizer.from_pretrained(str(policy))
        task = ArithmeticTask(seed=args.task_seed)
        prompts = [tokenizer(task[i].prompt)["input_ids"] for i in range(8 if quick else args.prompts)]
        eos = tokenizer.eos_token_id
        with tempfile.TemporaryDirectory() as tmp:
            shape = dict(zero_layers=2, num_heads=8, intermediate_size=1024) if quick else \
                dict(zero_layers=24, num_heads=64, intermediate_size=6144, hidden_size=2048)  # the gpu preset's
            config = build_padded_target(policy, Path(tmp), **shape)
            result["target"] = {**shape, "parameters": parameter_count(config)}
            for dtype in (torch.bfloat16, torch.float32):
                settings = [(name, float(name.split("T=")[1])) for name in args.settings
                            if name.startswith(str(dtype).removeprefix("torch.") + ",")]
                if not settings:
                    continue
                model = AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype, attn_implementation=args.attention)
                model = model.cuda().eval()
                for name, temperature in settings:
                    runs = {"verify": ("verify_vs_decode", lambda: verify_vs_decode(
                                model, prompts, eos, args.max_tokens, temperature)),
                            "group": ("group_vs_alone", lambda: group_vs_alone(
                                model, prompts[: args.groups], eos, args.max_tokens, temperature, args.group_size))}
                    for section, (key, run) in runs.items():
                        if section not in sections or (section == "group" and temperature == 0):
                            continue  # greedy rows of one prompt are all one sequence
                        begin = time.perf_counter()
                        result.setdefault(key, {})[name] = {**run(), "seconds": round(time.perf_counter() - begin)}
                        print(key, name, result[key][name], flush=True)
                del model
                torch.cuda.empty_cache()
    if "distiller" in sections:
        result["distiller"] = [distiller_step(device, 3 if quick else 5) for device in ("cuda", "cpu")]
        for row in result["distiller"]:
            print("distiller", row, flush=True)
        for hidden, layers in args.draft_shapes:
            with tempfile.TemporaryDirectory() as tmp:
                parameters = draft_of_shape(hidden, layers, Path(tmp))
                for device in ("cuda", "cpu"):
                    row = {**distiller_step(device, 2, Path(tmp)), "draft": f"{hidden},{layers}",
                           "parameters": parameters}
                    result["distiller"].append(row)
                    print("distiller", row, flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
