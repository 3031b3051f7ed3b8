"""Crash-safe checkpoints (learner/checkpoint.py): a checkpoint becomes visible whole or not at all, resuming takes the
newest complete checkpoint of the run that last wrote the directory, and never one an earlier run left there."""

import hashlib
import json
from pathlib import Path

import pytest

from learner.checkpoint import (RUN_FILE, UnsharedDirectory, check_sees_all, files_under, find_checkpoint, partial,
                               passed_over, seal)


def write(root, step: int, run_id: str, payload: bytes = b"weights", config: dict | None = None) -> None:
    """A sealed checkpoint of `run_id` at `step` under run directory `root` (`config`: what state.json keeps of the
    run's config, `learner.checkpoint.resume_config`)."""
    final = root / "checkpoints" / f"step_{step}"
    (partial(final) / "hf").mkdir(parents=True)
    (partial(final) / "hf" / "model.safetensors").write_bytes(payload)
    (partial(final) / "deepspeed").mkdir()
    (partial(final) / "deepspeed" / "state.pt").write_bytes(b"optimizer")
    seal(final, {"version": step, "run_id": run_id, "data_cursor": 2 * step, **({"config": config} if config else {})})


def test_a_resume_takes_only_a_checkpoint_dir_by_its_name_and_whole_parts(tmp_path):
    """checkpoints/step_N exactly (a copy named step_4_extra, or step_² whose digit int() cannot read, is no step),
    and a manifest that lists every part: one emptied to list none is no checkpoint."""
    (tmp_path / RUN_FILE).write_text(json.dumps({"run_id": "a"}))
    write(tmp_path, 2, "a")
    write(tmp_path, 3, "a")
    for stray in ("step_4_extra", "step_\u00b2"):
        (tmp_path / "checkpoints" / stray).mkdir()
        (tmp_path / "checkpoints" / stray / "manifest.json").write_text(json.dumps({"run_id": "a", "files": {}}))
    (tmp_path / "checkpoints" / "step_3" / "manifest.json").write_text(json.dumps({"run_id": "a", "files": {}}))
    assert find_checkpoint(str(tmp_path)).name == "step_2"


def test_sealed_checkpoints_are_found_newest_first_and_partial_ones_never(tmp_path):
    (tmp_path / RUN_FILE).write_text(json.dumps({"run_id": "a"}))
    write(tmp_path, 2, "a")
    write(tmp_path, 4, "a")
    (tmp_path / "checkpoints" / "step_6.partial" / "hf").mkdir(parents=True)  # a crash mid-save
    assert find_checkpoint(str(tmp_path)).name == "step_4"
    assert not (tmp_path / "checkpoints" / "step_4.partial").exists()
    manifest = json.loads((tmp_path / "checkpoints" / "step_4" / "manifest.json").read_text())
    assert manifest["files"]["hf/model.safetensors"] == {"size": len(b"weights"), "sha256": hashlib.sha256(
        b"weights").hexdigest()} and manifest["run_id"] == "a"


def test_a_damaged_checkpoint_falls_back_to_the_previous_one(tmp_path):
    (tmp_path / RUN_FILE).write_text(json.dumps({"run_id": "a"}))
    write(tmp_path, 2, "a")
    write(tmp_path, 4, "a")
    (tmp_path / "checkpoints" / "step_4" / "hf" / "model.safetensors").write_bytes(b"trunc")  # torn write
    assert find_checkpoint(str(tmp_path)).name == "step_2"
    with pytest.raises(FileNotFoundError, match="incomplete or damaged checkpoint"):
        find_checkpoint(str(tmp_path / "checkpoints" / "step_4"))
    # the resume says what it passed over (the driver warns), unless it was asked for that checkpoint by name
    taken = find_checkpoint(str(tmp_path))
    assert passed_over(str(tmp_path), taken) == [tmp_path / "checkpoints" / "step_4"]
    assert passed_over(str(taken), taken) == []


