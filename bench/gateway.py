"""The gateway under load: what serving agents over HTTP costs against driving the engine directly.

1. **Gateway**: ``rlhf-run gateway.enabled=true data.source=none`` (learner, weight server, one
   worker, the gateway, Redis: each its own process, as a user runs it), driven by the async
   ``openai`` client: ``sessions`` concurrent sessions of ``turns`` chat turns each (each turn
   extends the session's conversation by the reply and a short user message, so the session's
   ids are reused token in, token out), ``max_tokens`` per turn. Requests/s, p50/p99 latency per
   request and generated tokens/s (wall clock from the first request to the last reply).
2. **Engine directly**: the same `hf` engine (same model, slots and context) in this process,
   the same sessions and turns, each turn's prompt the session's context so far plus the same
   user message's tokens, a session's next turn added as soon as its reply is in (continuous
   batching across sessions, as the worker does with the gateway's calls).

Target: gateway tokens/s >= 0.85 x the engine's (the gateway costs <= 15%). Both sides sample
with the same settings (EOS allowed), so their token counts differ a little; tokens/s compares them.
Both are warmed up first by one turn of every session with a different length each (every batch
size's CUDA graph is captured before the timed rounds). Each row also counts the engine's
forward passes (the gateway's from its worker's heartbeats): decoding steps, wall time and tokens
per step, prefill passes per step, which tell a slower step from fewer rows decoding. A gateway
row's ``call_ms`` says where its calls' time went, mean ms per call (the gateway's
``call_phases_s`` in ``/v1/rl/stats``): ``gateway_in`` (the request until its call is pushed),
``to_worker`` (until a worker's engine has it), ``engine``, ``to_gateway`` (the answer back), and
``rest``, what the client waited beyond them (its HTTP and JSON work, the gateway's reply).

``--clients N`` splits the sessions over N client processes (``--gpu``: 8): agents are separate
programs, and one Python process serialises every session's HTTP and JSON work (2-3 ms a call),
which is the load generator's cost, not the gateway's, on a host with cores to spare.

    .venv/bin/python bench/gateway.py [--quick|--full|--gpu|--gpu-check] [--shape tiny|small]
        [--sessions N] [--turns N] [--turn-tokens N ...] [--slots N] [--clients N]

``--sessions 1 --turns 12 --turn-tokens 16`` measures one agent's latency per call (a session
holds 640 response tokens, its turns and the user's messages: about 12 turns of 16 here).
``--long``: 16 agents of 24 turns, each turn adding a tool result of 64 characters (``--user-chars``;
tokens, with the tiny model), so a session grows to about 2,500 tokens: what a call costs once
its conversation is long (JSON ``gateway_long.json``; about a minute on the 2-core machine).
Every gateway row has ``gateway_cpu_ms_per_call``, the gateway process's CPU over its calls.

``--quick`` stays under a minute on a free 2-core machine; ``--full`` runs more rounds. JSON in
``bench/results/gateway.json`` (``gateway_full.json``). ``--shape small`` runs both sides on a
larger random model of the same family (3.3M parameters: a decoding step of 64 rows takes 20-50 ms
on one CPU core at these contexts, the tiny model's 2-5 ms): a call's HTTP and JSON work costs the
same either way, so the two shapes show how the gateway's cost scales with what a step costs
(JSON ``gateway_small.json``, ``gateway_full_small.json``).

``--gpu`` runs both sides on CUDA with a Qwen2-0.5B-shaped model (random bf16 weights, built from
its config, the engine's CUDA graphs), the quick mode's sessions and turns, the best of 3 rounds
(one round of 16-token turns lasts a second or two on an H100 and moved by 2x between identical
runs); ``--gpu-check`` runs
that path on a CPU with a 2-layer model of the shape (JSON ``gateway_gpu.json``,
``gateway_gpu_check.json``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import mode_parser, print_table, require_device, write_results  # noqa: E402
from rlhf_core import metric_names as M  # noqa: E402

MODES: dict[str, dict[str, Any]] = {
    "quick": dict(sessions=64, slots=64, turns=4, turn_tokens=(16, 128), rounds=1, clients=1),
    "full": dict(sessions=64, slots=64, turns=4, turn_tokens=(16, 128), rounds=3, clients=1),
    "gpu": dict(sessions=64, slots=64, turns=4, turn_tokens=(16, 128), rounds=3, clients=8, device="cuda", qwen2={}),
    "gpu-check": dict(sessions=8, slots=8, turns=2, turn_tokens=(8,), rounds=1, clients=2, device="cpu",
                      qwen2=dict(num_hidden_layers=2, vocab_size=4096)),
    # agents with longer contexts: 24 turns, each adding a tool result of 64 characters (tokens here)
    "long": dict(sessions=16, slots=16, turns=24, turn_tokens=(16,), rounds=1, clients=1, user_chars=64),
}
EPISODE = 640  # rollout.max_episode_tokens: 4 turns of 128 and the user's messages
CONTEXT = 1024  # the tiny model's positions (its default 256 would not hold 4 turns of 128)
TARGET = 0.85
USER = "go on"


def user_message(m: dict[str, Any]) -> str:
    """What the agent adds after each reply: ``USER``, or ``user_chars`` characters of a tool's output."""
    n = m.get("user_chars")
    return USER if not n else ("result: " + "0123456789 " * n)[:n]


