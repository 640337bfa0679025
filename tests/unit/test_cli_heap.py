"""A service's start and its heap: the collector runs rarely while it starts, then everything the
start left alive is frozen, so later full collections skip it (rlhf_core.cli)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

# In a fresh interpreter: freezing is for a whole process, not for the test runner's.
SCRIPT = textwrap.dedent("""
    import gc, weakref
    from rlhf_core.cli import collect_less_while_starting, freeze_startup_heap

    defaults = gc.get_threshold()
    collect_less_while_starting()
    assert gc.get_threshold() == (50_000, *defaults[1:]), gc.get_threshold()

    class Node:
        pass

    def cycle():
        a, b = Node(), Node()
        a.other, b.other = b, a
        return weakref.ref(a)

    garbage = cycle()                                # the start's garbage: collected, not frozen
    kept = [[Node() for _ in range(100)] for _ in range(100)]  # what the start keeps
    frozen_before = gc.get_freeze_count()
    freeze_startup_heap()
    assert garbage() is None, "a garbage cycle of the start was frozen instead of collected"
    assert gc.get_freeze_count() >= frozen_before + 10_100, gc.get_freeze_count()
    assert gc.get_threshold() == defaults, gc.get_threshold()
    assert not gc.get_objects(generation=2), "something alive at the freeze is still scanned"

    later = cycle()                                  # what the service makes afterwards is collected as ever
    gc.collect()
    assert later() is None
    print("ok", len(kept))
""")


def test_the_start_runs_few_collections_and_its_heap_is_frozen_while_later_garbage_is_collected():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["ok", "100"]


def test_a_freeze_without_a_quiet_start_leaves_the_thresholds_alone():
    # a service started some other way (a Ray actor) freezes its heap and keeps its thresholds
    script = textwrap.dedent("""
        import gc
        from rlhf_core.cli import freeze_startup_heap
        gc.set_threshold(1234, 5, 6)
        freeze_startup_heap()
        assert gc.get_threshold() == (1234, 5, 6), gc.get_threshold()
        assert gc.get_freeze_count() > 0
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "ok"


def test_a_service_raises_its_open_files_limit_to_the_hard_limit():
    # started with a soft limit of 64 under a hard one of 4,096 (a weight server at a low soft limit
    # stops accepting subscribers without a word): after raise_open_files_limit() the soft limit is 4,096
    import resource

    def low() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 4096))

    code = ("import resource; from rlhf_core.cli import raise_open_files_limit; raise_open_files_limit(); "
            "print(*resource.getrlimit(resource.RLIMIT_NOFILE))")
    out = subprocess.run([sys.executable, "-c", code], preexec_fn=low, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["4096", "4096"]


def test_an_entry_point_whose_write_the_disk_cannot_hold_stops_with_one_line(tmp_path):
    # a write no caller wrapped (a library's, a log's) on a full disk: /dev/full answers ENOSPC as a
    # full disk does, and the error has no file name. It ended with a traceback and exit 1, which
    # rlhf-run takes for a crash and restarts into the same disk; now one line naming the run's
    # folder and the room left there, exit 2 (never restarted).
    script = textwrap.dedent("""
        from rlhf_core.cli import hydra_entry

        @hydra_entry()
        def main(cfg):
            with open("/dev/full", "w") as f:
                f.write("a line")

        main()
    """)
    out = tmp_path / "out"
    args = [f"hydra.run.dir={tmp_path / 'hydra'}", "hydra.output_subdir=null", f"run.output_dir={out}"]
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: cannot write {out} (No space left on device); "), lines
    assert " MiB free on its disk: make room there" in lines[0]


def test_a_log_file_the_disk_cannot_hold_is_said_once(tmp_path, capsys):
    # logging printed a traceback ("--- Logging error ---") to the console for every record its
    # file could not take: 63 of them in a run whose disk filled up
    import logging

    from rlhf_core.cli import say_once_when_full

    path = tmp_path / "cli.log"
    path.symlink_to("/dev/full")
    logger = logging.getLogger("test-full-log")
    handler = say_once_when_full(logging.FileHandler(path))
    logger.addHandler(handler)
    try:
        for i in range(3):
            logger.warning("line %d", i)
    finally:
        logger.removeHandler(handler)
        handler.close()
    err = capsys.readouterr().err
    assert err.splitlines() == [f"warning: cannot write {path} (No space left on device); "
                                f"{err.split('; ', 1)[1].split(':', 1)[0]}: make room there (or move the run's output "
                                "to a larger disk), then continue the run: rlhf-run resume=<its output folder> (said "
                                "once: its lines are lost meanwhile)"], err
    assert "MiB free on its disk" in err