@pytest.mark.parametrize("damaged", ["state.json", "hf/model.safetensors"])
def test_a_checkpoint_damaged_in_place_at_the_same_size_falls_back_to_the_previous_one(tmp_path, damaged):
    (tmp_path / RUN_FILE).write_text(json.dumps({"run_id": "a"}))
    write(tmp_path, 2, "a")
    write(tmp_path, 4, "a")
    path = tmp_path / "checkpoints" / "step_4" / damaged
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF  # one flipped byte: the size is what the manifest says
    path.write_bytes(bytes(data))
    assert find_checkpoint(str(tmp_path)).name == "step_2"


def test_resuming_from_an_older_checkpoint_of_a_run_is_a_branch(tmp_path):
    """A resume from the newest checkpoint continues its run (same id); from an older one it branches (the driver
    gives it an id of its own), so its restarts never find the abandoned timeline's newer checkpoints."""
    from learner.checkpoint import is_branch

    (tmp_path / RUN_FILE).write_text(json.dumps({"run_id": "a"}))
    write(tmp_path, 2, "a")
    write(tmp_path, 4, "a")
    assert is_branch(tmp_path / "checkpoints" / "step_2") and not is_branch(tmp_path / "checkpoints" / "step_4")
    (tmp_path / RUN_FILE).write_text(json.dumps({"run_id": "b"}))  # the branch took the directory over
    write(tmp_path, 3, "b")
    assert find_checkpoint(str(tmp_path)).name == "step_3"  # not the abandoned step_4


def test_a_run_directory_reused_by_a_fresh_run_never_resumes_the_old_runs_checkpoints(tmp_path):
    write(tmp_path, 300, "old")  # a finished run's last checkpoint
    (tmp_path / RUN_FILE).write_text(json.dumps({"run_id": "new"}))  # a fresh run took the directory over
    with pytest.raises(FileNotFoundError, match="complete checkpoint"):
        find_checkpoint(str(tmp_path))
    write(tmp_path, 10, "new")
    assert find_checkpoint(str(tmp_path)).name == "step_10"


def test_sealing_again_replaces_a_checkpoint_of_the_same_step(tmp_path):
    (tmp_path / RUN_FILE).write_text(json.dumps({"run_id": "new"}))
    write(tmp_path, 5, "old", b"old weights")
    write(tmp_path, 5, "new", b"new")
    found = find_checkpoint(str(tmp_path))
    assert (found / "hf" / "model.safetensors").read_bytes() == b"new"
    assert not (tmp_path / "checkpoints" / "step_5.old").exists()


def test_a_fresh_run_refuses_a_directory_holding_another_runs_checkpoints_unless_told(tmp_path):
    from configs.load import ConfigError
    from driver.preflight import load_run_config

    (tmp_path / RUN_FILE).write_text(json.dumps({"run_id": "old"}))
    write(tmp_path, 7, "old")
    fresh = ["trainer.steps=20", f"logging.dir={tmp_path}"]
    with pytest.raises(ConfigError, match=r"'logging.dir'.*another run's checkpoints \(newest step_7\).*resume_from"):
        load_run_config("grpo_tiny", [*fresh, "logging.overwrite=false"])
    assert load_run_config("grpo_tiny", [*fresh, "logging.overwrite=false", f"trainer.resume_from={tmp_path}"])
    assert load_run_config("grpo_tiny", [*fresh, "logging.overwrite=true"])
    other = tmp_path / "other"  # continuing a third run into this directory would mix two runs' checkpoints
    (other / RUN_FILE).parent.mkdir()
    (other / RUN_FILE).write_text(json.dumps({"run_id": "third"}))
    write(other, 3, "third")
    with pytest.raises(ConfigError, match="another run's checkpoints"):
        load_run_config("grpo_tiny", [*fresh, "logging.overwrite=false", f"trainer.resume_from={other}"])
    assert load_run_config("grpo_tiny", ["trainer.steps=20", f"logging.dir={tmp_path / 'empty'}",
                                     "logging.overwrite=false"])