def episode_tokens(m: dict[str, Any]) -> int:
    """``rollout.max_episode_tokens``: ``EPISODE``, or with ``user_chars`` what the sessions' turns,
    the tool results and the template's words take."""
    if not m.get("user_chars"):
        return EPISODE
    return max(EPISODE, m["turns"] * (max(m["turn_tokens"]) + len(user_message(m)) + 24) + 64)


#: ``model.tiny`` settings of each shape (head_dim 64 for both)
SHAPES: dict[str, dict[str, int]] = {
    "tiny": {},
    "small": dict(hidden_size=256, num_layers=4, num_heads=4, intermediate_size=704),
}


def model_overrides(m: dict[str, Any]) -> list[str]:
    """The model of both sides: the tiny builder's (``--shape``), or a Qwen2-0.5B-shaped directory
    (``--gpu``, ``--gpu-check``) loaded as ``model=hf``."""
    if m.get("qwen2") is None:
        return [f"model.tiny.max_position_embeddings={max(CONTEXT, episode_tokens(m) + 256)}", *(f"model.tiny.{k}={v}" for k, v in SHAPES[m['shape']].items())]
    from _models import qwen2_05b_dir, tokenizer_dir

    dtype = "bfloat16" if m["device"] == "cuda" else "float32"
    path = qwen2_05b_dir(m["cache_dir"], dtype=dtype, **m["qwen2"])
    return ["model=hf", f"model.path={path}", f"model.tokenizer_path={tokenizer_dir(path)}", f"model.dtype={dtype}",
            f"model.device={m['device']}"]


def overrides(m: dict[str, Any], out: Path) -> list[str]:
    return [f"hydra.run.dir={out}", "gateway.enabled=true", "gateway.port=0", "data.source=none", "run.progress=false",
            "rollout.num_workers=1", f"rollout.slots={m['slots']}", f"rollout.max_new_tokens={max(m['turn_tokens'])}",
            f"rollout.max_episode_tokens={episode_tokens(m)}", "learner.max_updates=1000000", f"model.cache_dir={m['cache_dir']}",
            "gateway.session_ttl_s=600", f"gateway.max_tokens={max(m['turn_tokens'])}",
            *model_overrides(m)]


def start_run(m: dict[str, Any], out: Path) -> tuple[subprocess.Popen, str]:
    cmd = [str(Path(sys.executable).parent / "rlhf-run"), *overrides(m, out)]
    log = open(out.parent / "run.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    deadline = time.monotonic() + 180
    info = out / "gateway.json"
    while not info.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"rlhf-run did not start the gateway:\n{(out.parent / 'run.log').read_text()[-3000:]}")
        time.sleep(0.2)
    return proc, json.loads(info.read_text())["url"]


