"""A checkpoint folder belongs to one run; nothing in it is lost to another run or to
``--keep``; damaged or crafted checkpoints and unfit ``--init-from`` files are one line,
before the first step.

Unit checks build small real DCP checkpoints in this process (``dcp.save(no_dist=True)``).
The distributed check (``test_two_models_into_one_checkpoint_dir_lose_nothing``) runs two
different models into one ``--checkpoint-dir`` with ``--keep 1`` under torchrun.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from codegen.runtime.checkpoint import init_from
from codegen.runtime.init_file import check_init_file
from codegen.runtime.checkpoint_folders import (
    INFO_FILE,
    WRITING_FILE,
    latest_checkpoint,
    mark_writing,
    prune_checkpoints,
    step_folder,
    write_info,
)
from codegen.runtime.checkpoint_runs import resume_decision, run_identity
from planner.errors import LaunchError

REPO = Path(__file__).resolve().parents[1]


def _checkpoint(root: Path, step: int, identity, aliases: dict | None = None) -> Path:
    """A real checkpoint of step ``step`` written as launch.py writes one (DCP, then the info)."""
    folder = step_folder(root, step)
    mark_writing(folder, identity.id)
    state = {"model.weight": torch.full((4, 3), float(step)), "model.bias": torch.zeros(4),
             "train.step": torch.tensor(step, dtype=torch.int64)}
    with warnings.catch_warnings():  # DCP says it assumes one process: that is the intent
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    write_info(folder, {"format": 2, "step": step, "world_size": 1, "plan": "test", "optimizer": identity.optimizer,
                        "run": identity.to_json(), "aliases": aliases or {}})
    return folder


def _our_files(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.iterdir()) if folder.exists() else []


# ------------------------------------------------------------------ --keep and run ownership


def test_keep_prunes_only_this_runs_checkpoints_and_nothing_it_did_not_write(tmp_path) -> None:
    mine, other = run_identity(nn.Linear(3, 4), "adamw"), run_identity(nn.Linear(3, 4), "adamw")
    for step in (2, 4, 6):
        _checkpoint(tmp_path, step, mine)
    (step_folder(tmp_path, 2) / "notes.txt").write_text("a user's notes")
    _checkpoint(tmp_path, 3, other)
    abandoned = step_folder(tmp_path, 5)  # this run died while writing step 5
    mark_writing(abandoned, mine.id)
    (abandoned / "__0_0.distcp").write_bytes(b"half")
    foreign = step_folder(tmp_path, 1)  # a folder named like ours, not ours
    foreign.mkdir()
    (foreign / "results.csv").write_text("1,2")
    unmarked = step_folder(tmp_path, 7)  # no marker: whoever is writing it, it is not this run's to delete
    unmarked.mkdir()
    (unmarked / "__0_0.distcp").write_bytes(b"?")
    elsewhere = _checkpoint(tmp_path / "elsewhere", 8, mine)  # this run's files, linked in as step 8
    step_folder(tmp_path, 8).symlink_to(elsewhere)
    damaged = step_folder(tmp_path, 9)
    damaged.mkdir()
    (damaged / INFO_FILE).write_text("{")
    before = {folder.name: _our_files(folder) for folder in tmp_path.iterdir()}

    deleted = prune_checkpoints(tmp_path, keep=1, run_id=mine.id)

    assert [folder.name for folder in deleted] == ["step-00000002", "step-00000004", "step-00000005"]
    assert _our_files(step_folder(tmp_path, 2)) == ["notes.txt"]  # our files gone, the user's kept
    assert not step_folder(tmp_path, 4).exists() and not abandoned.exists()
    assert len(_our_files(elsewhere)) == 3  # not deleted through the link
    for kept in ("step-00000001", "step-00000003", "step-00000006", "step-00000007", "step-00000009"):
        assert _our_files(tmp_path / kept) == before[kept], kept


def test_a_folder_of_another_run_is_refused_without_resume_and_resume_auto_continues_this_one(tmp_path) -> None:
    gpt_like, mlp_like = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)), nn.Linear(3, 4)
    first = run_identity(gpt_like, "adamw")
    _checkpoint(tmp_path, 2, first)
    _checkpoint(tmp_path, 4, first)

    # Any new run, of this model or another: one line naming the run there and the fixes.
    for model in (gpt_like, mlp_like):
        with pytest.raises(LaunchError) as refused:
            resume_decision(tmp_path, False, run_identity(model, "adamw"))
        said = str(refused.value)
        assert f"holds 2 checkpoint(s) of run {first.id[:8]} (Sequential, 26 parameters, AdamW, newest step-00000004" in said
        assert "--resume" in said and "another --checkpoint-dir" in said and "\n" not in said
    # --resume auto continues the run there, under its id; of another model, refused.
    found = resume_decision(tmp_path, "auto", run_identity(gpt_like, "adamw"))
    assert found.folder == step_folder(tmp_path, 4)
    assert run_identity(gpt_like, "adamw").continuing(found).id == first.id
    with pytest.raises(LaunchError, match=r"is of another model, run \w+ \(Sequential.*this program trains Linear, 16 "):
        resume_decision(tmp_path, "auto", run_identity(mlp_like, "adamw"))
    with pytest.raises(LaunchError, match=r"step-00000004' is one checkpoint; give the folder it is in"):
        resume_decision(step_folder(tmp_path, 4), True, first)
    # ... and starts at step 0 where there is nothing yet; plain --resume there is refused.
    assert resume_decision(tmp_path / "fresh", "auto", first) is None
    with pytest.raises(LaunchError, match=r"--resume: no complete checkpoint in .*--resume auto"):
        resume_decision(tmp_path / "fresh", True, first)


def test_a_run_that_finds_another_writer_in_its_folder_stops_before_mixing(tmp_path) -> None:
    """Two jobs started at once on one empty folder both pass the check at start; the first
    save of the second to arrive finds the other's checkpoint or marker and stops."""
    from codegen.runtime.checkpoint_runs import check_no_other_writer

    mine, other = run_identity(nn.Linear(3, 4), "adamw"), run_identity(nn.Linear(3, 4), "adamw")
    _checkpoint(tmp_path, 1, other)  # there when this run started (it resumed this folder): let in with it
    known = {"step-00000001"}
    _checkpoint(tmp_path, 2, mine)
    check_no_other_writer(tmp_path, mine.id, step_folder(tmp_path, 3), known)  # nothing new of another run
    mark_writing(step_folder(tmp_path, 3), other.id)
    with pytest.raises(LaunchError, match=rf"another run \({other.id[:8]}\) is writing checkpoints into"):
        check_no_other_writer(tmp_path, mine.id, step_folder(tmp_path, 3), known)
    _checkpoint(tmp_path, 4, other)
    with pytest.raises(LaunchError, match="give each run its own --checkpoint-dir"):
        check_no_other_writer(tmp_path, mine.id, step_folder(tmp_path, 5), known)