def test_overwrite_refuses_a_run_that_starts_from_a_model_it_would_delete(tmp_path):
    """A policy fine-tuned by an earlier run in the same directory: logging.overwrite deletes that run's checkpoints
    before this one starts, its model among them, and every process would fail to load it."""
    import shutil

    from configs.load import ConfigError
    from driver.preflight import load_run_config
    from models.zoo import resolve

    policy, draft = tmp_path / "checkpoints" / "step_7" / "hf", tmp_path / "checkpoints" / "step_7" / "draft"
    shutil.copytree(resolve("builtin:dense"), policy)
    shutil.copytree(resolve("builtin:draft"), draft)
    (tmp_path / RUN_FILE).write_text(json.dumps({"run_id": "old"}))
    start = [f"model.path={policy}", "logging.overwrite=true"]
    with pytest.raises(ConfigError, match=r"'model.path' = .* is inside .*checkpoints, which logging.overwrite delet"):
        load_run_config("grpo_tiny", [*start, f"logging.dir={tmp_path}"])
    assert load_run_config("grpo_tiny", [*start, f"logging.dir={tmp_path / 'next'}"])
    drafting = ["logging.overwrite=true", f"logging.dir={tmp_path}", "speculation.method=draft_lm"]
    with pytest.raises(ConfigError, match=r"'speculation.options.model' = .* is inside .*checkpoints"):
        load_run_config("grpo_tiny", [*drafting, f"speculation.options.model={draft}"])
    with pytest.raises(ConfigError, match=r"'speculation.options.draft_lm.model' = .* is inside .*checkpoints"):
        load_run_config("grpo_tiny", [*drafting[:-1], "speculation.method=fastest_of_n",
                                      "speculation.drafters=[suffix,draft_lm]",
                                      f"speculation.options.draft_lm.model={draft}"])


@pytest.mark.parametrize("override,key", [("model.path=builtin:moe", "model.path"), ("seed=7", "seed"),
                                          ("learner.zero_stage=3", "learner.zero_stage"),
                                          ("learner.dtype=bfloat16", "learner.dtype"),
                                          ("data.max_ops=3", "data.max_ops"),
                                          ("speculation.options={model: builtin:dense}",
                                           "speculation.options.model")])
def test_a_resume_keeps_what_its_checkpoints_weights_data_order_and_optimizer_state_depend_on(tmp_path, override, key):
    """The checkpoint's weights were trained from its model, its data cursor counts in its seed's order, its optimizer
    state is sharded as its ranks were: a resume that changes one of them is refused at load, naming the key (it
    trained another model silently, took other prompts, or failed inside DeepSpeed)."""
    from configs.load import ConfigError, load_config
    from driver.preflight import load_run_config
    from learner.checkpoint import resume_config

    distilled = ["speculation.method=draft_lm", "speculation.distill.every_versions=4"]  # (draft/ holds its weights)
    cfg = load_config("grpo_tiny", distilled)
    write(tmp_path, 2, "a", config=resume_config(cfg))
    (tmp_path / RUN_FILE).write_text(json.dumps({"run_id": "a"}))
    resume = ["trainer.steps=20", f"logging.dir={tmp_path}", f"trainer.resume_from={tmp_path}", *distilled]
    assert load_run_config("grpo_tiny", resume)
    with pytest.raises(ConfigError, match=rf"key '{key}'.*written with"):
        load_run_config("grpo_tiny", [*resume, override])


