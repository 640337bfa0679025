"""``rlhf-plan``: profile the stages, simulate a run, search for the fastest plan.

    rlhf-plan profile --out p.json [overrides...]          # calibrate on this machine (~1 min)
    rlhf-plan profile --from-run outputs/<date>/<time> --out p.json
    rlhf-plan profile --published 7b-h100 --out p7b.json   # a 7B shape from published figures
    rlhf-plan simulate --profile p.json [overrides...]     # predicted throughput, staleness, idle time
    rlhf-plan search --profile p.json [--max-staleness 4] [--gpus 64 --nodes 8]
                                                           # the best plans, with the rlhf-run overrides
                                                           # (local launcher, and launcher=ray)

Overrides are ``rlhf-run``'s Hydra settings (``rollout.num_workers=1 algo.max_staleness=4``);
the profile's own setup (the overrides it was measured with) comes first.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

from rlhf_core.errors import UserError

log = logging.getLogger("rlhf_run.plan")


def compose(overrides: Sequence[str]) -> Any:
    """The run's config, as ``rlhf-run`` would build it from these overrides."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from rlhf_core.config import Config, register_configs, to_object

    register_configs()
    try:
        with initialize_config_module(config_module="conf", version_base="1.3"):
            cfg = to_object(hydra_compose(config_name="config", overrides=list(overrides)))
    except (HydraException, OmegaConfBaseException, ValueError) as exc:
        raise UserError(f"the overrides {' '.join(overrides) or '(none)'} do not make a run config: {exc}") from None
    assert isinstance(cfg, Config)
    return cfg


def _setup(args: argparse.Namespace) -> tuple[Any, list[str], Any]:
    """``--profile``, the overrides of the run asked about (the profile's own setup first) and its
    plan; the run refused as rlhf-run refuses it (``validate``), or when the profile is another's."""
    from rlhf_core.config import validate
    from rlhf_run.plan.profile import check_identity, load
    from rlhf_run.plan.search import plan_from_config

    profile = load(args.profile)
    given = list(profile.source.get("overrides") or []) + list(args.overrides)
    cfg = compose(given)
    validate(cfg)
    check_identity(profile, cfg, args.profile)
    return profile, given, plan_from_config(cfg)


def _validated(overrides: list[str]) -> None:
    """Refuse to print a plan whose ``rlhf-run`` command would stop at its start-up checks."""
    from rlhf_core.config import ConfigError, validate
    from rlhf_run.plan.search import PlanError

    try:
        validate(compose(overrides))
    except ConfigError as exc:
        raise PlanError(f"the search found a plan that rlhf-run would refuse ({exc}); its overrides: "
                        f"{' '.join(overrides)}. That is a bug of rlhf-plan: please report it") from None


# ---- commands ----------------------------------------------------------------------------------


def cmd_profile(args: argparse.Namespace) -> int:
    if args.published:
        from rlhf_run.plan.scale import published_7b

        profile = published_7b(args.transport)
        profile.source["overrides"] = list(PUBLISHED_OVERRIDES) + list(args.overrides)
    elif args.from_run:
        from rlhf_run.plan.fromrun import profile_from_run

        profile = profile_from_run(args.from_run)
    else:
        from rlhf_run.plan.measure import calibrate

        cfg = compose(args.overrides)
        from rlhf_core.config import validate
        from rlhf_run.plan.search import plan_from_config

        validate(cfg)
        plan_from_config(cfg)  # what the simulator cannot model is refused before the minute of measuring
        print(f"calibrating {cfg.model.name} / {cfg.rollout.engine} / {cfg.learner.engine} on this machine "
              "(about a minute: every stage alone, then three short runs of this config to fit how much the processes "
              "slow each other)...", flush=True)
        profile = calibrate(cfg, prompts=args.prompts, quick=args.quick)
        profile.source["overrides"] = list(args.overrides)
    path = profile.save(args.out)
    g, lc, s = profile.generation, profile.learner, profile.sync
    print(f"wrote {path} ({profile.kind} profile of {profile.identity.get('model')})")
    print(f"  decode step {1e3 * g.decode_s(1, 0):.2f} ms + {1e3 * g.decode_per_row:.3f} ms/row; response tokens "
          f"mean {g.response_tokens.mean():.1f}; learner update (batch 32) "
          f"{1e3 * lc.update_s(32, 32 * (g.prompt_tokens.mean() + g.response_tokens.mean()), 32):.1f} ms; "
          f"publish {1e3 * s.send_s():.1f} ms, pull {1e3 * s.pull_s():.1f} ms; contention {profile.machine.contention:.2f}; "
          f"hand-off {1e3 * profile.machine.handoff_s:.2f} ms, +{1e3 * profile.machine.handoff_busy_s:.2f} ms per thread "
          "beyond the cores")
    return 0


