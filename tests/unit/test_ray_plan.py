"""What `rlhf-run launcher=ray` asks of a cluster, checked without one: each actor's demand, the
refusal (naming the resource) of a placement the nodes cannot hold, the learner's bundles, the
torch.distributed environment of its ranks, and the config as plain data. Ray is not needed."""

from __future__ import annotations

import pytest

from rlhf_core.cli import WORKER_ID_ENV
from rlhf_core.config import Config, ConfigError, validate
from rlhf_run import ray_plan as plan


def config(**settings) -> Config:
    """``ray__worker__num_gpus=0.5`` sets cfg.ray.worker.num_gpus."""
    cfg = Config()
    for key, value in settings.items():
        *path, name = key.split("__")
        node = cfg
        for part in path:
            node = getattr(node, part)
        setattr(node, name, value)
    validate(cfg)
    return cfg


def node(cpus: float, gpus: float = 0, labels: dict | None = None, alive: bool = True, **custom: float) -> dict:
    """A node as ray.nodes() describes it."""
    resources = {"CPU": cpus, "memory": 8e9, **({"GPU": gpus} if gpus else {}), **custom}
    return {"Alive": alive, "Resources": resources, "Labels": labels or {}}


def test_every_actor_of_the_run_is_a_demand():
    cfg = config(rollout__num_workers=3, eval__every=10, ray__learner__ranks=2, learner__engine="deepspeed",
                 ray__worker__num_gpus=0.5, ray__learner__num_gpus=1.0)
    wanted = {d.name: d.resources for d in plan.demands(cfg)}
    assert list(wanted) == ["redis", "weight_server", "learner rank 0", "learner rank 1", "worker-0", "worker-1",
                            "worker-2", "evaluator"]
    assert wanted["redis"] == wanted["weight_server"] == {}  # 0 CPUs by default: they mostly wait
    assert wanted["learner rank 1"] == {"CPU": 1.0, "GPU": 1.0}
    assert wanted["worker-2"] == {"CPU": 1.0, "GPU": 0.5}  # two workers share a GPU
    cfg.buffer.url = "redis://elsewhere:6379/0"  # an external Redis: no actor for it
    assert [d.name for d in plan.demands(cfg, workers=1)][:2] == ["weight_server", "learner rank 0"]


def test_a_cluster_that_holds_the_run_passes():
    cfg = config(rollout__num_workers=2, ray__worker__num_gpus=0.5)
    plan.check_fits(plan.demands(cfg), [node(2, gpus=1), node(1)], "head:6379")


@pytest.mark.parametrize("settings, nodes, message", [
    # 2 workers x 1 GPU, and no GPU anywhere
    (dict(ray__worker__num_gpus=1.0), [node(8)],
     "the run asks for 2 GPU in all (worker-0 1, worker-1 1) but the Ray cluster at head:6379 has 0 GPU on 1 alive node(s)"),
    # 3 CPUs asked, 2 in the cluster (a dead node's do not count)
    (dict(), [node(2), node(8, alive=False)], "the run asks for 3 CPU in all (learner rank 0 1, worker-0 1, worker-1 1)"),
    # enough GPUs in all, but the learner wants 2 on one node
    (dict(ray__learner__num_gpus=2.0), [node(4, gpus=1), node(4, gpus=1)],
     "no node of the Ray cluster at head:6379 can hold learner rank 0 (CPU 1, GPU 2): the largest node has CPU 4, GPU 1"),
    # a custom resource no node has
    (dict(ray__worker__resources={"rollout": 1.0}), [node(8)], "the run asks for 2 rollout in all"),
    # a node label no node carries
    (dict(ray__worker__label_selector={"accelerator": "H100"}), [node(8, labels={"accelerator": "A10"})],
     "can hold worker-0 (CPU 1 on a node labelled {'accelerator': 'H100'}): the largest node has CPU 8 (and no node "
     "has those labels)"),
])
def test_a_placement_the_cluster_cannot_hold_is_refused_naming_the_resource(settings, nodes, message):
    with pytest.raises(ConfigError) as err:
        plan.check_fits(plan.demands(config(**settings)), nodes, "head:6379")
    assert message in str(err.value)