def test_a_distilled_resume_keeps_its_draft_lm_whichever_method_runs_it(tmp_path):
    """The checkpoint's draft/ holds weights of the run's draft LM: a resume with another one is refused, named by the
    key that sets it now, also where fastest-of-N runs the draft LM the checkpoint's draft_lm method ran."""
    from configs.load import ConfigError, load_config
    from driver.preflight import load_run_config
    from learner.checkpoint import resume_config

    write(tmp_path, 2, "a", config=resume_config(load_config("grpo_tiny", [
        "speculation.method=draft_lm", "speculation.distill.every_versions=4"])))
    (tmp_path / RUN_FILE).write_text(json.dumps({"run_id": "a"}))
    fastest = ["trainer.steps=20", f"logging.dir={tmp_path}", f"trainer.resume_from={tmp_path}",
               "speculation.method=fastest_of_n", "speculation.drafters=[suffix,draft_lm]",
               "speculation.distill.every_versions=4"]
    assert load_run_config("grpo_tiny", fastest)  # the same draft LM
    with pytest.raises(ConfigError, match=r"key 'speculation.options.draft_lm.model' = 'builtin:dense'.*written with"):
        load_run_config("grpo_tiny", [*fastest, "speculation.options.draft_lm.model=builtin:dense"])


def test_an_endless_streams_resume_keeps_its_held_out_problems_which_its_prompts_leave_out(tmp_path):
    """The built-in task's endless stream never draws a held-out problem, so its prompts depend on data.eval_size
    and data.eval_source: a resume that changes them is refused (with a finite training set they are free)."""
    from configs.load import ConfigError, load_config
    from driver.preflight import load_run_config
    from learner.checkpoint import resume_config

    for size, refused in (("0", True), ("1024", False)):
        run = tmp_path / size
        run.mkdir()
        write(run, 2, "a", config=resume_config(load_config("grpo_tiny", [f"data.size={size}"])))
        (run / RUN_FILE).write_text(json.dumps({"run_id": "a"}))
        resume = ["trainer.steps=20", f"logging.dir={run}", f"trainer.resume_from={run}", f"data.size={size}"]
        if refused:
            with pytest.raises(ConfigError, match=r"key 'data.eval_size' = 128.*written with 256"):
                load_run_config("grpo_tiny", [*resume, "data.eval_size=128"])
        else:
            assert load_run_config("grpo_tiny", [*resume, "data.eval_size=128"])


def test_a_resume_names_its_data_file_as_it_likes_but_keeps_the_file(tmp_path, monkeypatch):
    """The checkpoint was written with data.source as a relative path: the same file named absolutely resumes, another
    file is refused, naming the key; the arithmetic task's own keys do not bind a JSONL run."""
    from configs.load import ConfigError, load_config
    from driver.preflight import load_run_config
    from learner.checkpoint import resume_config

    data = tmp_path / "data"
    data.mkdir()
    for name in ("train.jsonl", "other.jsonl"):
        records = ({"question": f"{i}+1=?", "answer": f"{i}+1={i + 1}\n#### {i + 1}"} for i in range(40))
        (data / name).write_text("".join(json.dumps(record) + "\n" for record in records))
    monkeypatch.chdir(tmp_path)
    cfg = load_config("grpo_tiny", ["data.source=data/train.jsonl"])
    write(tmp_path / "run", 2, "a", config=resume_config(cfg))
    (tmp_path / "run" / RUN_FILE).write_text(json.dumps({"run_id": "a"}))
    resume = ["trainer.steps=20", f"logging.dir={tmp_path / 'run'}", f"trainer.resume_from={tmp_path / 'run'}"]
    assert load_run_config("grpo_tiny", [*resume, f"data.source={data / 'train.jsonl'}"])
    assert load_run_config("grpo_tiny", [*resume, "data.source=data/train.jsonl", "data.size=5", "data.max_ops=2"])
    with pytest.raises(ConfigError, match=r"key 'data.source'.*written with 'data/train.jsonl'"):
        load_run_config("grpo_tiny", [*resume, f"data.source={data / 'other.jsonl'}"])


