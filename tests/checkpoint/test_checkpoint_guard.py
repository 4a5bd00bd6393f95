"""Nothing trained wrong, nothing lost (issue 15, the checkpoint items), each through the real
command line (`python -m dtensor3d` in a new process, or `bash launch.sh`): exit status, the
single `error:` line, and the checkpoint directory unchanged byte for byte.

- a resume that would change the trajectory (seed, global batch, sequence length, data
  source, model) is refused naming the field; training.steps behind the checkpoint is
  refused, equal to it says there is nothing left to train;
- checkpoint.dir that is a file or read-only is refused at the door;
- one run at a time per checkpoint.dir (a LOCK file with host and pid), a stale lock of a
  dead process taken over with one warning line, released at exit;
- a broken newest step (garbage manifest) is named in a warning with the step taken instead,
  and left in place (renamed to step_N.broken, never deleted, when that step is saved again);
- checkpoint files are 0644 like the rest; export-hf --max-shard-mb <= 0 and export/import
  into a read-only directory are one error line each.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import PARITY, ROOT, clean_env, one_error_line, tree_digest

from dtensor3d.__main__ import main
from dtensor3d.checkpoint.check import check_trajectory
from dtensor3d.config.load import load_recipe
from dtensor3d.errors import CheckpointError


def dtensor3d(*args: str) -> subprocess.CompletedProcess:
    """python -m dtensor3d ARGS in a new process (one rank, no torchrun)."""
    cmd = [sys.executable, "-m", "dtensor3d", *args]
    return subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=300)


def launch(*args: str) -> subprocess.CompletedProcess:
    cmd = ["bash", "launch.sh", *args]
    return subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A 1-process run of the parity recipe, 2 steps, a checkpoint after each."""
    root = tmp_path_factory.mktemp("base")
    ckpt = root / "ck"
    proc = dtensor3d(
        "train",
        PARITY,
        "training.steps=2",
        f"checkpoint.dir={ckpt}",
        "checkpoint.interval=1",
        f"logging.run_dir={root}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step_")) == ["step_00000001", "step_00000002"]
    return ckpt


@pytest.fixture
def ckpt(base, tmp_path) -> Path:
    shutil.copytree(base, tmp_path / "ck")
    return tmp_path / "ck"


@contextlib.contextmanager
def read_only_dir(path: Path):
    """An existing directory nobody can write: chmod 0555, or for root (whom chmod does not
    stop) a read-only tmpfs mounted there, or where root may not mount, an immutable
    directory (chattr +i); skipped only where none of the three is possible."""
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        try:
            yield path
        finally:
            path.chmod(0o755)
        return
    if not subprocess.run(["mount", "-t", "tmpfs", "-o", "ro", "tmpfs", str(path)], capture_output=True).returncode:
        undo = ["umount", str(path)]
    elif not subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode:
        undo = ["chattr", "-i", str(path)]
    else:
        pytest.skip("root who may neither mount nor chattr +i: no unwritable directory to test with")
    try:
        yield path
    finally:
        subprocess.run(undo, check=True)


# ---------------------------------------------------------------- resume keeps the trajectory


@pytest.mark.parametrize(
    "override,field",
    [
        ("training.seed=8", "training.seed"),
        ("training.global_batch_size=16", "training.global_batch_size"),
        ("training.sequence_length=16", "training.sequence_length"),
        ("data.kind=tokens", "data.kind"),
        ("model.rope_theta=500000", "rope_theta"),
    ],
)
def test_resume_refuses_a_changed_trajectory(ckpt, tmp_path, override, field):
    extra = [override]
    if override == "data.kind=tokens":
        import numpy as np

        np.save(tmp_path / "ids.npy", np.arange(4096, dtype=np.int64) % 256)
        extra += [f"data.path={tmp_path / 'ids.npy'}", "training.eval_every=0"]  # a single file has no val split
    before = tree_digest(ckpt)
    args = [PARITY, "training.steps=4", f"checkpoint.dir={ckpt}", f"logging.run_dir={tmp_path / 'run'}", *extra]
    for proc in (launch(*args), dtensor3d("train", *args)):
        line = one_error_line(proc)
        assert field in line and "step_00000002" in line, line
        assert not (tmp_path / "run" / "metrics.jsonl").exists()
    assert tree_digest(ckpt) == before


def test_resume_refuses_another_data_path():
    """The data source is kind and path; a moved token file is another source."""
    recipe = load_recipe(PARITY, ["data.kind=tokens", "data.path=/data/b.npy"])
    saved = {"step": 2, "recipe": dict(recipe.to_dict(), data={"kind": "tokens", "path": "/data/a.npy"})}
    with pytest.raises(CheckpointError, match=r"data\.path='/data/a\.npy' but the recipe has '/data/b\.npy'"):
        check_trajectory(saved, recipe, "state.json")
    check_trajectory(dict(saved, recipe=recipe.to_dict()), recipe, "state.json")


