"""Weight-sync benchmark: publish a version of S bytes and pull it into 1, 2 and 4 workers, over
TCP and over same-host shared memory, side by side with a raw ZeroMQ PUSH/PULL of the same bytes
and an in-process memcpy.

    .venv/bin/python bench/weight_sync.py            # quick: S = 256 MB
    .venv/bin/python bench/weight_sync.py --full     # S = 1 GB

Processes: two weight servers (their own processes, as in production): one with
``shm=off`` for the TCP path and one with ``shm=auto`` for the shared-memory path and the mixed
path (publish into its slab files, pull over TCP with ``shm=off`` workers: the placement for
workers on other hosts, with the server beside the learner); the publishers
(this process, one per server) and up to 4 worker processes, each with a subscriber per server
pulling into the same preallocated tensors (an in-place apply). After warm-up publishes (the
servers recycle the slabs of evicted versions, so steady state is what a training run sees),
``--reps`` rounds each measure everything back to back: memcpy, raw, and for each path publish ->
applied after the commit, publish -> applied with cut-through (the default pull; on the shm path
the follower hashes from the slab file while the publisher copies into it, and applies after
the commit) and 1/2/4 concurrent pulls. Times are
medians over rounds; ratios are medians of per-round ratios, so a change in the load of a shared
machine hits the baselines and both paths alike. Every round is kept in the JSON, with the CPU
use of our processes and of the whole machine.

Targets: publish -> applied in one worker within 2x the raw transfer; 4 workers pulling
at once aggregate >= 1.5x one worker's throughput.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import print_table, write_results  # noqa: E402

MB = 1024 * 1024
PATHS = ("tcp", "shm", "mixed")
# the weight server each path talks to: "mixed" publishes into the shm server's slab files and
# pulls from that server over TCP (a server beside the learner, workers on other hosts)
SERVER_OF = {"tcp": "tcp", "shm": "shm", "mixed": "shm"}
SERVERS = ("tcp", "shm")


def tensor_shapes(total_bytes: int, n_big: int = 16, n_small: int = 32) -> dict[str, int]:
    """A model-like set of fp32 tensors: ``n_big`` large matrices plus small vectors (norms, biases)."""
    small = 4096
    big = (total_bytes - n_small * small * 4) // n_big // 4
    shapes = {f"layers.{i:02d}.weight": big for i in range(n_big)}
    shapes.update({f"layers.{i:02d}.norm": small for i in range(n_small)})
    return shapes


def make_tensors(total_bytes: int):
    import torch

    g = torch.Generator().manual_seed(0)
    return {name: torch.randn(n, generator=g) for name, n in tensor_shapes(total_bytes).items()}


def server_main(cfg_kwargs: dict, conn) -> None:
    from rlhf_core.config import WeightServerConfig
    from weight_server import WeightServer

    server = WeightServer(WeightServerConfig(**cfg_kwargs))
    conn.send((server.address, server.pub_address))
    server.serve_forever()


def path_cfg(cfg_kwargs: dict, path: str) -> dict:
    """Settings of a server, publisher or subscriber of ``path`` (servers are named by path too)."""
    return {**cfg_kwargs, "shm": "auto" if path == "shm" else "off"}


def worker_main(wid: int, addresses: dict, cfg_kwargs: dict, total_bytes: int, conn) -> None:
    import torch
    import zmq

    from rlhf_core.config import WeightServerConfig
    from weight_server import WeightSubscriber
    from weight_server.sockets import Context

    torch.set_num_threads(1)
    cfg = WeightServerConfig(**cfg_kwargs)
    target = {name: torch.zeros(n) for name, n in tensor_shapes(total_bytes).items()}  # touched pages
    subs = {
        path: WeightSubscriber(*addresses[SERVER_OF[path]], WeightServerConfig(**path_cfg(cfg_kwargs, path)),
                               worker_id=f"w{wid}")
        for path in PATHS
    }
    raw_ctx = Context()
    conn.send("ready")
    while True:
        cmd = conn.recv()
        if cmd[0] == "exit":
            break
        if cmd[0] == "follow":  # wait for an announcement of version >= want, pull it, report when applied
            sub, want, cut_through = subs[cmd[1]], cmd[2], cmd[3]
            while (sub.poll_announcement(timeout_ms=1, pending=cut_through) or -1) < want:
                pass
            res = sub.pull(into=target, skip_unchanged=False, follow=cut_through)
            conn.send((time.monotonic(), res[0] if res else None))
        elif cmd[0] == "pull":  # pull now (the version is already published)
            sub = subs[cmd[1]]
            t0 = time.monotonic()
            res = sub.pull(into=target, skip_unchanged=False)
            conn.send((t0, time.monotonic(), res[0] if res else None, sub.stats["pulls_shm"]))
        elif cmd[0] == "raw_open":  # the baseline: a PULL socket receiving the same bytes into a preallocated buffer
            raw = raw_ctx.socket(zmq.PULL)
            raw.rcvhwm = cfg.max_inflight_chunks
            raw.connect(cmd[1])
            raw_buf = memoryview(torch.zeros(total_bytes, dtype=torch.uint8).numpy())
            conn.send("connected")
        elif cmd[0] == "raw_recv":
            got = 0
            while got < total_bytes:
                got += raw.recv_into(raw_buf[got : got + cfg.chunk_bytes])
            conn.send(time.monotonic())
    for sub in subs.values():
        sub.close()
    raw_ctx.close()


def bench_memcpy(total_bytes: int) -> float:
    import torch

    src = torch.ones(total_bytes, dtype=torch.uint8)
    dst = torch.zeros(total_bytes, dtype=torch.uint8)  # touched pages: a copy, not page faults
    t0 = time.perf_counter()
    dst.copy_(src)
    return time.perf_counter() - t0


class RawLink:
    """The baseline: a raw ZeroMQ PUSH (here) -> PULL (worker 0, recv_into a preallocated buffer)
    of the same bytes in the same chunk size, zero-copy on the sending side."""

    def __init__(self, views, chunk_bytes: int, conn) -> None:
        import zmq

        from weight_server.sockets import Context

        self.views, self.chunk_bytes, self.conn = views, chunk_bytes, conn
        self.ctx = Context()
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.sndhwm = 8
        port = self.push.bind_to_random_port("tcp://127.0.0.1")
        conn.send(("raw_open", f"tcp://127.0.0.1:{port}"))
        assert conn.recv() == "connected"
        time.sleep(0.2)

    def once(self) -> float:
        self.conn.send(("raw_recv",))
        t0 = time.monotonic()
        for view in self.views:
            for off in range(0, len(view), self.chunk_bytes):
                self.push.send(view[off : off + self.chunk_bytes], copy=False)
        return self.conn.recv() - t0

    def close(self) -> None:
        self.ctx.close()


def notes(ratios: dict, cpu: dict, nbytes: int, spread: dict) -> list[str]:
    out = [
        f"S = {nbytes / MB:.0f} MB of fp32 tensors; times are medians over rounds, ratios medians of per-round "
        "ratios (see 'rounds'); on a shared 2-core machine single rounds vary by 2-4x.",
        "publish -> applied counts from the learner's publish() call to the worker's in-place apply returning; "
        "'cut-through' is the default pull (follow=True): the worker follows the upload and applies only after its "
        "own hash check and the server's commit. Over TCP it fetches chunks while they arrive; over shm the publisher "
        "reports each stretch it copied into the slab file, the server and the worker hash tensors from the file as "
        "they complete, and the worker copies into its tensors after the commit. 'after commit' pulls once the "
        "version is announced.",
        "tcp: both servers' clients with shm=off, every byte through two ZeroMQ hops. shm: the publisher copies into "
        "the server's slab file, the server hashes it at commit, the worker hashes it in place and copies it into "
        "its tensors; no tensor byte crosses a socket. mixed: the publisher copies into the shm server's slab file "
        "and the workers (shm=off) pull from that server over TCP: a server on the learner's host with workers on "
        "other hosts, one network hop.",
    ]
    n_cpu = os.cpu_count() or 1
    for path in PATHS:
        c1, c4 = cpu[path][1], cpu[path][4]
        line = (
            f"{path}, 4 workers: the machine's {n_cpu} cores were {c4['machine_busy_cores']:.2f} busy, "
            f"{c4['ours_cores']:.2f} of them by this benchmark; one puller alone kept {c1['ours_cores']:.2f} cores busy; "
            f"the slowest of 4 took {c4['slowest_over_fastest_puller']:.2f}x as long as the fastest."
        )
        lo, hi = spread[path]
        line += f" Per round the 4/1 aggregate ranged {lo:.2f}-{hi:.2f}."
        if path != "shm":
            line += (
                " The TCP aggregate is CPU-bound: every pulled byte is copied by the server's send, the worker's receive "
                "and its recv_into, then hashed and applied, so on this box the 4/1 ratio measures free CPU."
            )
        else:
            line += (
                " Each shm puller reads the slab twice (hash, then copy) and writes its tensors once, with no help from "
                "the server: 4 pullers share 2 cores and the memory bandwidth, and hash+copy alone in 4 processes "
                "scales to about 1.7x here."
            )
        out.append(line)
    if ratios["tcp"]["publish_to_applied_over_raw"] > 2.0:
        out.append(
            "tcp publish -> applied exceeds 2x raw: two hops (learner->server->worker), hashing on both ends and the "
            f"in-place copy share {n_cpu} cores; the shm path removes both hops for same-host peers."
        )
    return out


class Rig:
    """The two servers, the 4 worker processes and one publisher per server, as in production
    (each in its own process), plus the raw link to worker 0."""

    def __init__(self, cfg_kwargs: dict, total: int, tensors: dict) -> None:
        import psutil

        from rlhf_core.config import WeightServerConfig
        from weight_server import WeightPublisher
        from weight_server.tensors import byte_view

        self.tensors = tensors
        ctx = mp.get_context("spawn")
        self.servers, addresses = {}, {}
        for path in SERVERS:
            parent, child = ctx.Pipe()
            self.servers[path] = ctx.Process(target=server_main, args=(path_cfg(cfg_kwargs, path), child), daemon=True)
            self.servers[path].start()
            addresses[path] = parent.recv()
        self.workers, self.pipes = [], []
        for wid in range(4):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=worker_main, args=(wid, addresses, cfg_kwargs, total, child), daemon=True)
            p.start()
            self.workers.append(p)
            self.pipes.append(parent)
        for p in self.pipes:
            assert p.recv() == "ready"
        self.pubs = {srv: WeightPublisher(addresses[srv][0], WeightServerConfig(**path_cfg(cfg_kwargs, srv))) for srv in SERVERS}
        self.versions = {srv: 0 for srv in SERVERS}
        self.procs = [psutil.Process(p.pid) for p in (*self.servers.values(), *self.workers)]
        self.raw = RawLink([byte_view(t) for t in tensors.values()], cfg_kwargs["chunk_bytes"], self.pipes[0])

    def publish(self, path: str):
        srv = SERVER_OF[path]
        self.versions[srv] += 1
        for t in self.tensors.values():  # every tensor changes, as after an optimizer step
            t[0] += 1.0
        stats = self.pubs[srv].publish(self.versions[srv], self.tensors)
        assert stats.via == srv, (stats.via, path)  # the path under test really was taken
        return stats

    def follow(self, path: str, cut_through: bool) -> tuple[float, float]:
        """publish -> worker 0 pulls, verifies and applies in place. After commit: it pulls once the
        version is announced. Cut-through: it follows the upload (TCP: as the bytes arrive; shm:
        from the commit on), and still applies only after the commit and its own hash check."""
        self.pipes[0].send(("follow", path, self.versions[SERVER_OF[path]] + 1, cut_through))
        t0 = time.monotonic()
        stats = self.publish(path)
        t_applied, got = self.pipes[0].recv()
        assert got == self.versions[SERVER_OF[path]], (got, self.versions)
        return t_applied - t0, stats.duration_s

    def pull_at_once(self, path: str, n: int) -> dict[str, float]:
        """n workers pull the published version at once; CPU use of our processes (servers and
        workers) and of the whole machine says whether the figure is CPU-bound on this box."""
        import psutil

        before = sum(sum(pr.cpu_times()[:2]) for pr in self.procs)
        idle_before = psutil.cpu_times().idle
        t0 = time.monotonic()
        for p in self.pipes[:n]:
            p.send(("pull", path))
        res = [p.recv() for p in self.pipes[:n]]
        wall = time.monotonic() - t0
        assert all(r[2] == self.versions[SERVER_OF[path]] for r in res), res
        each = [r[1] - r[0] for r in res]
        return {
            "s": max(r[1] for r in res) - min(r[0] for r in res),
            "ours_cores": (sum(sum(pr.cpu_times()[:2]) for pr in self.procs) - before) / wall,
            "machine_busy_cores": (os.cpu_count() or 1) - (psutil.cpu_times().idle - idle_before) / wall,
            "slowest_over_fastest_puller": max(each) / min(each),
        }

    def warm_up(self) -> None:
        """Server slabs (three of them take turns with keep_versions=2), staging buffers, mappings
        and the raw receiver's buffer get their pages once."""
        self.raw.once()
        for path in PATHS:
            for cut_through in (False, True, False):
                self.follow(path, cut_through)
            for p in self.pipes:
                p.send(("pull", path))
            shm_pulls = [p.recv()[3] for p in self.pipes]
            assert all(k > 0 for k in shm_pulls) if path == "shm" else not any(shm_pulls), shm_pulls  # the path really taken

    def rounds(self, reps: int, nbytes: int) -> list[dict]:
        """Each round measures everything back to back, so that a change in the load of this
        shared machine hits the baselines and both paths alike; ratios are per round."""
        rounds = []
        for _ in range(reps):
            rnd = {"memcpy_s": bench_memcpy(nbytes), "raw_s": self.raw.once()}
            for path in PATHS:
                r = rnd[path] = {}
                r["after_commit_s"], r["publish_s"] = self.follow(path, False)
                r["cut_through_s"], _ = self.follow(path, True)
                r["pull"] = {n: self.pull_at_once(path, n) for n in (1, 2, 4)}
            rounds.append(rnd)
        return rounds

    def close(self) -> None:
        self.raw.close()
        for p in self.pipes:
            p.send(("exit",))
        for w in self.workers:
            w.join(10)
        for pub in self.pubs.values():
            pub.close()
        for srv in self.servers.values():
            srv.terminate()
            srv.join(10)


