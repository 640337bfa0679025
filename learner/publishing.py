"""Publishing the learner's weights as versions: every rank gathers CPU copies of them, rank 0
sends them to the weight server (on a thread of its own while the next update trains) and tells
the buffer. A version number never names two sets of weights (:meth:`Publishing.publish_start`)."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from buffer import LearnerClient
from learner.engines import TrainEngine, all_reduce_max
from rlhf_core import lora
from rlhf_core.config import Config
from rlhf_core.errors import UserError
from weight_server import StaleVersionError, WeightPublisher

log = logging.getLogger(__name__)


class Publishing:
    """One rank's side of publishing (rank 0 talks to the weight server and the buffer)."""

    def __init__(self, cfg: Config, engine: TrainEngine, buffer: LearnerClient, rank0: bool) -> None:
        self.cfg, self.engine, self.buffer = cfg, engine, buffer
        self._dtype = {"as_trained": None, "bfloat16": torch.bfloat16, "float16": torch.float16}[
            cfg.learner.publish_dtype
        ]
        self.adapters_only = lora.enabled(cfg.model.lora)  # what a version holds: LoRA adapters, or everything
        self.last_s = 0.0  # the latest publish's time, from the gathers to the buffer knowing the version
        ws = cfg.weight_server
        self.publisher = WeightPublisher(ws.address, ws) if rank0 else None
        # rank 0 sends version v+1 on this thread while update v+2 trains (see publish)
        self._sender = ThreadPoolExecutor(1, thread_name_prefix="publish") if rank0 else None
        self._sending: Future | None = None

    def publish_start(self, version: int, restored_version: int, updates: int) -> int:
        """Publish the weights the learner starts from (the checkpoint's ``version``, 0 when fresh,
        holding ``updates``) under a number that never names other weights; return it. Collective.

        The first offer is ``version`` unless something newer was published. The server takes it
        when it holds nothing there or exactly these weights (a restart after a clean checkpoint);
        otherwise the weights go out as the newest version + 1. "Published" counts the buffer's
        learner version too: after ``rlhf-run resume=`` the weight server is fresh, but Redis keeps
        samples tagged with the dead learner's versions, which must not name other weights."""
        newest = self._newest_published()
        offer = version if newest is None or newest <= version else newest + 1
        for _ in range(3):  # a refusal means another publisher got there first: look again
            # only rank 0 asks the weight server; the others take its answer
            version = int(all_reduce_max(torch.tensor([float(offer)])).item())
            refused = float(not self.publish(version, updates, refusable=True))
            if not all_reduce_max(torch.tensor([refused])).item():
                if version != restored_version:
                    what = f"restored weights (checkpoint version {restored_version})" if updates else "initial weights"
                    log.info("published the %s as version %d: the weight server already held versions up to %d, "
                             "published before a crash", what, version, version - 1)
                return version
            newest = self._newest_published()
            offer = (newest if newest is not None else version) + 1
        raise UserError(f"the weight server at {self.cfg.weight_server.address} keeps refusing version {offer}: is a "
                        "second learner publishing to it? Give each run its own weight server")

    def _newest_published(self) -> int | None:
        """Rank 0: the newest version the weight server holds or the buffer was told of (None on other ranks)."""
        if not self.publisher:
            return None
        held = self.publisher.latest_version()
        told = self.buffer.learner_version()  # 0 when never set: no higher than any checkpoint's
        return told if held is None else max(held, told)

    def publish(self, version: int, updates: int, refusable: bool = False, background: bool = False) -> bool:
        """Publish the current weights as ``version`` (holding ``updates``). Collective: every rank
        gathers CPU copies (under ZeRO-3 module by module); rank 0 sends them.

        ``background``: rank 0 sends on its publish thread and returns at once; the buffer learns
        the version when the send is done. At most one send is in flight: the next publish, a
        checkpoint's commit (a batch is acked only once its version is published) and the end of
        the run wait for it (:meth:`wait`). Returns False (rank 0, only when ``refusable``) if the
        server holds other weights under that version or a newer one."""
        self.wait()
        t0 = time.monotonic()
        # with LoRA the adapters alone: the base weights every side loads from model.path never change
        tensors = (self.engine.named_trainable_parameters(self._dtype) if self.adapters_only
                   else self.engine.named_full_parameters(self._dtype))
        if self.publisher is None:
            for _ in tensors:  # keep in step with rank 0's gathers
                pass
            return True
        if background:
            assert self._sender is not None  # rank 0 has both
            # the copies are a snapshot: the next optimizer step changes the weights in place
            self._sending = self._sender.submit(self._send, self.publisher, version, updates, list(tensors), t0)
            return True
        try:
            self.publisher.publish(version, tensors)
        except StaleVersionError:
            if not refusable:
                raise
            for _ in tensors:  # finish the gathers the other ranks are in (a no-op when consumed)
                pass
            return False
        self.last_s = time.monotonic() - t0
        return True

    def _send(self, publisher: WeightPublisher, version: int, updates: int, tensors: list[tuple[str, torch.Tensor]],
              t0: float) -> None:
        """The publish thread: send ``version``, then tell the buffer (workers pace against ``updates``)."""
        publisher.publish(version, tensors)
        self.buffer.set_learner_version(version, updates)
        self.last_s = time.monotonic() - t0

    def wait(self) -> None:
        """Wait for the send in flight, if any; re-raise what it raised."""
        sending, self._sending = self._sending, None
        if sending is not None:
            sending.result()

    def close(self) -> None:
        if self._sender is not None:
            self._sender.shutdown(wait=True)
        if self.publisher is not None:
            self.publisher.close()