def test_resuming_with_another_optimizer_is_refused(tmp_path) -> None:
    model = nn.Linear(3, 4)
    _checkpoint(tmp_path, 2, run_identity(model, "adamw"))
    # SGD without momentum has no state to miss: without the recorded optimizer it trained on.
    with pytest.raises(LaunchError, match="was trained with AdamW and this run would resume it with SGD"):
        resume_decision(tmp_path, True, run_identity(model, "sgd"))
    changed = run_identity(model, "adamw")
    changed.optimizer_settings["betas"] = [0.8, 0.95]
    with pytest.raises(LaunchError, match=r"trained with AdamW betas=\[0.9, 0.999\], this run has betas=\[0.8, 0.95\]"):
        resume_decision(tmp_path, True, changed)


# ------------------------------------------------------------------ damaged checkpoints


def _damage_info(text: str):
    return lambda folder: (folder / INFO_FILE).write_text(text)


def _truncate(name: str, keep: int):
    def damage(folder: Path) -> None:
        path = folder / name
        path.write_bytes(path.read_bytes()[:keep])
    return damage


def _info_with(**fields):
    def damage(folder: Path) -> None:
        info = json.loads((folder / INFO_FILE).read_text())
        (folder / INFO_FILE).write_text(json.dumps({**info, **fields}))
    return damage