BUSY = "cores busy ours/machine"


def summarize(rounds: list[dict], nbytes: int) -> tuple[list[dict], dict, dict, dict, dict]:
    """Medians over rounds: the table rows, the per-path results, the ratios, the CPU use and the
    per-round spread of the 4/1 aggregate (lowest, highest)."""
    med = statistics.median
    memcpy_s, raw_s = med(r["memcpy_s"] for r in rounds), med(r["raw_s"] for r in rounds)
    gbps = lambda s, n=1: n * nbytes / s / 1e9  # noqa: E731
    rows = [
        {"measure": "memcpy (in-process)", "seconds": memcpy_s, "GB/s": gbps(memcpy_s), "x raw": memcpy_s / raw_s, BUSY: None},
        {"measure": "raw ZeroMQ PUSH/PULL", "seconds": raw_s, "GB/s": gbps(raw_s), "x raw": 1.0},
    ]
    results: dict = {"memcpy_s": memcpy_s, "raw_zmq_s": raw_s, "gbps": {"memcpy": gbps(memcpy_s), "raw_zmq": gbps(raw_s)}}
    ratios: dict = {}
    cpu: dict = {}
    spread: dict = {}
    for path in PATHS:
        per_round = [4 * r[path]["pull"][1]["s"] / r[path]["pull"][4]["s"] for r in rounds]
        spread[path] = (min(per_round), max(per_round))
        pr = [r[path] for r in rounds]
        publish_s, e2e_s, cut_s = (med(r[k] for r in pr) for k in ("publish_s", "after_commit_s", "cut_through_s"))
        pulls = {n: med(r["pull"][n]["s"] for r in pr) for n in (1, 2, 4)}
        cpu[path] = {n: {f: med(r["pull"][n][f] for r in pr) for f in ("ours_cores", "machine_busy_cores",
                                                                       "slowest_over_fastest_puller")} for n in (1, 2, 4)}
        ratios[path] = {
            "publish_to_applied_over_raw": med(r[path]["cut_through_s"] / r["raw_s"] for r in rounds),
            "publish_to_applied_after_commit_over_raw": med(r[path]["after_commit_s"] / r["raw_s"] for r in rounds),
            "pull_4_over_1_aggregate": med(per_round),
        }
        rows += [
            {"measure": f"{path}: publish only (to server)", "seconds": publish_s, "GB/s": gbps(publish_s), "x raw": publish_s / raw_s},
            {"measure": f"{path}: publish -> applied, after commit", "seconds": e2e_s, "GB/s": gbps(e2e_s), "x raw": e2e_s / raw_s},
            {"measure": f"{path}: publish -> applied, cut-through", "seconds": cut_s, "GB/s": gbps(cut_s), "x raw": cut_s / raw_s},
        ]
        for n, secs in pulls.items():
            rows.append({"measure": f"{path}: pull, {n} worker(s) at once", "seconds": secs, "GB/s": gbps(secs, n),
                         "x raw": secs / raw_s, BUSY: f"{cpu[path][n]['ours_cores']:.2f}/{cpu[path][n]['machine_busy_cores']:.2f}"})
        results[path] = {
            "publish_s": publish_s, "publish_to_applied_s": cut_s, "publish_to_applied_after_commit_s": e2e_s,
            "pull_s": {str(n): secs for n, secs in pulls.items()},
            "pull_cpu_cores": {str(n): c for n, c in cpu[path].items()},
            "gbps": {
                "publish": gbps(publish_s), "publish_to_applied": gbps(cut_s), "publish_to_applied_after_commit": gbps(e2e_s),
                **{f"pull_{n}_aggregate": gbps(secs, n) for n, secs in pulls.items()},
            },
        }
    return rows, results, ratios, cpu, spread


