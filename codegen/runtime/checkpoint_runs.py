"""Which run a ``--checkpoint-dir`` belongs to, decided before the process group starts.

A checkpoint folder belongs to one training run. Each checkpoint's ``soap-checkpoint.json``
records the run's identity (``RunIdentity``): a run id (new for a run started from step 0,
kept by every ``--resume`` of it, on any plan or world size), the fingerprint of the weights
it holds (``planner.fingerprint`` over the model's class, parameters and buffers, without
the batch, so a run may resume at another batch size) with a description for people, and
the optimizer with the hyper-parameters that shape its state.

``resume_decision`` applies the rules, each refusal one line naming what is there and the fix:

- without ``--resume``, a folder that already holds checkpoints is refused: a second run
  writing there would mix its checkpoints with the first's, and ``--keep`` would prune them
  together. The fix: another folder, or ``--resume`` to continue the run that is there;
- ``--resume`` continues the newest complete checkpoint, refused when it is of another
  model or optimizer (its tensors would not fit, or a fresh optimizer state would be
  trained as if it were the saved one);
- ``--resume auto`` (for schedulers that restart jobs) resumes when the folder holds a
  checkpoint, and starts at step 0 when it holds none; another model's is refused as above.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from codegen.runtime.checkpoint_folders import (
    INFO_FILE,
    Found,
    marked_folders,
    newest_checkpoint,
    read_info,
    writer_of,
)
from codegen.runtime.init_file import check_init_file
from planner.errors import LaunchError, one_line
from planner.fingerprint import model_fingerprint

RESUME_AUTO = "auto"
# The hyper-parameters (besides lr, which a resumed run may change) that decide what an
# optimizer's saved state means: another value would continue it as a different optimizer.
_STATE_SETTINGS = ("betas", "eps", "weight_decay", "amsgrad", "maximize", "momentum", "dampening", "nesterov")


@dataclass(frozen=True)
class RunIdentity:
    """What a checkpoint records of the run that wrote it (see the module docstring)."""

    id: str
    model: str
    model_description: str
    optimizer: str
    optimizer_settings: dict

    def to_json(self) -> dict:
        return {"id": self.id, "model": self.model, "model_description": self.model_description,
                "optimizer": self.optimizer, "optimizer_settings": self.optimizer_settings}

    def continuing(self, found: Found | None) -> RunIdentity:
        """This identity under the run id of checkpoint ``found`` (a resumed run is the same
        run); a checkpoint without one (written before runs had ids) starts a new id."""
        run_id = found.run.get("id") if found is not None else None
        if isinstance(run_id, str) and run_id:
            return RunIdentity(run_id, self.model, self.model_description, self.optimizer, self.optimizer_settings)
        return self


def run_identity(model: torch.nn.Module, optimizer: str) -> RunIdentity:
    """A new run's identity: a fresh id, ``model``'s weights fingerprint (``model`` as the
    spec builds it, on any device, meta included) and ``optimizer`` (``adamw`` or ``sgd``)."""
    from codegen.runtime.parity import optimizer_class

    parameters = sum(value.numel() for value in model.parameters())
    # The class's defaults are what launch.py runs with (it sets only lr, which a resumed
    # run may change): they decide which states exist and what they mean.
    kind = optimizer_class(optimizer)
    defaults = kind([torch.zeros(1, device="cpu", requires_grad=True)]).defaults  # a stand-in: only its defaults are read
    settings = {key: value for key, value in defaults.items() if key in _STATE_SETTINGS}
    return RunIdentity(uuid.uuid4().hex, model_fingerprint(model), f"{type(model).__name__}, {parameters:,} parameters",
                       kind.__name__, {key: list(value) if isinstance(value, tuple) else value for key, value in settings.items()})


def describe_run(found: Found) -> str:
    """``run 3fa2c1d0 (GPT, 1,234 parameters, AdamW, newest step-00000004 by plan 'x')``;
    text from the file is shown inert (``one_line``: control characters escaped)."""
    run = found.run
    what = one_line(str(run.get("model_description") or "a model")[:80])
    optimizer = one_line(str(run.get("optimizer") or found.info.get("optimizer") or "an optimizer")[:20])
    name = f"run {one_line(str(run.get('id'))[:8])}" if run.get("id") else "a run"
    plan = one_line(str(found.info.get("plan"))[:60])
    return f"{name} ({what}, {optimizer}, newest {found.folder.name} by plan '{plan}')"


def resume_decision(directory: Path, resume: bool | str, identity: RunIdentity) -> Found | None:
    """The checkpoint this run resumes from (None: it starts at step 0), by the rules of the
    module docstring. ``resume``: False, True (``--resume``) or ``"auto"``.

    Raises:
        LaunchError: the folder holds another run's checkpoints and this run does not
            resume; the checkpoint to resume is damaged, of another model or optimizer; or
            ``--resume`` finds nothing to resume.
    """
    if (Path(directory) / INFO_FILE).is_file():
        raise LaunchError(f"--checkpoint-dir '{directory}' is one checkpoint; give the folder it is in, "
                          f"'{Path(directory).parent}' (--resume takes its newest)")
    found = newest_checkpoint(directory)
    if found is None:
        if resume is True:
            raise LaunchError(f"--resume: no complete checkpoint in '{directory}'; run without --resume to start from "
                              f"step 0 (or with --resume auto, which starts when there is none)")
        return None
    if not resume:
        count = len(marked_folders(directory))
        raise LaunchError(
            f"--checkpoint-dir '{directory}' holds {count} checkpoint(s) of {describe_run(found)}: a new run there would "
            f"mix its checkpoints with those (and --keep would prune both); continue that run with --resume, or give "
            f"this run another --checkpoint-dir"
        )
    check_same_run(found, identity)
    return found


def check_same_run(found: Found, identity: RunIdentity) -> None:
    """LaunchError unless checkpoint ``found`` is of ``identity``'s model and optimizer."""
    run = found.run
    fix = "resume with the program and --optimizer that wrote it, or give this run another --checkpoint-dir"
    if run.get("model") and run.get("model") != identity.model:
        raise LaunchError(
            f"checkpoint '{found.folder}' is of another model, {describe_run(found)}; this program trains "
            f"{identity.model_description}: {fix} (or start from its weights with --init-from)"
        )
    saved = run.get("optimizer") or found.info.get("optimizer")
    if isinstance(saved, str) and saved != identity.optimizer:
        raise LaunchError(
            f"checkpoint '{found.folder}' was trained with {one_line(saved[:20])} and this run would resume it with "
            f"{identity.optimizer}, whose state is different; {fix}"
        )
    settings = run.get("optimizer_settings")
    if isinstance(settings, dict):
        changed = sorted(key for key in set(settings) | set(identity.optimizer_settings)
                         if settings.get(key) != identity.optimizer_settings.get(key))
        if changed:
            key = changed[0]
            raise LaunchError(
                f"checkpoint '{found.folder}' was trained with {identity.optimizer} {one_line(key[:40])}="
                f"{one_line(str(settings.get(key))[:40])}, "
                f"this run has {key}={identity.optimizer_settings.get(key)}; {fix}"
            )