@pytest.mark.parametrize("damage, names, why", [
    (_damage_info(""), INFO_FILE, "is damaged (JSONDecodeError"),
    (_damage_info('{"format": 2, "st'), INFO_FILE, "is damaged (JSONDecodeError"),
    (_damage_info("{}"), INFO_FILE, "it has no format field"),
    (_info_with(format=3), INFO_FILE, "format 3 is not one this version reads (1, 2)"),
    (_damage_info("[" * 100000 + "]" * 100000), INFO_FILE, "is damaged"),
    (_info_with(step=99), INFO_FILE, "step 99 is not the folder's step 4"),
    (_info_with(aliases=["weight"]), INFO_FILE, "aliases is not an object of names"),
    (_info_with(files=["../../etc/passwd"]), INFO_FILE, "files lists names DCP does not write"),
    (_truncate(".metadata", 0), ".metadata", "is damaged or missing"),
    (_truncate(".metadata", 40), ".metadata", "is damaged or missing"),
    (lambda folder: (folder / ".metadata").unlink(), ".metadata", "is damaged or missing"),
    (_truncate("__0_0.distcp", 10), "__0_0.distcp", "is truncated (10 of"),
    (lambda folder: (folder / "__0_0.distcp").unlink(), "__0_0.distcp", "is missing"),
], ids=["empty-info", "truncated-info", "empty-object", "new-format", "deep-json", "wrong-step", "bad-aliases", "bad-files",
        "empty-metadata", "truncated-metadata", "no-metadata", "truncated-shard", "no-shard"])
def test_a_damaged_newest_checkpoint_is_one_line_naming_the_file_and_the_one_before(tmp_path, damage, names, why) -> None:
    identity = run_identity(nn.Linear(3, 4), "adamw")
    _checkpoint(tmp_path, 2, identity)
    newest = _checkpoint(tmp_path, 4, identity)
    damage(newest)
    with pytest.raises(LaunchError) as error:
        latest_checkpoint(tmp_path)
    said = str(error.value)
    assert f"{newest / names}" in said and why in said, said
    assert "move that folder out of --checkpoint-dir" in said and "the newest before it is step-00000002" in said
    assert "\n" not in said and len(said) < 600


