"""Group assembly: a claimed prompt's ``group_size`` responses, from the engine to the buffer.

Started from a lease (requests added to the engine, or episodes started); finished responses go to
the scoring threads a whole group at a time (:mod:`rollout_workers.samples`); once every
:class:`Outcome` is in, the group is completed in one atomic step (samples appended, dead letters
written, prompt acked; DAPO's ``algo.filter_groups`` may complete it as filtered). A prompt that
cannot be rendered or is too long is dead-lettered and acked with no samples.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field

from buffer import Lease
from rlhf_core.config import Config
from rlhf_core.dapo import group_filter
from rlhf_core.errors import FailureWindow, UserError
from rlhf_core.prometheus import GENERATION, SCORING, Exporter
from rlhf_core.records import Sample
from rollout_workers.engine import GenerationEngine, GenRequest, GenResult, RequestError, SamplingParams
from rollout_workers.episodes import Episode, EpisodeRunner
from rollout_workers.leases import LeaseKeeper
from rollout_workers.prompts import PromptRejected, PromptRenderer
from rollout_workers.rewards import EMPTY_DEAD_LETTER, is_empty_response, reward_failing
from rollout_workers.scoring import ScoringPool
from rollout_workers.stats import WorkerStats

log = logging.getLogger(__name__)

MAX_LOGGED_REASONS = 1024  # dead-letter reasons counted for rate-limited logging
_REASON_DETAILS = re.compile(r"'[^']*'|\d+")  # what differs between two reasons of one kind


class PromptsRejected(UserError):
    """Most recent prompts were rejected (too long for the context, unrenderable): the data or the
    limits are wrong, and the run would otherwise idle with nothing to train on."""


@dataclass(frozen=True)
class Outcome:
    """One response, scored: its sample, built once with its reward, or (``dead_letter``: why) the
    sample with reward NaN for the dead-letter stream."""

    sample: Sample
    dead_letter: str | None = None


@dataclass(frozen=True)
class DeadLetter:
    """An outcome that failed: its sample (reward NaN) and why."""

    reason: str
    sample: Sample


@dataclass(eq=False)  # hashed by identity: a prompt claimed again after a lost lease is another group
class Group:
    """One claimed prompt being generated: ``size`` requests ``{lease_id}/{i}``; finished
    responses wait in ``results`` until the group is whole, then their outcomes in ``outcomes``."""

    lease: Lease
    prompt_text: str
    prompt_ids: list[int]
    size: int
    created_at: float = field(default_factory=time.time)
    results: dict[int, GenResult | Episode] = field(default_factory=dict)  # an Episode with rollout.env
    outcomes: dict[int, Outcome] = field(default_factory=dict)
    group_id: str = field(init=False)

    def __post_init__(self) -> None:
        # deterministic (the lease id is the prompt's stream id): a re-delivered prompt gets the same one
        prompt = self.lease.prompt
        self.group_id = f"{prompt.prompt_id}:e{prompt.epoch}:{self.lease.lease_id}"

    def members(self) -> list[Member]:
        return [Member(self, i) for i in range(self.size)]

    def samples(self) -> list[Sample]:
        return [self.outcomes[i].sample for i in range(self.size) if self.outcomes[i].dead_letter is None]

    def dead_letters(self) -> list[DeadLetter]:
        return [DeadLetter(o.dead_letter, o.sample) for i in range(self.size)
                if (o := self.outcomes[i]).dead_letter is not None]


@dataclass(frozen=True)
class Member:
    """Response ``index`` of ``group``: what the scoring threads score, and the key of its outcome."""

    group: Group
    index: int

    @property
    def result(self) -> GenResult | Episode:
        return self.group.results[self.index]


class ReasonLog:
    """Dead letters logged at the first reason of each kind, then every 100th, so a failing reward
    cannot flood the log. A kind is the reason without its quoted names and numbers; the counts
    start again at MAX_LOGGED_REASONS kinds."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.seen: dict[str, int] = {}  # kind -> times seen

    def warn(self, what: str, prompt_id: str, reason: str) -> None:
        kind = _REASON_DETAILS.sub("#", reason[:200])
        if len(self.seen) >= MAX_LOGGED_REASONS:
            self.seen.clear()
        seen = self.seen[kind] = self.seen.get(kind, 0) + 1
        if seen == 1 or seen % 100 == 0:
            log.warning("worker %s: %s %s dead-lettered (%d time(s) for this reason): %s", self.worker_id, what,
                        prompt_id, seen, reason)