def test_steps_behind_or_at_the_checkpoint(ckpt, tmp_path):
    before = tree_digest(ckpt)
    run = f"logging.run_dir={tmp_path / 'run'}"
    line = one_error_line(dtensor3d("train", PARITY, "training.steps=1", f"checkpoint.dir={ckpt}", run))
    assert "training.steps=1" in line and "step 2" in line and "step_00000002" in line, line
    assert tree_digest(ckpt) == before
    proc = dtensor3d("train", PARITY, "training.steps=2", f"checkpoint.dir={ckpt}", run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "nothing left to train" in proc.stdout and "step 2" in proc.stdout
    assert not (ckpt / "LOCK").exists()


def test_grown_steps_are_noted_with_the_next_lr(ckpt, tmp_path):
    """Resuming step 2 of a 2-step run with training.steps=3: one note line names the new length,
    the lr step 2 now runs at (the schedule's formula over 3 steps) and the saved next_lr."""
    from helpers import scheduled_lr

    from dtensor3d.config.load import load_recipe

    proc = dtensor3d("train", PARITY, "training.steps=3", f"checkpoint.dir={ckpt}", f"logging.run_dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    notes = [line for line in proc.stderr.splitlines() if line.startswith("note:")]
    opt = load_recipe(PARITY).optimizer
    now, saved = scheduled_lr(2, opt, 3), scheduled_lr(2, opt, 2)
    assert len(notes) == 1 and "training.steps grew from 2 to 3" in notes[0], proc.stderr
    # The step numbered as metrics.jsonl numbers it (issue 43 item 16): the resumed step is the log's step 3.
    assert f"step 3 runs at lr {now:.3e} where the saved run's next_lr was {saved:.3e}" in notes[0], notes
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["lr"] for row in rows if row.get("step") == 3] == [pytest.approx(now, rel=1e-6)], rows


# ---------------------------------------------------------------- checkpoint.dir at the door


def test_checkpoint_dir_that_is_a_file(tmp_path):
    target = tmp_path / "ck"
    target.write_text("not a directory\n")
    for proc in (
        launch(PARITY, f"checkpoint.dir={target}"),
        dtensor3d("train", PARITY, f"checkpoint.dir={target}", f"logging.run_dir={tmp_path / 'run'}"),
    ):
        line = one_error_line(proc)
        assert str(target) in line and "not a directory" in line, line
    assert target.read_text() == "not a directory\n"
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_checkpoint_dir_read_only(tmp_path):
    with read_only_dir(tmp_path / "ro") as ro:
        for target in (ro, ro / "sub"):
            for proc in (
                launch(PARITY, f"checkpoint.dir={target}"),
                dtensor3d("train", PARITY, f"checkpoint.dir={target}", f"logging.run_dir={tmp_path / 'run'}"),
            ):
                line = one_error_line(proc)
                assert str(target) in line and "not writable" in line, line
        assert os.listdir(ro) == []
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# ---------------------------------------------------------------- one run per checkpoint.dir


def wait_for(path: Path, proc: subprocess.Popen, seconds: float = 240) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.2)