@pytest.mark.parametrize("selector, fits", [
    ("a10", True), ("in(a10, h100)", True), ("!spot", True), ("!in(spot,preemptible)", True),
    ("h100", False), ("in(h100,b200)", False), ("!a10", False), ("!in(a10)", False),
])
def test_label_selectors_match_as_ray_matches_them(selector, fits):
    # Ray's label selector values: a value, !value, in(a, b), !in(a, b) (checked against Ray 2.60:
    # a node without the label matches !value and !in(...)); a selector Ray would place must not
    # be refused before the run starts
    cfg = config(ray__worker__label_selector={"gpu": selector, "region": "!eu"})
    nodes = [node(8, labels={"gpu": "a10"})]
    if fits:
        plan.check_fits(plan.demands(cfg), nodes, "head:6379")
    else:
        with pytest.raises(ConfigError, match="no node of the Ray cluster at head:6379 can hold worker-0"):
            plan.check_fits(plan.demands(cfg), nodes, "head:6379")


@pytest.mark.parametrize("settings, head, message", [
    # docs/cluster.md's "a GPU learner on the head", run from a head without a GPU (a GPU elsewhere)
    (dict(ray__learner__num_gpus=1.0), node(4), "learner rank 0 (CPU 1, GPU 1) runs on the node running rlhf-run "
     "(ray.learner.on_driver_node), which has CPU 4, GPU 0"),
    # a head started with --num-cpus=0 (Ray's advice for a head that only coordinates)
    (dict(), node(0), "learner rank 0 (CPU 1) runs on the node running rlhf-run (ray.learner.on_driver_node), which "
     "has CPU 0"),
    # what runs there together: rank 0 and the weight server
    (dict(ray__weight_server__num_cpus=2.0), node(2),
     "weight_server, learner rank 0 (CPU 3) runs on the node running rlhf-run (ray.learner.on_driver_node), which has CPU 2"),
    # rank 0's labels are asked of that node too
    (dict(ray__learner__label_selector={"disk": "nvme"}), node(4),
     "learner rank 0 (CPU 1 on a node labelled {'disk': 'nvme'}) runs on the node running rlhf-run "
     "(ray.learner.on_driver_node), which has CPU 4 and disk=(unset)"),
])
def test_what_runs_on_the_driver_node_must_fit_there(settings, head, message):
    # rank 0 (by default), the weight server and a private Redis are pinned to the node running
    # rlhf-run: another node having the room does not help (the placement group waited
    # ray.placement_timeout_s, then blamed "other jobs")
    cfg = config(**settings)
    nodes = [dict(head, NodeID="head"), dict(node(8, gpus=2, labels={"disk": "nvme"}), NodeID="other")]
    with pytest.raises(ConfigError) as err:
        plan.check_fits(plan.demands(cfg), nodes, "head:6379", driver_node="head")
    assert message in str(err.value) and "or ray.learner.on_driver_node=false" in str(err.value)
    cfg.ray.learner.on_driver_node = False  # rank 0 goes where it fits
    plan.check_fits(plan.demands(cfg), nodes, "head:6379", driver_node="head")


def test_strict_spread_ranks_need_as_many_nodes():
    cfg = config(ray__learner__ranks=3, learner__engine="deepspeed", ray__learner__strategy="STRICT_SPREAD",
                 rollout__num_workers=0)
    with pytest.raises(ConfigError, match="each of the 3 learner ranks on its own node, but the Ray cluster at h:1 has 2"):
        plan.check_fits(plan.demands(cfg), [node(4), node(4)], "h:1", spread_ranks=3)


def test_rank_0s_bundle_is_pinned_to_the_driver_node_unless_told_otherwise():
    cfg = config(ray__learner__ranks=2, learner__engine="deepspeed", ray__learner__num_gpus=1.0,
                 ray__learner__label_selector={"zone": "a"})
    bundles, selectors = plan.learner_bundles(cfg, "driver-node-id")
    assert bundles == [{"CPU": 1.0, "GPU": 1.0}] * 2
    assert selectors == [{"zone": "a", plan.NODE_ID_LABEL: "driver-node-id"}, {"zone": "a"}]
    cfg.ray.learner.on_driver_node = False
    assert plan.learner_bundles(cfg, "driver-node-id")[1] == [{"zone": "a"}] * 2