PUBLISHED_OVERRIDES = ("model=hf", "model.path=published:qwen2.5-7b-shape", "model.device=cuda", "rollout=vllm",
                       "learner=deepspeed", "algo.group_size=8", "learner.batch_size=512", "learner.micro_batch_size=1",
                       "rollout.max_new_tokens=4096", "rollout.max_prompt_tokens=256", "learner.checkpoint_every=50",
                       "reward.batch_size=64")


def _lookahead_given(overrides: Sequence[str]) -> bool:
    return any(o.lstrip("+").startswith("buffer.lookahead=") for o in overrides)


def cmd_simulate(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from rlhf_run.plan.search import PlanError, Request, check_plan, check_request
    from rlhf_run.plan.simulate import simulate

    profile, given, plan = _setup(args)
    request = Request(base=plan, gpus=args.gpus, nodes=args.nodes, max_staleness=plan.max_staleness,
                      max_workers=max(plan.workers, 1), lookahead_fixed=_lookahead_given(given))
    check_request(request, profile)
    if plan.lookahead is not None and plan.lookahead > plan.max_staleness:  # the buffer caps it (buffer/pacing.py)
        plan = replace(plan, lookahead=plan.max_staleness)
    problems = check_plan(plan, request, profile)
    if problems:
        raise PlanError("this plan cannot run: " + "; ".join(problems))
    result = simulate(profile, plan, updates=args.updates, warmup=args.warmup, seed=args.seed, background=args.background)
    if args.json:
        print(json.dumps({"plan": plan.__dict__, "result": result.to_dict()}, indent=2))
        return 0
    r = result
    print(f"plan: {plan.workers} worker(s) x {plan.slots} slots, batch {plan.batch_size} (micro {plan.micro_batch_size}), "
          f"max_staleness {plan.max_staleness}, lookahead {plan.lookahead}"
          + (f", {plan.learner_devices} learner GPU(s), ZeRO-{plan.zero_stage}" if profile.kind == "gpu" else ""))
    print(f"  trained {r.trained_samples_per_s:.1f} samples/s (generated {r.generated_samples_per_s:.1f}) over "
          f"{r.window_s:.1f} simulated s ({r.updates} updates)")
    print(f"  staleness mean {r.staleness_mean:.2f}, histogram {r.staleness_hist}; dropped {r.samples_dropped}")
    print(f"  learner idle {100 * r.learner_idle_frac:.0f}%, buffer depth {r.buffer_depth_mean:.1f} samples")
    if r.cpu_per_update_ms and profile.kind == "cpu":
        print("  CPU per update (core-ms): " + ", ".join(f"{k} {v:.1f}" for k, v in r.cpu_per_update_ms.items()))
    return 0


def cmd_search(args: argparse.Namespace) -> int:
    from rlhf_run.plan.search import Request, overrides, ray_overrides, search, spans_nodes

    profile, given, plan = _setup(args)
    bound = plan.max_staleness if args.max_staleness is None else args.max_staleness
    batches = tuple(int(b) for b in args.batch_sizes.split(",")) if args.batch_sizes else ()
    request = Request(base=plan, gpus=args.gpus, nodes=args.nodes, max_staleness=bound, max_workers=args.max_workers,
                      batch_sizes=batches, lookahead_fixed=_lookahead_given(given))
    stats: dict[str, Any] = {}
    ranked = search(request, profile, top=args.top, updates=args.updates, seed=args.seed,
                    simulate_at_most=args.max_simulations, stats=stats)
    gpu = profile.kind == "gpu"

    def commands(plan: Any) -> tuple[list[str] | None, list[str]]:
        """The plan's overrides for the local launcher (None: it spans nodes, which only Ray runs)
        and for launcher=ray; each command printed passes the run's own start-up checks."""
        local = overrides(plan, gpu)  # the device lists are the local launcher's alone
        ray = [o for o in local if not o.startswith(("learner.devices=", "rollout.devices="))] + ray_overrides(
            plan, gpu, profile.machine.gpus_per_node)
        local_cmd = None if spans_nodes(plan, request) else local
        for cmd in (local_cmd, ray):
            if cmd is not None:
                _validated(given + cmd)
        return local_cmd, ray

    shown = [(r, *commands(r.plan)) for r in ranked]
    if gpu and not stats["exact"]:
        log.warning("the search stopped after %d simulations (--max-simulations) of %d plans: a plan not simulated "
                    "could still be up to %.0f%% faster than the #%d by its bound", stats["simulated"],
                    stats["candidates"], 100 * stats["gap"], min(args.top, len(ranked)))
    if args.json:  # overrides: the local launcher's, null for a plan over several nodes
        print(json.dumps([{"plan": r.plan.__dict__, "result": r.result.to_dict(), "overrides": local,
                           "ray_overrides": ray_overrides(r.plan, gpu, profile.machine.gpus_per_node)}
                          for r, local, _ in shown], indent=2))
        return 0
    head = ["#", "workers", "slots", "batch", "micro", *(["learner GPUs", "ZeRO"] if gpu else []), "staleness", "lookahead",
            "samples/s", "stale mean", "learner idle"]
    rows = [[str(i + 1), str(r.plan.workers), str(r.plan.slots), str(r.plan.batch_size), str(r.plan.micro_batch_size),
             *([str(r.plan.learner_devices), str(r.plan.zero_stage)] if gpu else []), str(r.plan.max_staleness),
             str(r.plan.lookahead), f"{r.result.trained_samples_per_s:.1f}", f"{r.result.staleness_mean:.2f}",
             f"{100 * r.result.learner_idle_frac:.0f}%"] for i, r in enumerate(ranked)]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    print("  ".join(h.ljust(w) for h, w in zip(head, widths)))
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))
    best, local, ray = shown[0]
    if local is not None:
        print(f"\nrun the best plan:\n  rlhf-run {' '.join(given + local)}")
        print(f"on a Ray cluster:\n  rlhf-run {' '.join(given + ray)}")
    else:
        print(f"\nthe best plan needs {best.plan.workers + best.plan.learner_devices} GPUs, more than a node's "
              f"{args.gpus // args.nodes}: run it on a Ray cluster:\n  rlhf-run {' '.join(given + ray)}")
    return 0


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="rlhf-plan", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("profile", help="measure the stage costs (or read a run, or published figures) into a profile")
    p.add_argument("--out", default="profile.json", help="where to write the profile (default profile.json)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--from-run", metavar="DIR", help="fit the costs from a finished run's folder instead (coarser)")
    src.add_argument("--published", choices=["7b-h100"], help="a 7B-shaped model on H100s from published figures")
    p.add_argument("--transport", choices=["weight_server", "nccl"], default="weight_server",
                   help="--published: weight sync through this service's weight server, or an NCCL broadcast (what-if)")
    p.add_argument("--prompts", type=int, default=160, help="prompts the worker generates alone (default 160)")
    p.add_argument("--quick", action="store_true", help="fewer repetitions (about half the time)")
    p.add_argument("overrides", nargs="*", help="rlhf-run overrides describing the model and engines to profile")
    p.set_defaults(fn=cmd_profile)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--profile", required=True, help="a profile written by `rlhf-plan profile`")
    common.add_argument("--gpus", type=int, help="GPUs available (GPU profiles: one process per GPU)")
    common.add_argument("--nodes", type=int, default=1, help="nodes the GPUs are spread over (default 1)")
    common.add_argument("--updates", type=int, default=300, help="learner updates to simulate (default 300)")
    common.add_argument("--seed", type=int, default=0, help="seed of the simulated response lengths")
    common.add_argument("--json", action="store_true", help="print JSON")
    common.add_argument("overrides", nargs="*", help="rlhf-run overrides (the run to simulate, or the search's base)")
    s = sub.add_parser("simulate", parents=[common], help="predict one run's throughput, staleness and idle time")
    s.add_argument("--warmup", type=int, default=20, help="updates left out of the rates (default 20)")
    s.add_argument("--background", type=float, help="CPU profiles: cores other jobs keep busy (default: the profile's)")
    s.set_defaults(fn=cmd_simulate)
    q = sub.add_parser("search", parents=[common], help="the fastest feasible plans, with the overrides to run them")
    q.add_argument("--max-staleness", type=int, help="the largest algo.max_staleness to consider (default: the config's)")
    q.add_argument("--max-workers", type=int, default=3, help="CPU profiles: the most workers to consider (default 3)")
    q.add_argument("--batch-sizes", help="comma-separated learner.batch_size values to consider (default: the config's "
                                         "only; the batch changes the algorithm, not just the speed)")
    q.add_argument("--top", type=int, default=5, help="plans to print (default 5)")
    q.add_argument("--max-simulations", type=int, default=24,
                   help="GPU profiles: stop the branch and bound after this many simulations (default 24; it "
                        "says when plans it could not rule out were left)")
    q.set_defaults(fn=cmd_search, updates=200)
    return ap


def main(argv: Sequence[str] | None = None) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from rlhf_core.cli import quiet_libraries

    quiet_libraries()
    args = parser().parse_args(argv)
    try:
        code = args.fn(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    sys.exit(code)


if __name__ == "__main__":
    main()