class _RunsCode:
    """A pickle that, unpickled by plain ``pickle.load``, writes a file (DCP reads .metadata so)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.write_text, (self.path, "ran"))


def test_a_crafted_metadata_file_runs_no_code(tmp_path) -> None:
    import pickle

    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    from codegen.runtime.checkpoint import export_checkpoint

    folder = _checkpoint(tmp_path / "ckpt", 2, run_identity(nn.Linear(3, 4), "adamw"))
    proof = tmp_path / "proof.txt"
    (folder / ".metadata").write_bytes(pickle.dumps(_RunsCode(proof)))
    for read in (lambda: latest_checkpoint(tmp_path / "ckpt"), lambda: export_checkpoint(folder, tmp_path / "m.pt")):
        with pytest.raises(LaunchError, match=r"\.metadata' is damaged or missing \(UnpicklingError: it names pathlib\.Path\.write_text"):
            read()
    assert not proof.exists()
    # An entry DCP would load with torch.load(weights_only=False): refused, soap-planner saves tensors only.
    folder = _checkpoint(tmp_path / "other", 2, run_identity(nn.Linear(3, 4), "adamw"))
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(folder)).read_metadata()
    metadata.state_dict_metadata["model.weight"] = BytesStorageMetadata()
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(LaunchError, match="'model.weight' is not a tensor"):
        latest_checkpoint(tmp_path / "other")
    # A tensor claimed far larger than the files (export would allocate it): refused before any allocation.
    metadata.state_dict_metadata["model.weight"] = TensorStorageMetadata(
        TensorProperties(dtype=torch.float32), torch.Size([10**6, 10**6]), [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([4, 3]))])
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(LaunchError, match=r"its tensors claim 4,000,000,0\d\d,\d\d\d bytes, more than its shard files hold"):
        export_checkpoint(folder, tmp_path / "m.pt")


def test_a_fake_newest_step_folder_is_not_taken_as_the_latest(tmp_path) -> None:
    real = _checkpoint(tmp_path, 2, run_identity(nn.Linear(3, 4), "adamw"))
    fake = step_folder(tmp_path, 99999999)
    fake.mkdir()
    (fake / "__0_0.distcp").write_bytes(b"not ours")
    assert latest_checkpoint(tmp_path) == real
    (fake / INFO_FILE).write_text(json.dumps({"format": 2, "step": 99999999, "world_size": 1}))  # no DCP files
    with pytest.raises(LaunchError, match=r"step-99999999/\.metadata' is damaged or missing"):
        latest_checkpoint(tmp_path)


def test_a_shard_of_garbage_is_one_line_at_export(tmp_path) -> None:
    from codegen.runtime.checkpoint import export_checkpoint

    folder = _checkpoint(tmp_path / "ckpt", 2, run_identity(nn.Linear(3, 4), "adamw"))
    shard = folder / "__0_0.distcp"
    shard.write_bytes(bytes(255 - byte for byte in shard.read_bytes()))  # same length: only a read finds it
    with pytest.raises(LaunchError) as error:
        export_checkpoint(tmp_path / "ckpt", tmp_path / "m.pt")
    said = str(error.value)
    assert said.startswith(f"cannot read checkpoint '{folder}': ") and "its files are damaged" in said and "\n" not in said


def test_export_of_a_checkpoint_with_a_bad_alias_is_one_line(tmp_path, capsys) -> None:
    from planner.cli import main

    _checkpoint(tmp_path / "ckpt", 2, run_identity(nn.Linear(3, 4), "adamw"), aliases={"head.weight": "nowhere"})
    assert main(["export-checkpoint", str(tmp_path / "ckpt"), "-o", str(tmp_path / "m.pt")]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 1 and "alias 'head.weight' names 'nowhere', which it does not hold" in errors[0], errors
    assert not (tmp_path / "m.pt").exists()


# ------------------------------------------------------------------ --init-from files


class _Unsafe:
    """Not a tensor: ``weights_only=True`` refuses to unpickle it."""


@pytest.mark.parametrize("contents, said", [
    ({"weight": torch.ones(4, 3, dtype=torch.int64), "bias": torch.zeros(4)}, "weight is (4, 3) torch.float32 and the file has dtype torch.int64"),
    ({"weight": torch.ones(3, 4), "bias": torch.zeros(4)}, "weight is (4, 3) torch.float32 and the file has shape (3, 4)"),
    ({"weight": torch.ones(4, 3)}, "bias is (4,) torch.float32 and the file has no such tensor"),
    ({"weight": torch.ones(4, 3), "bias": [0.0] * 4}, "bias is (4,) torch.float32 and the file has a list"),
    ({"weight": torch.ones(4, 3), "bias": _Unsafe()}, "cannot read '{path}' as a weights-only state_dict (UnpicklingError: Weights only load failed"),
    ([torch.ones(4, 3)], "holds a list, not a state_dict"),
])
def test_an_unfit_init_from_file_is_one_line_naming_the_tensor(tmp_path, contents, said) -> None:
    path = tmp_path / "weights.pt"
    torch.save(contents, path)
    model = nn.Linear(3, 4)
    before = model.weight.detach().clone()
    for check in (lambda: check_init_file(path, nn.Linear(3, 4, device="meta")), lambda: init_from(path, model, model)):
        with pytest.raises(LaunchError) as error:
            check()
        assert said.format(path=path) in str(error.value) and "\n" not in str(error.value), str(error.value)
    assert torch.equal(model.weight, before)  # nothing cast, nothing half-copied
    torch.save({"weight": torch.ones(4, 3), "bias": torch.zeros(4)}, path)
    check_init_file(path, nn.Linear(3, 4, device="meta"))
    assert init_from(path, model, model) == 2 and torch.equal(model.weight, torch.ones(4, 3))


# ------------------------------------------------------------------ launch.py, before any step


@pytest.fixture(scope="module")
def programs(tmp_path_factory) -> dict[str, Path]:
    import planner
    from planner.model_spec import ModelSpec

    root = tmp_path_factory.mktemp("identity_programs")
    specs = {"gpt": ModelSpec(str(REPO / "examples/gpt.py"), {"batch_size": 8}),
             "mlp": ModelSpec(str(REPO / "examples/mlp.py"), {"batch_size": 8})}
    folders = {name: planner.compile(planner.plan(spec, "cpu:1x1", dp_flavour="ddp", precision="fp32"), root / name)
               for name, spec in specs.items()}
    return folders


def _launch(folder: Path, world: int, argv: list[str], monkeypatch, capsys) -> tuple[int, list[str]]:
    """launch.py's main in this process: every refusal comes before the process group starts."""
    from codegen.runtime.launcher import main

    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    capsys.readouterr()
    status = main(folder, argv)
    return status, [line for line in capsys.readouterr().err.splitlines() if not line.startswith("importing model file")]