def test_ranks_get_the_rendezvous_of_rank_0s_node_and_their_local_gpus_in_rank_order():
    # ranks 0 and 2 on node a (GPUs 3 and 1 from Ray), rank 1 on node b (GPU 0)
    envs = plan.rank_envs([("10.0.0.1", ["3"]), ("10.0.0.2", ["0"]), ("10.0.0.1", ["1"])], master_port=29500)
    assert [e["RANK"] for e in envs] == ["0", "1", "2"] and {e["WORLD_SIZE"] for e in envs} == {"3"}
    assert {(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs} == {("10.0.0.1", "29500")}
    assert [(e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"]) for e in envs] == [("0", "2"), ("0", "1"), ("1", "2")]
    # set_device(LOCAL_RANK) picks the rank's own GPU among its node's learner GPUs
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["3,1", "0", "3,1"]
    cpu = plan.rank_envs([("127.0.0.1", []), ("127.0.0.1", [])], master_port=1)
    assert [e["LOCAL_RANK"] for e in cpu] == ["0", "1"] and all("CUDA_VISIBLE_DEVICES" not in e for e in cpu)


def test_a_roles_options_and_environment(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cfg = config(ray__worker__num_cpus=2.0, ray__worker__resources={"rollout": 1.0},
                 ray__worker__label_selector={"zone": "a"})
    opts = plan.actor_options(cfg.ray.worker)
    assert opts == {"num_cpus": 2.0, "num_gpus": 0.0, "max_restarts": 5, "resources": {"rollout": 1.0},
                    "label_selector": {"zone": "a"}}
    assert "label_selector" not in plan.actor_options(cfg.ray.worker, labels=False)  # a bundle's selector rules
    env = plan.role_env(cfg.ray.worker, "worker-3")
    assert env["OMP_NUM_THREADS"] == "2" and env[WORKER_ID_ENV] == "worker-3"  # torch threads = the role's CPUs
    assert env["RAY_worker_niceness"] == "0"  # not Ray's default 15: the roles are the job
    assert plan.role_env(cfg.ray.weight_server)["OMP_NUM_THREADS"] == "1"
    monkeypatch.setenv("OMP_NUM_THREADS", "4")  # set by the user: every role keeps it
    assert plan.role_env(cfg.ray.worker)["OMP_NUM_THREADS"] == "4"


def test_the_config_travels_as_plain_data_and_comes_back_typed():
    cfg = config(launcher="ray", ray__worker__resources={"rollout": 1.0}, rollout__num_workers=5)
    data = plan.plain_config(cfg)
    assert isinstance(data, dict) and type(data["ray"]["worker"]["resources"]) is dict
    back = plan.config_from_plain(data)
    assert isinstance(back, Config) and back == cfg


@pytest.mark.parametrize("settings, message", [
    (dict(ray__learner__ranks=2), "ray.learner.ranks=2 runs the learner as 2 ranks, which needs learner.engine=deepspeed"),
    (dict(ray__worker__num_gpus=1.5), "ray.worker.num_gpus=1.5: a fraction of a GPU must be below 1"),
    (dict(ray__worker__num_cpus=-1.0), "ray.worker: num_cpus, num_gpus and resources must be >= 0"),
    (dict(ray__learner__num_cpus=0.0), "ray.learner asks for nothing"),
    (dict(ray__object_store_mb=10), "ray.object_store_mb >= 75"),
])
def test_bad_ray_settings_are_refused_at_start_up(settings, message):
    with pytest.raises(ConfigError) as err:
        config(**settings)
    assert message in str(err.value)


def test_no_cluster_at_the_address_is_refused_at_once(monkeypatch):
    from buffer.local_server import free_port
    from rlhf_run.ray_cluster import probe

    port = free_port()  # nothing listens there
    with pytest.raises(ConfigError, match=f"ray.address=127.0.0.1:{port}: no Ray cluster answers there"):
        probe(f"127.0.0.1:{port}", 5.0)
    with pytest.raises(ConfigError, match="must be HOST:PORT"):
        probe("head-node", 5.0)
    with pytest.raises(ConfigError, match="Ray Client addresses are not supported"):
        probe("ray://head:10001", 5.0)


def test_a_local_ray_instance_of_a_fractional_cpu_count_is_refused_in_one_line(monkeypatch):
    # Ray refuses ray.init(num_cpus=1.5) with a ValueError (whole numbers only): a traceback once
    pytest.importorskip("ray")
    from rlhf_run.ray_cluster import connect

    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # what connect() sets for a local instance
    with pytest.raises(ConfigError, match=r"^ray.num_cpus=1.5: a local Ray instance has a whole number of CPUs"):
        connect(config(ray__num_cpus=1.5))


def test_ranks_that_died_in_the_same_poll_restart_the_learner_once(tmp_path):
    # Both ranks' calls end between two polls: the first restarts the learner (every rank
    # anew); the second belongs to a rank that restart already replaced, so it must not count
    # as a second crash (that restarted again, or ended the run once the restarts were used up)
    from rlhf_run.ray_backend import Actor, RayBackend
    from rlhf_run.supervisor import Role, RoleKind, Supervisor

    class Ray:  # Ray's answers for two finished calls: both ranks exited with code 1
        def wait(self, refs, num_returns, timeout):
            return refs, []

        def get(self, ref):
            return {"code": 1, "error": "rank died"}

    def ranks(ref):
        return [Actor(f"learner-{r}", tmp_path / "l.log", {}, rank=r, run_ref=f"{ref}{r}") for r in (0, 1)]

    cfg = Config()
    cfg.run.learner_restarts = 1
    backend = RayBackend(cfg, tmp_path, ray=Ray())
    learner = Role("learner", RoleKind.LEARNER, tmp_path / "l.log", handle=ranks("ref"))
    supervisor = Supervisor(cfg, tmp_path, backend, roles=[learner])
    backend.infrastructure_lost, backend.tail, backend.write_pids = lambda: "", lambda ended: "", lambda roles: None
    restarts = []

    def restart_learner(role):  # what it does to the actors: every rank replaced by a new one, running
        restarts.append(1)
        role.handle = ranks("new")

    backend.restart_learner = restart_learner
    assert supervisor.supervise_once() is True
    assert restarts == [1] and learner.restarts == 1


def test_the_redis_restart_hint_keeps_the_password_out_of_the_log(tmp_path, caplog):
    # Redis of a launcher=ray run has a password, which the run prints redacted (it is in
    # run_config.yaml, readable by its owner only); the hint for a Redis unreachable 10 s
    # logged it whole, to the console and the run's log, inside the restart command
    import time
    from types import SimpleNamespace

    from rlhf_run.ray_backend import RayBackend
    from rlhf_run.ray_cluster import ActorHandle
    from rlhf_run.supervisor import Supervisor

    cfg = Config(launcher="ray")
    backend = RayBackend(cfg, tmp_path)
    backend.redis = ActorHandle(None, None, {"url": "redis://:pw-Secret_123@10.0.0.5:6379/0", "restart_command":
                                             "redis-server --port 6379 --dir /out/redis --requirepass pw-Secret_123"})
    Supervisor(cfg, tmp_path, backend).check_progress(SimpleNamespace(error=None, unreachable_since=time.time() - 60,
                                                                     latest=None))
    assert "restart it on the same data with:\n  redis-server --port 6379 --dir /out/redis --requirepass " in caplog.text
    assert "pw-Secret_123" not in caplog.text and "buffer.url in run_config.yaml" in caplog.text


@pytest.mark.parametrize("settings, nodes, expected", [
    # two nodes a worker fits on: one worker each before a second on either
    (dict(), [node(4), node(4)], ("SPREAD", 2)),
    # the head has no `rollout`, and a dead node counts for nothing: one node to place them on
    (dict(ray__worker__resources={"rollout": 1.0}), [node(8), node(4, rollout=2), node(4, rollout=2, alive=False)],
     ("DEFAULT", 1)),
    # a label only one node carries
    (dict(ray__worker__label_selector={"pool": "gen"}), [node(4, labels={"pool": "gen"}), node(4)], ("DEFAULT", 1)),
    # a worker wanting a whole GPU fits on the GPU nodes only
    (dict(ray__worker__num_gpus=1.0), [node(8), node(8, gpus=2), node(8, gpus=1)], ("SPREAD", 2)),
    # Ray's own placement asked for
    (dict(ray__worker__strategy="DEFAULT"), [node(4), node(4)], ("DEFAULT", 2)),
])
def test_workers_are_spread_over_the_nodes_that_can_hold_one(settings, nodes, expected):
    assert plan.worker_strategy(config(**settings), nodes) == expected