def targets_of(ratios: dict) -> dict:
    return {
        "publish_to_applied_over_raw": {"max": 2.0, **{
            path: {"value": ratios[path]["publish_to_applied_over_raw"], "met": ratios[path]["publish_to_applied_over_raw"] <= 2.0}
            for path in PATHS}},
        "pull_4_over_1_aggregate": {"min": 1.5, **{
            path: {"value": ratios[path]["pull_4_over_1_aggregate"], "met": ratios[path]["pull_4_over_1_aggregate"] >= 1.5}
            for path in PATHS}},
    }


def print_verdicts(ratios: dict, targets: dict) -> None:
    print()
    for path in PATHS:
        r, t = ratios[path], {k: v[path]["met"] for k, v in targets.items()}
        print(f"{path}: publish -> applied / raw = {r['publish_to_applied_over_raw']:.2f} (after commit "
              f"{r['publish_to_applied_after_commit_over_raw']:.2f}; target <= 2.0: {'met' if t['publish_to_applied_over_raw'] else 'MISSED'}); "
              f"4-worker aggregate / 1 worker = {r['pull_4_over_1_aggregate']:.2f} "
              f"(target >= 1.5: {'met' if t['pull_4_over_1_aggregate'] else 'MISSED'})")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="S = 256 MB (default)")
    mode.add_argument("--full", action="store_true", help="S = 1 GB")
    ap.add_argument("--size-mb", type=int, default=None)
    ap.add_argument("--chunk-mb", type=int, default=4)
    ap.add_argument("--inflight", type=int, default=8)
    ap.add_argument("--reps", type=int, default=7, help="measured rounds (medians are reported)")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    size_mb = args.size_mb or (1024 if args.full else 256)
    total = size_mb * MB
    cfg_kwargs = {"chunk_bytes": args.chunk_mb * MB, "max_inflight_chunks": args.inflight, "keep_versions": 2}
    t_start = time.monotonic()
    tensors = make_tensors(total)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    rig = Rig(cfg_kwargs, total, tensors)
    rig.warm_up()
    rounds = rig.rounds(args.reps, nbytes)
    rig.close()
    rows, results, ratios, cpu, spread = summarize(rounds, nbytes)
    print_table(rows, f"weight sync, S = {nbytes / MB:.0f} MB, chunk {args.chunk_mb} MB, {args.inflight} chunks in flight")
    targets = targets_of(ratios)
    print_verdicts(ratios, targets)
    write_results("weight_sync", {
        "mode": "full" if args.full else "quick",
        "config": {"size_bytes": nbytes, "tensors": len(tensors), "dtype": "float32", "reps": args.reps, **cfg_kwargs},
        "results": results,
        "ratios": ratios,
        "targets": targets,
        "rounds": [{**r, **{path: {**r[path], "pull": {str(n): v for n, v in r[path]["pull"].items()}} for path in PATHS}}
                   for r in rounds],
        "wall_s": time.monotonic() - t_start,
        "notes": notes(ratios, cpu, nbytes, spread),
    })


if __name__ == "__main__":
    main()