def test_a_resume_refuses_a_data_file_edited_since_its_run_began(tmp_path, monkeypatch):
    """The run directory's run.json keeps the sha256 of data.source as the run began: the same bytes resume (the file
    rewritten unchanged too), an edited file is refused at load, naming the key (its cursor would count other
    prompts)."""
    from configs.load import ConfigError, load_config
    from driver.preflight import data_digest, load_run_config
    from learner.checkpoint import resume_config

    records = [{"question": f"{i}+1=?", "answer": f"{i}+1={i + 1}\n#### {i + 1}"} for i in range(40)]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(record) + "\n" for record in records))
    cfg = load_config("grpo_tiny", [f"data.source={data}"])
    write(tmp_path / "run", 2, "a", config=resume_config(cfg))
    (tmp_path / "run" / RUN_FILE).write_text(json.dumps({"run_id": "a", "data_sha256": data_digest(cfg)}))
    resume = ["trainer.steps=20", f"logging.dir={tmp_path / 'run'}", f"trainer.resume_from={tmp_path / 'run'}",
              f"data.source={data}"]
    data.write_text(data.read_text())  # rewritten, the same bytes
    assert load_run_config("grpo_tiny", resume)
    data.write_text("".join(json.dumps(record) + "\n" for record in reversed(records)))  # the same prompts reordered
    with pytest.raises(ConfigError, match=r"key 'data.source'.*changed since the run.*began"):
        load_run_config("grpo_tiny", resume)
    assert data_digest(load_config("grpo_tiny", [])) is None  # the arithmetic task: no file to keep


def test_rank_zero_seals_only_when_it_sees_every_ranks_files(tmp_path):
    """Two learner nodes, each writing its rank's shard on its own disk: rank 0 must refuse, naming the file."""
    def save(node, rank: int):
        shard = partial(node / "checkpoints" / "step_2") / "deepspeed"
        shard.mkdir(parents=True, exist_ok=True)
        (shard / f"zero_pp_rank_{rank}_optim_states.pt").write_bytes(b"shard")
        return files_under(partial(node / "checkpoints" / "step_2"))

    on_own_disks = [save(tmp_path / "node0", 0), save(tmp_path / "node1", 1)]
    with pytest.raises(UnsharedDirectory, match="learner rank 1 wrote deepspeed/zero_pp_rank_1_optim_states.pt"):
        check_sees_all(partial(tmp_path / "node0" / "checkpoints" / "step_2"), on_own_disks)
    shared = [save(tmp_path / "shared", 0), save(tmp_path / "shared", 1)]
    check_sees_all(partial(tmp_path / "shared" / "checkpoints" / "step_2"), shared)  # both there: sealed as usual


def test_rank_zero_waits_for_a_shared_directory_to_show_another_ranks_file(tmp_path):
    """A network file system's client may list a directory from its cache: a file another node wrote a moment ago
    shows up late, and rank 0 waits for it instead of calling the directory unshared."""
    import threading

    late = threading.Timer(0.5, lambda: (tmp_path / "rank_1").write_text("node 1"))
    late.start()
    check_sees_all(tmp_path, [[], ["rank_1"]], wait_s=10)
    late.join()
    with pytest.raises(UnsharedDirectory, match="rank_2"):
        check_sees_all(tmp_path, [[], ["rank_2"]], wait_s=1.5)


def test_overwrite_never_deletes_the_checkpoint_a_run_resumes_from(tmp_path):
    """A directory whose newest checkpoints are a branch's (run b) resumed again from run a's older one, with
    logging.overwrite: the driver took the directory for another run's and deleted every checkpoint, the one it was
    about to load included. Another run's directory, resumed from elsewhere, is still cleared."""
    from omegaconf import OmegaConf

    from driver.run import Run

    (tmp_path / RUN_FILE).write_text(json.dumps({"run_id": "b"}))
    write(tmp_path, 2, "a")
    write(tmp_path, 3, "b")
    write(tmp_path, 4, "b")

    def take(directory, resume_from):
        run = object.__new__(Run)
        run.cfg = OmegaConf.create({"logging": {"overwrite": True}, "trainer": {"resume_from": str(resume_from)}})
        run.dir = directory
        return run._take_run_dir()

    checkpoint, state = take(tmp_path, tmp_path / "checkpoints" / "step_2")
    assert checkpoint.name == "step_2" and state["version"] == 2
    assert all((tmp_path / "checkpoints" / f"step_{n}").is_dir() for n in (2, 3, 4))
    other = tmp_path / "other"
    (other / "checkpoints").mkdir(parents=True)
    (other / RUN_FILE).write_text(json.dumps({"run_id": "c"}))
    write(other, 5, "c")
    take(other, tmp_path / "checkpoints" / "step_2")
    assert not (other / "checkpoints").exists()  # another run's, not the one resumed: overwritten as asked