class GroupAssembly:
    """This worker's open groups by lease id (``len``, ``in``), from start to completion; see the
    module docstring. ``group_size`` is the run's, set once the worker has joined it."""

    def __init__(self, cfg: Config, worker_id: str, leases: LeaseKeeper, engine: GenerationEngine,
                 episodes: EpisodeRunner | None, renderer: PromptRenderer, sampling: SamplingParams,
                 scoring: ScoringPool[Member], stats: WorkerStats, exporter: Exporter | None) -> None:
        self.algo, self.worker_id, self.leases, self.engine, self.episodes = cfg.algo, worker_id, leases, engine, episodes
        self.renderer, self.sampling, self.scoring, self.stats, self.exporter = renderer, sampling, scoring, stats, exporter
        self.group_size = 0
        self.groups: dict[str, Group] = {}
        self.reasons = ReasonLog(worker_id)
        self.reward_failures = FailureWindow(cfg.reward.failure_window, cfg.reward.max_failure_share)
        self.prompt_rejections = FailureWindow(window=64, max_share=0.5, min_count=16)  # prompts too long, unrenderable

    def __len__(self) -> int:
        return len(self.groups)

    def __contains__(self, lease_id: str) -> bool:
        return lease_id in self.groups

    # ------------------------------------------------------------------ start

    def start(self, lease: Lease) -> None:
        """Start generating the group of a claimed prompt, or dead-letter the prompt."""
        prompt = lease.prompt
        held = self.groups.get(lease.lease_id)
        if held is not None:
            # its own lease, expired while this process was paused and claimed back: generation goes on
            # under the new delivery (adding its requests again would fail on their ids)
            log.info("worker %s: prompt %s came back to this worker, which still generates it (its lease expired "
                     "while the process was paused)", self.worker_id, prompt.prompt_id)
            held.lease = lease
            self.leases.keep(lease.lease_id)  # a heartbeat may have found the old delivery lost: this one is held
            return
        if self.episodes is not None:
            group = self.groups[lease.lease_id] = Group(lease, prompt.text, [], self.group_size)
            for i in range(self.group_size):
                self.episodes.start(f"{lease.lease_id}/{i}", prompt, tag=Member(group, i))
            return
        try:
            text, ids = self.renderer.render(prompt)
        except PromptRejected as exc:
            self._reject(lease, str(exc))
            return
        group = Group(lease, text, ids, self.group_size)
        added: list[str] = []
        try:
            for i in range(self.group_size):
                request_id = f"{lease.lease_id}/{i}"
                self.engine.add(GenRequest(request_id, ids, self.sampling))
                added.append(request_id)
        except RequestError as exc:  # e.g. longer than the model's context
            for request_id in added:
                self.engine.abort(request_id)
            self._reject(lease, str(exc))
            return
        self.groups[lease.lease_id] = group
        self.prompt_rejections.record(False)

    def _reject(self, lease: Lease, reason: str) -> None:
        self.reasons.warn("prompt", lease.prompt.prompt_id, reason)
        with self.leases.using() as buffer:
            # dead letter + ack with no samples (its admission budget goes back), in one atomic step
            buffer.complete(lease, [], rejected=[("prompt", reason, lease.prompt.encode())])
        self.stats.dead_letters += 1
        self.stats.prompts_empty += 1
        if self.prompt_rejections.record(True, reason):
            raise PromptsRejected(
                f"{self.prompt_rejections.failures} of the last {len(self.prompt_rejections.recent)} prompts were "
                f"rejected, the last because: {reason}. Fix the data or the limits (rollout.max_prompt_tokens, "
                "rollout.prompt_overflow=truncate, the model's context); no batch can form while most are rejected"
            )

    # ------------------------------------------------------------------ responses in

    def add_results(self, finished: list[GenResult]) -> None:
        """A decoding step's finished requests: a response into its group (none if the group was
        abandoned); with episodes, a turn back to its episode (see :meth:`collect_episodes`)."""
        for result in finished:
            if self.episodes is not None:
                self.stats.tokens += result.num_tokens
                self.episodes.on_result(result)
                continue
            lease_id, _, index = result.request_id.rpartition("/")
            group = self.groups.get(lease_id)
            if group is None:
                continue
            self.stats.tokens += result.num_tokens
            self.stats.empty_responses += int(is_empty_response(result.text))
            self._finished(Member(group, int(index)), result)

    def collect_episodes(self, block_s: float = 0.0) -> None:
        """Environments' answers in (next turns queued), finished episodes into their groups.
        ``block_s``: wait that long for an answer when nothing else is to be done."""
        if self.episodes is None:
            return
        for ep in self.episodes.poll(block_s):
            member: Member = ep.tag
            if self.groups.get(member.group.lease.lease_id) is member.group:  # not abandoned or released meanwhile
                self._finished(member, ep)

    def _finished(self, member: Member, result: GenResult | Episode) -> None:
        group = member.group
        if self.exporter is not None:
            self.exporter.observe(GENERATION, time.time() - group.created_at)
        group.results[member.index] = result
        if len(group.results) == group.size:  # scored a whole group at a time: batches hold whole groups
            self.scoring.submit([(m, m) for m in group.members()])

    # ------------------------------------------------------------------ lost or given back

    def abandon(self, lease_ids: set[str]) -> None:
        """Stop generating for prompts another worker reclaimed (this one was silent too long)."""
        for lease_id in lease_ids:
            group = self.groups.pop(lease_id, None)
            if group is None:
                continue
            requests = self.engine if self.episodes is None else self.episodes
            for i in range(group.size):
                requests.abort(f"{lease_id}/{i}")
            self.stats.leases_lost += 1
            log.warning("worker %s: lease of prompt %s was taken over by another worker; abandoned", self.worker_id,
                        group.lease.prompt.prompt_id)

    def abort_all(self) -> list[Lease]:
        """Stop generating every open group; returns their leases, to give back."""
        if not self.groups:
            return []
        try:
            if self.episodes is not None:
                self.episodes.abort_all()
            self.engine.abort_all()
        except Exception as exc:  # an engine that failed mid-step: the leases matter more
            log.warning("worker %s: engine abort failed: %s", self.worker_id, exc)
        leases = [g.lease for g in self.groups.values()]
        self.groups.clear()
        return leases

    # ------------------------------------------------------------------ scored: complete

    def _collect_scores(self) -> None:
        """Outcomes that came back (or timed out) into their groups; due batches started."""
        flush = not self.engine.has_work()  # nothing more will finish soon: do not wait to fill a batch
        for member, outcome in self.scoring.poll(flush=flush):
            if self.groups.get(member.group.lease.lease_id) is member.group:  # not abandoned or released meanwhile
                member.group.outcomes[member.index] = outcome
        pool = self.scoring
        self.stats.t_score, self.stats.reward_calls, self.stats.reward_timeouts = pool.busy_s, pool.calls, pool.timeouts
        if self.exporter is not None:
            for seconds in pool.take_durations():
                self.exporter.observe(SCORING, seconds)

    def emit_finished(self) -> None:
        """Complete every group whose outcomes are all in, in one Redis round trip (each group still
        appended and acked atomically on its own)."""
        self._collect_scores()
        ready = [g for g in self.groups.values() if len(g.outcomes) == g.size]
        if not ready:
            return
        samples, dead = [g.samples() for g in ready], [g.dead_letters() for g in ready]
        # DAPO's dynamic sampling: a group that teaches nothing is completed as filtered (prompt acked,
        # budget returned: pacing admits another prompt, so learner batches stay full of useful groups)
        reasons = [group_filter(self.algo, s) for s in samples]
        with self.leases.using() as buffer:  # per group: append + dead letters + ack, one atomic step
            statuses = buffer.complete_many([
                buffer.prepare(g.lease, s, rejected=[("sample", o.reason, o.sample.encode()) for o in d], filtered=why)
                for g, s, d, why in zip(ready, samples, dead, reasons)
            ])
        for group, kept, died, status in zip(ready, samples, dead, statuses):
            del self.groups[group.lease.lease_id]
            self.stats.dead_letters += len(died)
            for o in died:
                self.reasons.warn("a sample of prompt", group.lease.prompt.prompt_id, o.reason)
            if status == "duplicate":
                self.stats.duplicates += 1
                log.info("worker %s: prompt %s was already completed by another worker", self.worker_id,
                         group.lease.prompt.prompt_id)
            elif status == "appended":
                self.stats.prompts += 1
                self.stats.samples += len(kept)
            elif status == "filtered":
                self.stats.prompts_empty += 1
                self.stats.groups_filtered += 1
                self.stats.samples_filtered += len(kept)
            else:
                self.stats.prompts_empty += 1
        for kept, died in zip(samples, dead):  # after the groups are stored: a stop loses nothing scored
            # empty responses dead-lettered by reward.empty_response=dead_letter are the user's choice, not a failing reward
            failed = [(False, "")] * len(kept) + [(True, o.reason) for o in died if o.reason != EMPTY_DEAD_LETTER]
            if any([self.reward_failures.record(f, reason) for f, reason in failed]):
                raise reward_failing(self.reward_failures)
