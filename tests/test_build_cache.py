"""The native build cache: one folder per build key under <cache>/native/. Each upgrade or source
change leaves a build behind; a new build removes the others no process loaded for STALE_DAYS days,
and `bitsplit build-native --prune` all of them but the current one."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import time

import pytest

from bitsplit_llama import cli
from bitsplit_llama.native import build

DAY = 86400.0


def _fake_build(root, name, age_days=0.0, used_days=None):
    d = root / name
    d.mkdir(parents=True)
    (d / build.LIB).write_bytes(b"\0" * 4096)
    (d / "build.txt").write_text("cc ...\n")
    t = time.time() - age_days * DAY
    for p in (d / build.LIB, d / "build.txt", d):
        os.utime(p, (t, t))
    if used_days is not None:
        (d / build.USED).touch()
        u = time.time() - used_days * DAY
        os.utime(d / build.USED, (u, u))
        os.utime(d, (t, t))
    return d


@pytest.fixture(scope="module")
def real_lib():
    """The library the suite builds anyway, in the user's cache (before a test moves the cache)."""
    return build.build()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BITSPLIT_CACHE", str(tmp_path))
    root = tmp_path / "native"
    root.mkdir()
    return root


def test_prune_takes_stale_builds_and_leaves_recent_current_and_locked_ones(cache):
    stale = _fake_build(cache, "a" * 20, age_days=45)
    used = _fake_build(cache, "b" * 20, age_days=45, used_days=2)  # old build, loaded two days ago
    recent = _fake_build(cache, "c" * 20, age_days=1)
    current = _fake_build(cache, "d" * 20, age_days=90)
    locked = _fake_build(cache, "e" * 20, age_days=90)
    (cache / "stray-file").write_text("not a build")
    with open(locked / ".lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another process compiling it
        removed = build.prune(keep=current.name, older_than_s=30 * DAY)
        assert [d for d, _ in removed] == [stale]
        assert removed[0][1] >= 4096  # its bytes
        assert not stale.exists() and used.exists() and recent.exists() and current.exists() and locked.exists()
        # of any age: every other build but the locked one
        removed = build.prune(keep=current.name)
        assert sorted(d.name for d, _ in removed) == [used.name, recent.name]
        assert current.exists() and locked.exists() and (cache / "stray-file").exists()
    assert [d for d, _ in build.prune(keep=current.name)] == [locked]


def test_prune_without_a_cache_folder_removes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("BITSPLIT_CACHE", str(tmp_path / "none"))
    assert build.prune() == []


def test_a_new_build_prunes_stale_builds(cache, monkeypatch):
    """The compile step itself is faked (it is tested by every test that loads the library): a cache
    miss compiles, then removes the builds unused for STALE_DAYS, and keeps the rest."""
    stale = _fake_build(cache, "a" * 20, age_days=build.STALE_DAYS + 5)
    recent = _fake_build(cache, "b" * 20, age_days=build.STALE_DAYS - 5)
    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        out = cmd[cmd.index("-o") + 1]
        with open(out, "wb") as f:
            f.write(b"\0")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(build.subprocess, "run", fake_run)
    target = build.build()
    srcs = build.sources(build.source_dir())
    # one compile per source (in parallel), then one link of every object
    compiled = sorted(c[c.index("-c") + 1] for c in calls[:-1])
    assert compiled == sorted(str(build.source_dir() / s) for s in srcs)
    assert "-c" not in calls[-1] and "-shared" in calls[-1] and sum(a.endswith(".o") for a in calls[-1]) == len(srcs)
    assert target.exists() and target.parent.parent == cache and not list(target.parent.glob(".objs.*"))
    assert not stale.exists() and recent.exists()
    # a cache hit compiles nothing and removes nothing
    older = _fake_build(cache, "f" * 20, age_days=build.STALE_DAYS + 5)
    n = len(calls)
    assert build.build() == target and len(calls) == n and older.exists()


def test_sources_compile_heaviest_first_by_the_last_builds_times(cache, monkeypatch):
    """The first build orders the sources by their bytes and records each compile's seconds; the next
    orders them by those seconds (bytes misjudge the kernel templates), and by bytes again where a source
    has no recorded time (a new file) or the record is unreadable."""
    src = build.source_dir()
    names = build.sources(src)
    by_bytes = build._by_cost(src, names)
    assert build._compile_times() == {} and build._by_cost(src, names, {}) == by_bytes
    started = []

    def fake_run(cmd, **kw):
        if "-c" in cmd:
            started.append(os.path.relpath(cmd[cmd.index("-c") + 1], src))
        with open(cmd[cmd.index("-o") + 1], "wb") as f:
            f.write(b"\0")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(build.subprocess, "run", fake_run)
    monkeypatch.setattr(build, "_jobs", lambda: 1)  # one compiler: they start in the planned order
    build.build()
    assert started == by_bytes
    times = build._compile_times()
    assert sorted(times) == sorted(names) and all(t >= 0 for t in times.values())
    # the light files first if the record says so; a rebuild follows it
    fake = {n: float(i) for i, n in enumerate(by_bytes)}  # the first by bytes the lightest
    (cache / build.TIMES).write_text(json.dumps(fake))
    assert build._by_cost(src, names, build._compile_times()) == list(reversed(by_bytes))
    started.clear()
    build.build(force=True)
    assert started == list(reversed(by_bytes))
    # a source without a time (a new file), or an unreadable record: bytes
    del fake[names[0]]
    assert build._by_cost(src, names, fake) == by_bytes
    # another checkout's build (other sources) adds its times to the record, without dropping these
    build._save_compile_times({"elsewhere.c": 3.0})
    assert build._compile_times()["elsewhere.c"] == 3.0 and set(names) <= set(build._compile_times())
    (cache / build.TIMES).write_text("{not json")
    assert build._compile_times() == {}


def test_a_failed_compile_names_the_source_and_leaves_nothing(cache, monkeypatch):
    def fake_run(cmd, **kw):
        if "-c" in cmd and cmd[cmd.index("-c") + 1].endswith("pool.c"):
            return subprocess.CompletedProcess(cmd, 1, "", "pool.c:1:1: error: something is wrong")
        with open(cmd[cmd.index("-o") + 1], "wb") as f:
            f.write(b"\0")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(build.subprocess, "run", fake_run)
    with pytest.raises(build.NativeError, match=r"compiling \S*pool\.c.*something is wrong"):
        build.build()
    left = [p.name for p in cache.rglob("*") if p.is_file() and p.name != ".lock"]
    assert left == [] and not list(cache.rglob(".objs.*"))


def test_build_native_prune_keeps_the_current_build(real_lib, cache, capsys):
    real = real_lib
    here = cache / real.parent.name
    here.mkdir()
    shutil.copy2(real, here / build.LIB)
    others = [_fake_build(cache, "a" * 20, age_days=0), _fake_build(cache, "b" * 20, age_days=100)]
    assert cli.main(["build-native", "--prune"]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[0] == str(here / build.LIB)
    assert "removed 2 other builds" in err and str(cache) in err
    assert (here / build.LIB).exists() and not any(d.exists() for d in others)
    assert cli.main(["build-native", "--prune"]) == 0
    assert "removed 0 other builds (0.0 MiB)" in capsys.readouterr().err


def test_load_marks_its_build_used(real_lib, cache):
    real = real_lib
    here = cache / real.parent.name
    here.mkdir()
    shutil.copy2(real, here / build.LIB)
    assert not (here / build.USED).exists()
    build.load.__wrapped__()  # load() itself is cached per process
    assert (here / build.USED).exists()