def test_a_crash_between_the_two_renames_of_a_seal_keeps_the_checkpoint_of_that_step(tmp_path):
    """Sealing step 5 again renames the old step_5 to step_5.old, then step_5.partial to step_5: a crash between them
    leaves no step_5, and the resume takes step_5.old (the same step), not step_2."""
    (tmp_path / RUN_FILE).write_text(json.dumps({"run_id": "a"}))
    write(tmp_path, 2, "a")
    write(tmp_path, 5, "a", b"step 5")
    checkpoints = tmp_path / "checkpoints"
    (checkpoints / "step_5").rename(checkpoints / "step_5.old")
    assert find_checkpoint(str(tmp_path)).name == "step_5.old"
    write(tmp_path, 5, "a", b"step 5 again")  # the next seal of step 5 takes its place, and removes the .old
    assert find_checkpoint(str(tmp_path)).name == "step_5" and not (checkpoints / "step_5.old").exists()


def test_a_resume_reads_a_checkpoints_bytes_once_and_still_sees_a_file_damaged_since(tmp_path):
    """The load check, the run id and the start each find the checkpoint (and learner ranks load the one found
    without hashing it again): one read of each file per process, while it stays the same file; a file rewritten
    since is hashed anew."""
    from learner.checkpoint import _sha256_of

    (tmp_path / RUN_FILE).write_text(json.dumps({"run_id": "a"}))
    write(tmp_path, 2, "a")
    write(tmp_path, 4, "a")
    assert find_checkpoint(str(tmp_path)).name == "step_4"
    read = _sha256_of.cache_info().misses
    assert find_checkpoint(str(tmp_path)).name == "step_4" and _sha256_of.cache_info().misses == read
    path = tmp_path / "checkpoints" / "step_4" / "hf" / "model.safetensors"
    path.write_bytes(b"weighTs")  # the same size, rewritten
    assert find_checkpoint(str(tmp_path)).name == "step_2"


def test_a_resumed_rank_trains_with_this_configs_lr_and_weight_decay_not_the_checkpoints(tmp_path):
    """Loading a checkpoint brings the saved optimizer's settings back with its state (DeepSpeed loads the optimizer's
    state dict, param groups included); the resumed run's learner.lr and learner.weight_decay are its own config's,
    the schedule fast-forwarded to the checkpoint's step. The engine here is a stand-in for DeepSpeed's."""
    from types import SimpleNamespace

    import torch
    from omegaconf import OmegaConf

    from learner.checkpoint import RankCheckpoints

    def optimizer(lr: float, weight_decay: float) -> torch.optim.Optimizer:
        return torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], lr=lr, weight_decay=weight_decay)

    saved = optimizer(lr=1e-3, weight_decay=0.0).state_dict()  # what the checkpoint's run trained with
    current = optimizer(lr=5e-4, weight_decay=0.5)  # this run's config, as learner/optim.py builds it
    schedule = torch.optim.lr_scheduler.LambdaLR(current, lambda step: min(1.0, (step + 1) / 4))
    engine = SimpleNamespace(optimizer=current, lr_scheduler=schedule,
                             load_checkpoint=lambda *args, **kwargs: current.load_state_dict(saved))
    (tmp_path / "state.json").write_text(json.dumps({"version": 7}))
    rank = RankCheckpoints()
    rank.engine, rank.rank, rank.distiller = engine, 1, None
    rank.cfg = OmegaConf.create({"learner": {"lr": 5e-4, "weight_decay": 0.5}})
    rank.load_checkpoint(str(tmp_path))
    assert rank.version == 7
    assert current.param_groups[0]["weight_decay"] == 0.5
    assert current.param_groups[0]["lr"] == pytest.approx(5e-4)  # past its warm-up at step 7