def prepare_checkpoints(program, checkpoint_dir: str | None, resume: bool | str, init_file: str | None,
                        optimizer: str) -> tuple[RunIdentity | None, Found | None]:
    """Everything about checkpoints that can be refused, refused before the process group
    starts (every rank runs it on the same files): an ``--init-from`` file that does not fit the model (``checkpoint.check_init_file``), and
    ``resume_decision``'s rules. Returns the run's identity (None without a checkpoint
    folder; a resumed run's id is the checkpoint's) and the checkpoint to resume from."""
    if checkpoint_dir is None and init_file is None:
        return None, None
    model = program.meta_model()[0]
    if init_file is not None:
        check_init_file(Path(init_file), model)
    if checkpoint_dir is None:
        return None, None
    identity = run_identity(model, optimizer)
    found = resume_decision(Path(checkpoint_dir), resume, identity)
    check_writable(Path(checkpoint_dir))
    return identity.continuing(found), found


def check_writable(directory: Path) -> None:
    """Create ``directory`` (a checkpoint folder) now, and check it is writable: a first save
    that failed would lose the steps before it."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise LaunchError(f"--checkpoint-dir: cannot create '{directory}' ({error.strerror}); give a folder you can write") from error
    if not os.access(directory, os.W_OK | os.X_OK):
        raise LaunchError(f"--checkpoint-dir: '{directory}' is not writable; give a folder you can write")


def check_no_other_writer(root: Path, run_id: str, folder: Path, known: set[str]) -> None:
    """LaunchError when another run has written into ``root`` since this one started (two
    jobs started at once on one folder both found it empty): a complete checkpoint of
    another run id that is not among ``known`` (the step folders there when this run
    started, which it was let in with), or another run writing ``folder``, the checkpoint
    this run is about to write."""
    other = writer_of(folder)
    if other is None:
        for _, marked in reversed(marked_folders(root)):
            if marked.name in known:
                continue
            try:
                other = read_info(marked).get("run", {}).get("id")
            except LaunchError:
                continue
            if other and other != run_id:
                break
            other = None
    if other and other != run_id:
        raise LaunchError(
            f"another run ({one_line(str(other)[:8])}) is writing checkpoints into --checkpoint-dir '{root}' too; this "
            f"run stops before mixing its checkpoints with those: give each run its own --checkpoint-dir"
        )