async def wait_healthy(url: str, timeout_s: float = 120.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient() as http:
        while time.monotonic() < deadline:
            try:
                if (await http.get(url.removesuffix("/v1") + "/health")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.2)
    raise SystemExit("the gateway did not report a live worker in time")


PHASES = ("gateway_in_s", "to_worker_s", "engine_s", "to_gateway_s")


def call_phases(url: str) -> dict[str, float]:
    """The gateway's summed call phases so far (``/v1/rl/stats``: where its calls spent their time)."""
    import httpx

    return httpx.get(f"{url}/rl/stats", timeout=30).json()["call_phases_s"]


def phase_ms(before: dict[str, float], after: dict[str, float], latencies: list[float]) -> dict[str, float]:
    """Mean ms per call in each phase between two readings; ``rest``: what the client waited
    beyond them (its HTTP and JSON work, the gateway's reply), from its mean latency."""
    calls = max(1, after["calls"] - before["calls"])
    out = {k.removesuffix("_s"): round(1e3 * (after[k] - before[k]) / calls, 2) for k in PHASES}
    out["rest"] = round(1e3 * sum(latencies) / max(1, len(latencies)) - sum(out.values()), 2)
    return out


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """CPU time (user + system) of each process so far; this process under ``client``."""
    out = {}
    for name, pid in {**pids, "client": os.getpid()}.items():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            out[name] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            pass
    return out


class WorkerPasses:
    """The run's worker's forward passes (decoding steps, prefill passes), read from its heartbeat
    record in the buffer; a reading waits for a heartbeat written after it was asked for."""

    def __init__(self, out: Path) -> None:
        from omegaconf import OmegaConf

        from buffer import MonitorClient

        cfg = OmegaConf.load(out / "run_config.yaml").buffer
        self.buffer = MonitorClient.connect(cfg.url, cfg.run_id)

    def read(self, timeout_s: float = 30.0) -> tuple[int, int, int]:
        def record() -> dict[str, Any]:
            return self.buffer.metrics()["consumers"].get("worker-0", {}).get("stats") or {}

        first = record().get("uptime_s", -1.0)
        deadline = time.monotonic() + timeout_s
        while (stats := record()).get("uptime_s", -1.0) <= first:
            if time.monotonic() > deadline:
                raise SystemExit("the worker wrote no heartbeat in 30 s")
            time.sleep(0.1)
        return stats.get(M.WORKER_ENGINE_STEPS, 0), stats.get(M.WORKER_ENGINE_PREFILLS, 0), stats.get(M.WORKER_ENGINE_REUSED, 0)

    def close(self) -> None:
        self.buffer.close()


def round_row(side: str, m: dict[str, Any], latencies: list[float], tokens: int, wall: float) -> dict[str, Any]:
    """One side's round: requests/s, tokens/s and p50/p99 latency per call."""
    latencies = sorted(latencies)
    n = len(latencies)
    return {"side": side, "turn_tokens": m["max_tokens"], "requests": n, "tokens": tokens, "wall_s": wall,
            "requests_per_s": n / wall, "tokens_per_s": tokens / wall, "p50_ms": 1000 * latencies[n // 2],
            "p99_ms": 1000 * latencies[min(n - 1, int(0.99 * n))]}


def add_passes(row: dict[str, Any], steps: int, prefills: int, reused: int) -> dict[str, Any]:
    """A row's forward passes: decoding steps, wall time and tokens per step, prefill passes per
    step; prompt tokens whose K/V a turn found in its session's slot (not prefilled again)."""
    return dict(row, steps=steps, ms_per_step=1000 * row["wall_s"] / max(steps, 1), rows_per_step=row["tokens"] / max(steps, 1),
                prefills_per_step=prefills / max(steps, 1), reused_tokens=reused)


def warm_tokens(m: dict[str, Any], i: int) -> int:
    """Session ``i``'s max_tokens in a warm-up round: all different, so the rows decoding fall one by
    one and every batch-size bucket's CUDA graph is captured before the timed rounds."""
    return 1 + i % max(m["turn_tokens"])


async def drive(url: str, model: str, m: dict[str, Any], tag: str, sessions: range) -> tuple[list[float], int]:
    """Run ``sessions`` on one async ``openai`` client; returns each call's latency and the tokens generated."""
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
    latencies: list[float] = []
    tokens = 0

    async def session(i: int) -> None:
        nonlocal tokens
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"count from {i % 10}"}]
        for _ in range(m["turns"]):
            t0 = time.perf_counter()
            # the raw response (the client's own request path, its JSON read without building pydantic
            # models: on 2 cores the load generator shares a core with the gateway and Redis)
            raw = await client.chat.completions.with_raw_response.create(
                model=model, messages=messages, max_tokens=m["max_tokens"] or warm_tokens(m, i),
                extra_headers={"X-Session-Id": f"{tag}-{i}"})
            r = json.loads(raw.content)
            latencies.append(time.perf_counter() - t0)
            tokens += r["usage"]["completion_tokens"]
            messages += [{"role": "assistant", "content": r["choices"][0]["message"]["content"] or ""},
                         {"role": "user", "content": user_message(m)}]

    await asyncio.gather(*(session(i) for i in sessions))
    await client.close()
    return latencies, tokens


