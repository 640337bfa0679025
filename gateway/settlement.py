"""Reward settlement: a rewarded session's sample kept in the buffer, then appended with its group.

The sample is kept (``P gw:rewarded``) before the reward is acknowledged and deleted in the step
that appends its group, so a gateway that stops or dies with groups filling loses none of them:
the next one takes them up at start.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from buffer import GatewayClient
from gateway.openai_api import bad, finite, retry_later
from gateway.sessions import MAX_ID_CHARS, Rewarded, Sessions
from rlhf_core import metric_names as M
from rlhf_core.config import Config
from rlhf_core.dapo import group_filter
from rlhf_core.records import Sample
from rlhf_core.wire import WireError

log = logging.getLogger(__name__)

#: distinct reward component names a gateway takes, and their length: each is a learner metric
#: ``reward/<name>`` (and a Prometheus gauge) for the rest of the run
MAX_COMPONENTS = 64
MAX_COMPONENT_CHARS = 64


@dataclass(frozen=True)
class RewardPost:
    """A posted reward: its total, its named components (none for a plain number), the group it names."""

    total: float
    components: dict[str, float]
    group: str | None


def parse_reward(obj: dict[str, Any], known: set[str]) -> RewardPost:
    """The reward body ``{"reward": number | {name: number}, "group"?: str}``; ``known``: the
    component names taken so far (a run's components are a fixed set of names)."""
    value = obj.get("reward")
    parts: dict[Any, Any] = value if isinstance(value, dict) and value else {"": value}
    if not all(finite(v) for v in parts.values()) or not finite(total := sum(float(v) for v in parts.values())):
        raise bad("'reward' must be a finite number, or an object of named finite numbers (summed)", "reward")
    components = {str(k): float(v) for k, v in parts.items()} if parts is value else {}
    if not all(0 < len(k) <= MAX_COMPONENT_CHARS for k in components):
        raise bad(f"reward component names must be 1-{MAX_COMPONENT_CHARS} characters", "reward")
    if taken := sorted(set(components) & M.REWARD_STATS):
        raise bad(f"reward component name(s) {', '.join(map(repr, taken))} are the learner's own reward/<stat> "
                  "metrics (a component is the metric reward/<its name>); rename them", "reward")
    if len(names := known | set(components)) > MAX_COMPONENTS:
        raise bad(f"'reward' names {len(names) - len(known)} component(s) this gateway has not seen, "
                  f"past the {MAX_COMPONENTS} distinct component names it takes: a run's reward components are a "
                  "fixed set of names (each is a learner metric reward/<name>)", "reward")
    group = obj.get("group")
    if group is not None and not (isinstance(group, str) and 0 < len(group) <= MAX_ID_CHARS):
        raise bad(f"'group' must be a string of 1-{MAX_ID_CHARS} characters", "group")
    return RewardPost(total, components, group)


class RewardSettlement:
    """The rewarded sessions of this gateway, from their reward until their group is in the buffer."""

    def __init__(self, cfg: Config, buffer: GatewayClient, sessions: Sessions) -> None:
        self.cfg, self.buffer, self.sessions = cfg, buffer, sessions
        self.component_names: set[str] = set()  # of the rewards taken (MAX_COMPONENTS)
        self._appending = asyncio.Lock()

    async def settle(self, session_id: str, post: RewardPost) -> tuple[Rewarded, int, str | None]:
        """End the session with its reward, keep its sample, append what is due; returns the
        rewarded session and what :meth:`append_due` says of its group."""
        rewarded = self.sessions.end(session_id, post.total, post.components, post.group)
        self.component_names |= set(post.components)
        # kept before it is acknowledged: a gateway that dies now loses no accepted reward
        keep = asyncio.ensure_future(asyncio.to_thread(self.buffer.keep_rewarded, rewarded.key, rewarded.sample))
        try:
            await asyncio.shield(keep)
        except asyncio.CancelledError:  # the request went away: settle the session when the keep ends
            keep.add_done_callback(lambda done: self._settle_kept(rewarded, done))
            raise
        except Exception as exc:
            self.sessions.reopen(rewarded)
            log.warning("gateway: could not keep the reward of session %s: %s", session_id, exc)
            raise retry_later(f"the reward could not be stored ({type(exc).__name__}); post it again", "unavailable") from None
        return rewarded, *await self.append_due(rewarded)

    def _settle_kept(self, rewarded: Rewarded, done: asyncio.Future) -> None:
        if done.cancelled() or done.exception() is not None:
            self.sessions.reopen(rewarded)
        else:  # kept: in its group, appended at the next round when that makes it due
            self.sessions.rewarded(rewarded)

    async def append_due(self, rewarded: Rewarded | None = None) -> tuple[int, str | None]:
        """Add ``rewarded`` (kept) to its group, then append every group that is due, each with the
        deletion of its kept samples (a filtered group: the deletion alone); a group the buffer cannot
        take now is tried again at the next round. Returns, for the group of ``rewarded``, how many
        samples it appended (0: waiting, or filtered) and why it was filtered (None: it was not)."""
        counters, appended_with, filtered = self.sessions.counters, 0, None
        async with self._appending:  # one round at a time: a group is appended by the round that saw it due
            if rewarded is not None:
                self.sessions.rewarded(rewarded)
            for name in self.sessions.due():
                keys, samples = self.sessions.group(name)
                why = group_filter(self.cfg.algo, samples)
                try:
                    entry = await asyncio.to_thread(self.buffer.append_group, "gateway", samples, keys, why)
                    # None: some of its kept samples were appended before (another gateway took them up)
                    still = await asyncio.to_thread(self.buffer.rewarded_kept, keys) if entry is None else {}
                except Exception:  # noqa: BLE001  # Redis away: the samples stay kept; the next round retries
                    log.exception("gateway: appending group %s failed; it is tried again", name)
                    continue
                if entry is None:
                    self.sessions.appended(name, [k for k in keys if k not in still])
                    log.info("gateway: %d sample(s) of group %s were appended before; %d wait for their group",
                             len(keys) - len(still), name, len(still))
                    continue
                self.sessions.appended(name, keys)
                if rewarded is not None and rewarded.key in keys:
                    appended_with, filtered = (0 if why else len(samples)), why
                if why is not None:
                    counters.groups_filtered += 1
                    counters.samples_filtered += len(samples)
                elif entry:
                    counters.groups_appended += 1
                    counters.samples_appended += len(samples)
                else:
                    counters.samples_dead_lettered += len(samples)
                    log.warning("gateway: a group of %d sample(s) was dead-lettered by the buffer (rlhf-monitor shows why)",
                                len(samples))
        return appended_with, filtered

    async def recover(self) -> None:
        """Take up the rewarded sessions an earlier gateway kept and did not append: back in their
        groups (a kept record that does not decode is dead-lettered)."""
        for key, raw in (await asyncio.to_thread(self.buffer.rewarded_kept)).items():
            try:
                sample = Sample.decode(raw, max_bytes=self.cfg.buffer.max_record_bytes)
            except WireError as exc:
                await asyncio.to_thread(self.buffer.dead_letter, f"a kept gateway reward does not decode: {exc}",
                                        "gateway", raw)
                await asyncio.to_thread(self.buffer.forget_rewarded, key)
                continue
            self.sessions.recovered(key, sample)
        if self.sessions.counters.rewards_recovered:
            log.info("gateway: %d rewarded session(s) kept by an earlier gateway are back in their %d group(s)",
                     self.sessions.counters.rewards_recovered, len(self.sessions.groups))
        await self.append_due()