def test_an_unreadable_run_file_names_itself_and_takes_no_other_runs_checkpoint(tmp_path):
    """A kill or a full disk while run.json was written left it empty: a resume from the directory would have taken
    the newest checkpoint of any run there (an abandoned branch's). It is written whole or not at all now, and one
    that cannot be read is an error that names it."""
    from learner.checkpoint import mark_run

    mark_run(tmp_path, "a", None)
    write(tmp_path, 2, "a")
    write(tmp_path, 4, "b")  # a branch the directory's run did not keep
    assert find_checkpoint(str(tmp_path)).name == "step_2"
    assert not (tmp_path / (RUN_FILE + ".partial")).exists()
    (tmp_path / RUN_FILE).write_text("")
    with pytest.raises(FileNotFoundError, match="run.json is unreadable.*checkpoints/step_N"):
        find_checkpoint(str(tmp_path))
    assert find_checkpoint(str(tmp_path / "checkpoints" / "step_2")).name == "step_2"  # named, it is taken
    from configs.load import ConfigError
    from driver.preflight import load_run_config
    from learner.checkpoint import is_branch, last_run

    fresh = ["trainer.steps=20", f"logging.dir={tmp_path}"]  # (whose checkpoints are there is not known)
    with pytest.raises(ConfigError, match="logging.dir.*run.json is unreadable.*or logging.overwrite=true"):
        load_run_config("grpo_tiny", [*fresh, "logging.overwrite=false"])
    assert load_run_config("grpo_tiny", [*fresh, "logging.overwrite=true"])
    assert last_run(tmp_path) == "unreadable"  # another run's: an overwriting run deletes its checkpoints first
    assert is_branch(tmp_path / "checkpoints" / "step_2")  # resumed from by name: a run id of its own


def test_the_final_weights_appear_whole_or_not_at_all(tmp_path, monkeypatch):
    """`RankCheckpoints.save_pretrained` on rank 0, with stand-ins for DeepSpeed's gather and the model: it writes
    `final.partial` and renames it to `final` once written (on rank 0, which sees what it wrote); a save cut off
    leaves the previous `final` as it was, not a half-written one in its place."""
    from types import SimpleNamespace

    import learner.checkpoint as checkpoint

    def save(path, state_dict):
        (Path(path) / "model.safetensors").parent.mkdir(parents=True, exist_ok=True)
        (Path(path) / "model.safetensors").write_bytes(state_dict["bytes"])
        if state_dict["bytes"] == b"half":
            raise OSError("the rank's node went away")

    monkeypatch.setattr(checkpoint, "copy_tokenizer", lambda src, dst: None)
    ranks = checkpoint.RankCheckpoints.__new__(checkpoint.RankCheckpoints)
    ranks.rank, ranks.bucket_bytes, ranks.policy_dir = 0, 1 << 20, "policy"
    ranks.cfg = SimpleNamespace(learner=SimpleNamespace(zero_stage=0))
    ranks.engine = SimpleNamespace(module=SimpleNamespace(save_pretrained=save))
    final = tmp_path / "final"
    for written in (b"whole", b"half"):
        monkeypatch.setattr(checkpoint, "gather_full_state", lambda *args, written=written: {"bytes": written})
        try:
            ranks.save_pretrained(str(final))
        except OSError:
            pass
        assert (final / "model.safetensors").read_bytes() == b"whole"