def test_launch_refuses_before_the_first_step(programs, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    checkpoint = ["--steps", "2", "--checkpoint-dir", str(tmp_path / "ckpt")]
    # A pickle of objects given to --init-from: one line, no traceback.
    torch.save({"weight": _Unsafe()}, tmp_path / "unsafe.pt")
    status, errors = _launch(programs["mlp"], 1, ["--steps", "2", "--init-from", "unsafe.pt"], monkeypatch, capsys)
    assert status == 2 and errors and errors[-1].startswith("error: --init-from: cannot read 'unsafe.pt' as a weights-only")
    assert not any("Traceback" in line for line in errors), errors
    # --resume takes no value but auto.
    status, errors = _launch(programs["mlp"], 1, [*checkpoint, "--resume", "latest"], monkeypatch, capsys)
    assert status == 2 and errors[-1].endswith("--resume takes no value or 'auto', got 'latest'; see launch.py --help"), errors


def _torchrun(folder: Path, *flags: str, cwd: Path) -> subprocess.CompletedProcess:
    from test_parity import _free_port

    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port", str(_free_port()),
               str(folder / "launch.py"), *flags]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.distributed
def test_two_models_into_one_checkpoint_dir_lose_nothing(programs, tmp_path, monkeypatch, capsys) -> None:
    """A GPT run saves into ckpt with --keep 1; an MLP run pointed at the same folder (no
    --resume) is refused before its first step, naming the GPT run; the GPT checkpoint is
    still there and exports. Restarted with --resume auto, the GPT run continues and its
    --keep prunes only its own files: a user's notes and a foreign step folder stay.

    The MLP's two refusals run launch.py's main in this process (``_launch``): they come
    before the process group starts, so a torchrun launch of each would only add its start."""
    from codegen.runtime.checkpoint import export_checkpoint

    saved = tmp_path / "ckpt"
    common = ["--checkpoint-dir", str(saved), "--save-every", "1", "--keep", "1"]
    first = _torchrun(programs["gpt"], "--steps", "2", *common, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    run_id = json.loads((saved / "step-00000002" / INFO_FILE).read_text())["run"]["id"]
    assert f"checkpoints of run {run_id[:8]} go to {saved}" in first.stdout
    assert sorted(path.name for path in saved.iterdir()) == ["step-00000002"]  # --keep 1 pruned step 1
    (saved / "step-00000002" / "notes.txt").write_text("lr 1e-3 looked fine")
    (saved / "step-00000000").mkdir()  # a folder soap-planner did not write
    (saved / "step-00000000" / "data.bin").write_bytes(b"1")

    monkeypatch.chdir(tmp_path)
    status, said = _launch(programs["mlp"], 1, ["--steps", "2", *common], monkeypatch, capsys)
    errors = [line for line in said if line.startswith("error:")]
    assert status == 2 and len(errors) == 1 == len(said), said
    assert f"holds 1 checkpoint(s) of run {run_id[:8]} (GPT, " in errors[0] and "another --checkpoint-dir" in errors[0]
    assert sorted(path.name for path in saved.iterdir()) == ["step-00000000", "step-00000002"]  # the MLP wrote nothing
    step, count = export_checkpoint(saved, tmp_path / "gpt.pt")
    assert step == 2 and count > 0
    status, said = _launch(programs["mlp"], 1, ["--steps", "2", *common, "--resume", "auto"], monkeypatch, capsys)
    assert status == 2 and "is of another model" in said[-1], said

    # A scheduler's restart command: --resume auto --init-from resumes (the checkpoint supersedes the file) ...
    restart = ["--resume", "auto", "--init-from", str(tmp_path / "gpt.pt")]
    again = _torchrun(programs["gpt"], "--steps", "3", *common, *restart, cwd=tmp_path)
    assert again.returncode == 0 and f"at step 2 (run {run_id[:8]})" in again.stdout, again.stderr[-2000:]
    assert "initialised" not in again.stdout
    assert sorted(path.name for path in saved.iterdir()) == ["step-00000000", "step-00000002", "step-00000003"]
    assert _our_files(saved / "step-00000002") == ["notes.txt"] and _our_files(saved / "step-00000000") == ["data.bin"]
    assert json.loads((saved / "step-00000003" / INFO_FILE).read_text())["run"]["id"] == run_id
    assert not (saved / "step-00000003" / WRITING_FILE).exists()
    # ... and in a folder with no checkpoint yet, starts from the file.
    fresh = _torchrun(programs["gpt"], "--steps", "1", "--checkpoint-dir", str(tmp_path / "fresh"), *restart, cwd=tmp_path)
    assert fresh.returncode == 0 and "--resume auto: no checkpoint there yet; checkpoints of run" in fresh.stdout
    assert f"initialised {count} tensors from" in fresh.stdout, fresh.stdout[-2000:]


def test_text_from_a_checkpoint_is_inert_in_messages(tmp_path) -> None:
    """A shared checkpoint's names reach the terminal only with control characters escaped."""
    folder = _checkpoint(tmp_path, 2, run_identity(nn.Linear(3, 4), "adamw"))
    info = json.loads((folder / INFO_FILE).read_text())
    info["plan"] = "\x1b[2J\x1b]0;pwned\x07all good"
    info["run"]["model_description"] = "\x1b[31mRED\x1b[0m\nerror: fake"
    (folder / INFO_FILE).write_text(json.dumps(info))
    with pytest.raises(LaunchError) as refused:
        resume_decision(tmp_path, False, run_identity(nn.Linear(3, 4), "adamw"))
    said = str(refused.value)
    assert not any(ord(character) < 32 or ord(character) == 127 for character in said), repr(said)
    assert "\\x1b[31mRED" in said and "by plan '\\x1b[2J" in said


def test_a_checkpoint_dir_that_cannot_be_created_is_one_line(tmp_path) -> None:
    from codegen.runtime.checkpoint_runs import check_writable

    (tmp_path / "a_file").write_text("")
    with pytest.raises(LaunchError, match=r"--checkpoint-dir: cannot create '.*a_file/ckpt' \(Not a directory\)"):
        check_writable(tmp_path / "a_file" / "ckpt")
    check_writable(tmp_path / "new" / "ckpt")
    assert (tmp_path / "new" / "ckpt").is_dir()