def client_process(url: str, model: str, m: dict[str, Any], tag: str, sessions: range, start_at: float
                   ) -> tuple[list[float], int, float, float]:
    """One of ``--clients`` processes: its sessions from ``start_at`` (``time.perf_counter``, the same
    clock in every process); returns latencies, tokens, when it ended and its CPU seconds."""
    time.sleep(max(0.0, start_at - time.perf_counter()))
    cpu0 = time.process_time()
    latencies, tokens = asyncio.run(drive(url, model, m, tag, sessions))
    return latencies, tokens, time.perf_counter(), time.process_time() - cpu0


def gateway_round(url: str, model: str, m: dict[str, Any], tag: str, pids: dict[str, int] | None = None,
                  pool: Any = None) -> dict[str, Any]:
    """The sessions through the gateway: from this process, or split over ``pool``'s ``m["clients"]``
    processes (agents are separate programs; one Python process serialises their JSON work)."""
    cpu0, phases0 = cpu_seconds(pids or {}), call_phases(url)
    if pool is None:
        t0 = time.perf_counter()
        latencies, tokens = asyncio.run(drive(url, model, m, tag, range(m["sessions"])))
        wall, client_cpu = time.perf_counter() - t0, None
    else:
        n = m["clients"]
        t0 = time.perf_counter() + 0.5
        parts = [pool.submit(client_process, url, model, m, tag, range(k, m["sessions"], n), t0) for k in range(n)]
        done = [p.result() for p in parts]
        latencies = [x for d in done for x in d[0]]
        tokens, wall, client_cpu = sum(d[1] for d in done), max(d[2] for d in done) - t0, sum(d[3] for d in done)
    cpu = {k: round(v - cpu0.get(k, 0.0), 2) for k, v in cpu_seconds(pids or {}).items()}
    if client_cpu is not None:
        cpu["client"] = round(client_cpu, 2)
    return dict(round_row("gateway", m, latencies, tokens, wall), cpu_s=cpu,
                gateway_cpu_ms_per_call=round(1e3 * cpu.get("gateway", 0.0) / max(1, len(latencies)), 3),
                call_ms=phase_ms(phases0, call_phases(url), latencies))