def test_one_run_per_checkpoint_dir(ckpt, tmp_path):
    """A run holds checkpoint.dir/LOCK and logging.run_dir/LOCK; a second run into either is
    refused (launch.sh and train), naming the holder's host and pid; once
    the holder is killed (SIGKILL: no cleanup) the next run takes the stale lock over with a
    warning line, trains, and releases it at exit."""
    before = tree_digest(ckpt)
    cmd = [sys.executable, "-m", "dtensor3d", "train", PARITY, "training.steps=100000", f"checkpoint.dir={ckpt}"]
    holder = subprocess.Popen(
        [*cmd, f"logging.run_dir={tmp_path / 'first'}"],
        cwd=ROOT,
        env=clean_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        wait_for(ckpt / "LOCK", holder)
        lock = json.loads((ckpt / "LOCK").read_text())
        assert lock["pid"] == holder.pid and lock["host"] == socket.gethostname()
        args = [PARITY, "training.steps=3", f"checkpoint.dir={ckpt}", f"logging.run_dir={tmp_path / 'second'}"]
        for proc in (launch(*args), dtensor3d("train", *args)):
            line = one_error_line(proc)
            assert f"pid {holder.pid}" in line and "in use by another run" in line and str(ckpt) in line, line
        assert not (tmp_path / "second" / "metrics.jsonl").exists()
        # Issue 43 item 4: another checkpoint.dir but the holder's logging.run_dir is refused too
        assert json.loads((tmp_path / "first" / "LOCK").read_text())["pid"] == holder.pid
        shared = [
            PARITY,
            "training.steps=3",
            f"checkpoint.dir={tmp_path / 'ck2'}",
            f"logging.run_dir={tmp_path / 'first'}",
        ]
        for proc in (launch(*shared), dtensor3d("train", *shared)):
            line = one_error_line(proc)
            assert f"logging.run_dir='{tmp_path / 'first'}' is in use by another run (pid {holder.pid}" in line, line
            assert socket.gethostname() in line, line
        assert not (tmp_path / "ck2").exists() and not (tmp_path / "first" / "metrics.1.jsonl").exists()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert (ckpt / "LOCK").exists()  # killed: left behind, stale
    assert tree_digest(ckpt) == dict(before, LOCK=tree_digest(ckpt)["LOCK"])
    proc = dtensor3d("train", *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and f"pid {holder.pid}" in warnings[0] and "no longer running" in warnings[0]
    assert "resumed from" in proc.stdout and "step_00000003" in os.listdir(ckpt)
    assert not (ckpt / "LOCK").exists()


def test_lock_of_another_host_is_never_taken_over(tmp_path):
    """A LOCK naming another host is refused whatever its pid (its liveness cannot be seen
    from here); the error names the file to delete, which stays."""
    ckpt = tmp_path / "ck"
    ckpt.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    holder = {"host": socket.gethostname() + "-elsewhere", "pid": int(dead.stdout), "since": "2025-01-01T00:00:00"}
    (ckpt / "LOCK").write_text(json.dumps(holder))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(["validate", PARITY, f"checkpoint.dir={ckpt}"])  # the door of validate, train and launch.sh
    line = one_error_line(subprocess.CompletedProcess([], rc, "", err.getvalue()))
    assert "in use by another run" in line and holder["host"] in line and f"delete {ckpt / 'LOCK'}" in line, line
    assert json.loads((ckpt / "LOCK").read_text()) == holder


# ---------------------------------------------------------------- a broken newest checkpoint


def test_broken_newest_is_named_not_passed_over_silently(ckpt, tmp_path):
    broken = ckpt / "step_00000002"
    (broken / "manifest.json").write_text("{garbage")
    assert (ckpt / "latest").read_text().strip() == "step_00000002"
    proc = dtensor3d("validate", PARITY, f"checkpoint.dir={ckpt}")
    assert proc.returncode == 0, proc.stderr
    (warning,) = proc.stderr.strip().splitlines()
    assert warning.startswith("warning:") and str(broken) in warning, warning
    assert "not readable JSON" in warning and "resuming from step_00000001" in warning
    proc = dtensor3d("train", PARITY, "training.steps=2", f"checkpoint.dir={ckpt}", f"logging.run_dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert warning in proc.stderr.splitlines()
    assert "resumed from" in proc.stdout and "step_00000001 at step 1" in proc.stdout
    # Step 2 is saved again; the broken directory is kept for the user to inspect, untouched.
    kept = ckpt / "step_00000002.broken"
    assert f"warning: checkpoint {broken} was broken" in proc.stderr and str(kept) in proc.stderr
    assert (kept / "manifest.json").read_text() == "{garbage"
    assert json.loads((broken / "manifest.json").read_text())["format"] == "dtensor3d-checkpoint"


# ---------------------------------------------------------------- rough edges


def test_checkpoint_files_have_the_usual_mode(base):
    mask = os.umask(0)
    os.umask(mask)
    step = base / "step_00000002"
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in step.iterdir()}
    assert modes == dict.fromkeys(modes, 0o666 & ~mask), modes


@pytest.mark.parametrize("mb", ["0", "-5", "nan"])
def test_export_max_shard_mb_must_be_positive(base, tmp_path, mb):
    out = tmp_path / "hf"
    line = one_error_line(dtensor3d("export-hf", str(base), str(out), "--max-shard-mb", mb))
    assert "--max-shard-mb" in line, line
    assert not out.exists() and not list(tmp_path.iterdir())


def test_export_and_import_into_read_only_directory(base, tmp_path):
    exported = tmp_path / "hf"
    assert dtensor3d("export-hf", str(base), str(exported)).returncode == 0
    with read_only_dir(tmp_path / "ro") as ro:
        for target in (ro / "hf", ro):
            line = one_error_line(dtensor3d("export-hf", str(base), str(target)))
            assert str(target) in line and "cannot write" in line, line
            line = one_error_line(dtensor3d("import-hf", str(exported), str(target)))
            assert str(target) in line and "cannot write" in line, line
        assert os.listdir(ro) == []