def engine_round(m: dict[str, Any]) -> dict[str, Any]:
    """The same sessions on the engine in this process, each turn's requests submitted together."""
    import torch

    from e2e import compose
    from gateway.sessions import PLAIN_TEMPLATE
    from rlhf_core.models import load_policy, load_tokenizer
    from rlhf_core.turns import encode
    from rollout_workers.engine import GenRequest, SamplingParams
    from rollout_workers.hf_engine import HFEngine

    torch.set_num_threads(1)
    cfg = compose([f"model.cache_dir={m['cache_dir']}", *model_overrides(m)]).model  # the model the run's worker loads
    tok = load_tokenizer(cfg)
    tok.chat_template = PLAIN_TEMPLATE
    engine = HFEngine(load_policy(cfg), tok, slots=m["slots"], max_model_len=64 + episode_tokens(m))
    params = SamplingParams(max_new_tokens=m["max_tokens"])
    contexts = [encode(tok, tok.apply_chat_template([{"role": "user", "content": f"count from {i % 10}"}], tokenize=False,
                                                    add_generation_prompt=True)) for i in range(m["sessions"])]
    for i in range(m["sessions"]):  # warm-up, as the gateway side's: every graph bucket, the prefill shapes
        engine.add(GenRequest(f"warm/{i}", contexts[i], SamplingParams(max_new_tokens=warm_tokens(m, i), ignore_eos=True)))
    while engine.has_work():
        engine.step()
    steps0, prefills0, reused0 = engine.num_steps, engine.num_prefills, engine.num_reused_tokens
    between = encode(tok, f" [user] {user_message(m)} [assistant] ")
    tokens = 0
    latencies: list[float] = []
    started: dict[str, float] = {}
    t0 = time.perf_counter()

    def add(turn: int, i: int) -> None:
        started[f"{turn}/{i}"] = time.perf_counter()
        engine.add(GenRequest(f"{turn}/{i}", contexts[i], params))

    for i in range(m["sessions"]):
        add(0, i)
    while engine.has_work():
        for r in engine.step():  # a session's next turn starts as soon as its reply is in (as an agent does)
            turn, i = map(int, r.request_id.split("/"))
            latencies.append(time.perf_counter() - started.pop(r.request_id))
            tokens += r.num_tokens
            contexts[i] = contexts[i] + r.token_ids.tolist() + ([tok.eos_token_id] if r.finish_reason != "stop" else []) \
                + between
            if turn + 1 < m["turns"]:
                add(turn + 1, i)
    wall = time.perf_counter() - t0
    row = round_row("engine", m, latencies, tokens, wall)
    return add_passes(row, engine.num_steps - steps0, engine.num_prefills - prefills0, engine.num_reused_tokens - reused0)


def main() -> None:
    ap = mode_parser(__doc__, MODES)
    ap.add_argument("--cache-dir", default=os.environ.get("RLHF_TEST_CACHE") or "/tmp/rlhf-bench-cache")
    ap.add_argument("--sessions", type=int, help="concurrent sessions (the mode's by default)")
    ap.add_argument("--turns", type=int, help="turns per session (4 by default; one agent's many turns show its latency)")
    ap.add_argument("--slots", type=int, help="the worker's (and the engine's) slots (64 by default)")
    ap.add_argument("--turn-tokens", type=int, nargs="+", help="max_tokens per turn, one setting each (16 128)")
    ap.add_argument("--user-chars", type=int, help="characters (tiny model: tokens) the agent adds after each reply "
                    "(the mode's: a short user message; --long 64)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny", help="the model of both sides (see above); --gpu and --gpu-check run the Qwen2 shape instead")
    ap.add_argument("--clients", type=int,
                    help="processes the sessions are split over (the mode's: 1, all on one async client here; --gpu 8)")
    args = ap.parse_args()
    # --shape picks the tiny builder's settings; a Qwen2-shaped mode's model is that shape instead
    m = dict(MODES[args.mode], cache_dir=args.cache_dir, shape=None if MODES[args.mode].get("qwen2") is not None else args.shape)
    require_device(m.get("device", "cpu"))
    if args.sessions:
        m["sessions"] = args.sessions
    if args.clients:
        m["clients"] = args.clients
    if args.turns:
        m["turns"] = args.turns
    if args.slots:
        m["slots"] = args.slots
    if args.turn_tokens:
        m["turn_tokens"] = tuple(args.turn_tokens)
    if args.user_chars:
        m["user_chars"] = args.user_chars
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        proc, url = start_run(m, out)
        try:
            with contextlib.ExitStack() as stack:
                asyncio.run(wait_healthy(url))
                model = json.loads((out / "gateway.json").read_text())["model"]
                pool = None if m["clients"] == 1 else stack.enter_context(
                    ProcessPoolExecutor(m["clients"], mp_context=multiprocessing.get_context("spawn")))
                gateway_round(url, model, dict(m, turns=1, max_tokens=None), "warmup", pool=pool)
                pids = json.loads((out / "children.json").read_text())
                worker = stack.enter_context(contextlib.closing(WorkerPasses(out)))
                before = worker.read()
                for r in range(m["rounds"]):  # alternating, the best of each side
                    for n in m["turn_tokens"]:
                        row = gateway_round(url, model, dict(m, max_tokens=n), f"r{r}-{n}", pids, pool)
                        after = worker.read()
                        rows.append(add_passes(row, *(a - b for a, b in zip(after, before))))
                        before = after
                        rows.append(engine_round(dict(m, max_tokens=n)))  # the run's processes idle meanwhile
        finally:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    ratios, best = {}, {}
    for n in m["turn_tokens"]:
        best[n] = {side: max((r for r in rows if r["side"] == side and r["turn_tokens"] == n), key=lambda r: r["tokens_per_s"])
                   for side in ("gateway", "engine")}
        ratios[n] = best[n]["gateway"]["tokens_per_s"] / best[n]["engine"]["tokens_per_s"]
    where = "a Qwen2-0.5B-shaped model on " + m["device"] if m.get("qwen2") is not None else m["shape"] + " model on the CPU"
    print_table(rows, f"{m['sessions']} concurrent sessions x {m['turns']} turns, {m['slots']} slots, {where}, "
                      f"a session up to {episode_tokens(m)} tokens")
    bounds: dict[int, float] = {}  # what the agents' own CPU leaves of the ratio
    for n, ratio in ratios.items():
        g, e = best[n]["gateway"], best[n]["engine"]
        print(f"{n} tokens per turn: gateway tokens/s / engine tokens/s = {ratio:.3f} (target >= {TARGET}); "
              f"ms per decoding step {g['ms_per_step']:.1f} / {e['ms_per_step']:.1f}, prefill passes per step "
              f"{g['prefills_per_step']:.2f} / {e['prefills_per_step']:.2f} (gateway / engine); a gateway call's "
              f"mean ms: " + ", ".join(f"{k} {v:.1f}" for k, v in g["call_ms"].items())
              + f"; the gateway's CPU a call {g['gateway_cpu_ms_per_call']:.2f} ms")
        # A client process's CPU is a floor of the gateway round's wall time: the agents alone may
        # cost more than the engine side's whole round (the tiny model on the CPU)
        per_client = g["cpu_s"].get("client", 0.0) / (m.get("clients") or 1)
        if per_client > 0:
            bounds[n] = min(1.0, e["wall_s"] / per_client)
            print(f"  the agents' CPU a client process {per_client:.2f} s against the engine side's whole round "
                  f"{e['wall_s']:.2f} s: with these agents the ratio is at most about {bounds[n]:.2f}")
    name = "gateway" + ("" if args.mode == "quick" else "_" + args.mode.replace("-", "_")) \
        + ("" if m["shape"] in ("tiny", None) else f"_{m['shape']}")
    write_results(name,
                  {"mode": args.mode, "config": m, "rows": rows, "ratio_gateway_over_engine": ratios, "target": TARGET,
                   "ratio_bound_by_agents_cpu": bounds, "met": {n: r >= TARGET for n, r in ratios.items()}})


if __name__ == "__main__":
    main()
