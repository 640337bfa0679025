"""The `hf` generation engine: a transformers causal LM, continuous batching over a static slot cache.

Up to ``slots`` sequences run at once, each owning one row ("slot") of a preallocated KV cache
(:mod:`rollout_workers.slot_kv`); a finished sequence frees its slot for the next waiting request.
The same code runs on a CPU and a GPU; on a GPU the decoding step is also captured once per
batch-size bucket as a CUDA graph and replayed. docs/architecture.md (Rollout workers: Engines)
describes the design; per :meth:`HFEngine.step`:

1. release the slots of finished (or aborted) sequences and pack the running ones into slots
   ``0..n-1`` (:meth:`HFEngine._pack`), so a decoding pass reads the cache as views;
2. admit waiting requests into free slots; one whose prompt extends the ids a parked slot holds
   takes that slot and prefills only the rest (:meth:`HFEngine._slot_for`);
3. prefill newcomers' prompts in batched passes of at most ``prefill_chunk`` tokens, padded on the
   left, so a prompt completed in the pass samples its first token from it;
4. one decoding pass over slots ``0..n-1``: one token per slot at its own position; slots that do
   not decode feed a pad token into the scratch column. Sampling and log-probs go through
   :mod:`rlhf_core.sampling` for all rows at once, with one host sync for the sampled ids.

Positions count only a sequence's real tokens, so RoPE sees the positions of an unpadded forward
pass: that makes the behaviour log-probs reproducible by the learner.

Parked slots: a finished sequence's K/V stays in its slot with the ids it holds and the oldest
version that wrote any of it; a request reuses it only when that version is at least its
``GenRequest.min_kv_version`` (by default the current one). CUDA graphs read their inputs from
static buffers refilled before each replay; weight updates (with LoRA: of the unmerged adapters,
docs/architecture.md, Models: LoRA) ``copy_`` into the same storage. Models the slot cache cannot
run are refused at construction (:func:`rollout_workers.slot_kv.check_slot_attention`).
"""

from __future__ import annotations

import contextlib
import heapq
import logging
from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from rlhf_core.lora import adapter_parameters
from rlhf_core.sampling import process_logits_rows, sample_tokens, token_logprobs
from rollout_workers.engine import EngineError, FinishReason, Generation, GenRequest, GenResult, check_request, check_weight_update, make_result
from rollout_workers.slot_kv import SlotKVCache, check_slot_attention, direct_forward, direct_forward_supported, round_up, slot_attention_for

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)


class _Seq(Generation):
    """One running sequence and the slot it owns."""

    __slots__ = ("params", "prompt", "slot", "n_cached", "next_input", "stop_ids", "stop_window", "done", "parkable",
                 "kv_version", "admitted_version")

    def __init__(self, request: GenRequest, stop_ids: frozenset[int], slot: int, kv_version: int,
                 admitted_version: int) -> None:
        super().__init__(request)
        self.params = request.params
        self.prompt = request.prompt_ids
        self.slot = slot
        self.n_cached = 0  # columns of the slot holding this sequence's K/V (= position of the next input)
        self.next_input = -1  # the last sampled token, fed at the next decoding pass
        self.stop_ids = stop_ids
        # A stop string of n UTF-8 bytes spans at most n tokens (+ a margin for a merged leading space).
        longest = max((len(s.encode("utf-8", "surrogatepass")) for s in self.params.stop_strings), default=0)
        self.stop_window = longest + 8
        self.done = False
        self.parkable = True  # its slot may be parked when it ends (not after a reload of other weights)
        self.kv_version = kv_version  # the oldest version whose weights wrote any of its K/V
        # no newer than the weights that write what it prefills (its first token carries at most this)
        self.admitted_version = admitted_version

    @property
    def prefilled(self) -> bool:
        return self.n_cached >= len(self.prompt)


class HFEngine:
    """Continuous-batching generation with a transformers model. See the module docstring.

    Args:
        model: a causal LM (``AutoModelForCausalLM``); it is put in eval mode and used in place.
        tokenizer: its tokenizer (EOS ids, pad id, decoding of texts and stop strings).
        slots: sequences decoded together at most (rows of the KV cache).
        seed: seed of the engine's sampling generator (on the model's device).
        max_model_len: longest prompt + response; sizes the KV cache (default: the model's
            ``max_position_embeddings``).
        prefill_chunk: prompt tokens prefilled per step at most (a longer prompt is chunked).
        cuda_graphs: capture the decoding step as CUDA graphs (used only on a CUDA device).
    """

    def __init__(self, model: PreTrainedModel, tokenizer: Any, slots: int = 16, seed: int = 0,
                 max_model_len: int | None = None, prefill_chunk: int = 4096, cuda_graphs: bool = True) -> None:
        if slots < 1:
            raise EngineError(f"slots must be >= 1, got {slots}")
        if prefill_chunk < 1:
            raise EngineError(f"prefill_chunk must be >= 1 token, got {prefill_chunk}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.slots = int(slots)
        self.prefill_chunk = int(prefill_chunk)
        self.version = 0
        self._adapters = adapter_parameters(model)  # LoRA: what a version holds; {} without adapters
        config = model.config
        self.device = next(model.parameters()).device
        self._check_cache_layout()
        limit = int(getattr(config, "max_position_embeddings", 0) or 1 << 30)
        self.max_model_len = min(int(max_model_len), limit) if max_model_len else limit
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_id = int(pad or 0)
        self.eos_ids = frozenset(_eos_ids(tokenizer, model))
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(int(seed))
        self.num_steps = 0  # decoding steps run (one forward pass of [n, 1] each)
        self.num_prefills = 0  # prefill forward passes run
        self.num_reused_tokens = 0  # prompt tokens not prefilled: their K/V was in a parked slot
        self.num_prompt_tokens = 0  # prompt tokens of admitted requests, reused or prefilled
        self._waiting: deque[GenRequest] = deque()
        self._known: dict[str, GenRequest | _Seq] = {}  # waiting or running, by request id
        self._running: list[_Seq] = []  # in admission order
        self._free = list(range(self.slots))  # a heap: the lowest free slot is taken first
        # slot -> (when parked, the oldest version that wrote its K/V, the ids of the K/V it holds)
        self._parked: dict[int, tuple[int, int, list[int]]] = {}
        self._parked_count = 0
        dtype = next(model.parameters()).dtype
        self.cache = SlotKVCache(config, self.slots, self.max_model_len, dtype, self.device)
        self._direct = direct_forward_supported(model)  # else the model's own forward, slot attention plugged in
        self._graphs = _DecodeGraphs(self) if cuda_graphs and self.device.type == "cuda" else None
        # Static inputs of a decoding pass (rows 0..n-1 are used): what a CUDA graph reads.
        self._in_ids_pos = torch.zeros(2, self.slots, dtype=torch.long, device=self.device)  # token ids; columns (= positions)
        self._in_temp = torch.ones(self.slots, dtype=torch.float32, device=self.device)
        self._in_top_k = torch.zeros(self.slots, dtype=torch.long, device=self.device)
        self._in_top_p = torch.ones(self.slots, dtype=torch.float32, device=self.device)
        self._loaded_keys: dict[int, tuple[float, int, float]] = {}  # slot -> sampling key in the buffers
        self._loaded_rows = 0
        self._filters = (False, False)
        if not self._direct:  # its own forward must reach the slot attention in every layer
            with torch.inference_mode():
                token = torch.full((1, 1), self.pad_id, device=self.device)  # into slot 0, column 0: rewritten before read
                check_slot_attention(self.model, lambda: self._forward(token, torch.zeros_like(token), 1, 1))

    # ----------------------------------------------------------------------------- protocol

    def add(self, request: GenRequest) -> None:
        check_request(request, self._known, self.vocab_size, self.max_model_len)
        self._waiting.append(request)
        self._known[request.request_id] = request

    def step(self) -> list[GenResult]:
        with torch.inference_mode(), contextlib.nullcontext() if self._direct else slot_attention_for(self.model):
            if self._release_finished() | self._admit():
                self._pack()
            first = self._prefill()
            return first + self._decode()

    def has_work(self) -> bool:
        return bool(self._known)

    def num_active(self) -> int:
        return len(self._known) - len(self._waiting)

    def num_waiting(self) -> int:
        return len(self._waiting)

    def sampled(self, request_id: str) -> list[int]:
        entry = self._known.get(request_id)
        return entry.tokens if isinstance(entry, Generation) else []

    def abort(self, request_id: str) -> GenResult | None:
        entry = self._known.pop(request_id, None)
        if entry is None:
            return None
        if isinstance(entry, GenRequest):
            self._waiting.remove(entry)
            return make_result(request_id, entry.prompt_ids, [], [], [], "abort", "")
        entry.done = True  # its slot is released at the next step
        return entry.result("abort", self.tokenizer)

    def abort_all(self) -> list[GenResult]:
        return [r for rid in list(self._known) if (r := self.abort(rid)) is not None]

    def weights_target(self) -> torch.nn.Module | Mapping[str, torch.Tensor]:
        """What a version is pulled into, in place: the model, or with LoRA its adapter parameters."""
        return self._adapters if self._adapters else self.model

    def close(self) -> None:
        pass  # everything lives in this process

    def update_weights(self, tensors: Mapping[str, torch.Tensor] | None, version: int) -> None:
        """Copy ``tensors`` into the model (with LoRA: its adapters) in place, the storage CUDA graphs
        read; names and shapes are all checked before the first copy."""
        if tensors is not None:
            own = self._adapters or self.model.state_dict(keep_vars=True)
            check_weight_update(tensors, {n: tuple(t.shape) for n, t in own.items()}, version)
            with torch.no_grad():
                for name, tensor in tensors.items():
                    own[name].copy_(tensor)  # copy_ converts device and dtype
        if int(version) < self.version or (int(version) == self.version and tensors is not None):
            # other weights under a number not above the last: no version tells K/V apart any more
            for slot in self._parked:
                heapq.heappush(self._free, slot)
            self._parked.clear()
            for seq in self._running:  # finished ones included: they are released at the next step
                seq.parkable = False
        self.version = int(version)

    # ----------------------------------------------------------------------------- internals

    def _check_cache_layout(self) -> None:
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        layers = DynamicCache(config=self.model.config).layers
        odd = {type(layer).__name__ for layer in layers if type(layer) is not DynamicLayer}
        if odd:
            raise EngineError(
                f"the hf engine batches full-attention KV caches only; this model's cache has {sorted(odd)} layers. "
                "Use rollout.engine=vllm for sliding-window or linear-attention models"
            )

    def _release_finished(self) -> bool:
        """Free (or park) the slots of finished sequences; returns whether there were any."""
        finished = [seq for seq in self._running if seq.done]
        for seq in finished:  # finished or aborted, its first n_cached columns hold these ids' K/V
            if seq.n_cached and seq.parkable:
                self._parked_count += 1
                self._parked[seq.slot] = (self._parked_count, seq.kv_version, (seq.prompt + seq.tokens)[: seq.n_cached])
            else:
                heapq.heappush(self._free, seq.slot)
        if finished:
            self._running = [seq for seq in self._running if not seq.done]
        return bool(finished)

    def _pack(self) -> None:
        """Running sequences packed at the front (module docstring, step 1): the highest takes the
        lowest free or parked slot while that lies below it (a parked one's K/V moves up into its place)."""
        moves: list[tuple[int, int, int]] = []
        swaps: list[tuple[int, int, int, int]] = []
        for seq in sorted(self._running, key=lambda s: s.slot, reverse=True):
            low = min(self._free[0] if self._free else self.slots, min(self._parked, default=self.slots))
            if low > seq.slot:
                break
            if low in self._parked:
                parked = self._parked.pop(low)
                swaps.append((seq.slot, low, seq.n_cached, len(parked[2])))
                self._parked[seq.slot] = parked
            else:
                heapq.heapreplace(self._free, seq.slot)
                moves.append((seq.slot, low, seq.n_cached))
            seq.slot = low
        self.cache.relocate(moves, swaps)

    def _admit(self) -> bool:
        """Waiting requests into slots; returns whether any was admitted."""
        admitted = bool(self._waiting) and bool(self._free or self._parked)
        while self._waiting and (self._free or self._parked):
            request = self._waiting.popleft()
            stop_ids = frozenset(request.params.stop_token_ids) | (frozenset() if request.params.ignore_eos else self.eos_ids)
            slot, reused, kv_version = self._slot_for(request.prompt_ids, request.kv_floor(self.version))
            seq = _Seq(request, stop_ids, slot, kv_version, self.version)
            seq.n_cached = reused
            self.num_reused_tokens += reused
            self.num_prompt_tokens += len(request.prompt_ids)
            self._known[request.request_id] = seq
            self._running.append(seq)
        return admitted

    def _slot_for(self, prompt: list[int], floor: int) -> tuple[int, int, int]:
        """A slot for ``prompt``, how many of its first tokens that slot's K/V already holds, and
        the oldest version that wrote them: the parked slot written by version ``floor`` or later
        whose ids ``prompt`` extends the most (all but the prompt's last token at most: its pass
        gives the first sampled token); else the lowest free slot, else the least recently parked
        one. A prompt that is only a prefix of a parked sequence's ids takes its slot only when
        none is free (that K/V may be a conversation's that goes on)."""
        best, reused = -1, 0
        for slot, (_, kv_version, ids) in self._parked.items():
            m = min(len(ids), len(prompt))  # the last token first: sessions that share a system prompt part there
            if (min(m, len(prompt) - 1) > reused and kv_version >= floor and (m == len(ids) or not self._free)
                    and prompt[m - 1] == ids[m - 1] and prompt[:m] == ids[:m]):
                best, reused = slot, min(m, len(prompt) - 1)
        if best >= 0:
            return best, reused, self._parked.pop(best)[1]
        if self._free:
            return heapq.heappop(self._free), 0, self.version
        slot = min(self._parked, key=lambda k: self._parked[k][0])
        del self._parked[slot]
        return slot, 0, self.version

    def _prefill(self) -> list[GenResult]:
        """Write up to ``prefill_chunk`` prompt tokens of the newest sequences into their slots;
        the sequences whose prompt is now complete sample their first token from the pass.
        Returns those that finished on it."""
        budget, chunk = self.prefill_chunk, []
        for seq in self._running:
            if budget <= 0:
                break
            if not seq.prefilled:
                take = min(len(seq.prompt) - seq.n_cached, budget)
                chunk.append((seq, take))
                budget -= take
        if not chunk:
            return []
        width = max(take for _, take in chunk)
        ids, positions = [], []
        for seq, take in chunk:  # padded on the left: column -1 is each row's last real token
            start, pad = seq.n_cached, width - take
            ids.append([self.pad_id] * pad + seq.prompt[start : start + take])
            positions.append([self.cache.scratch] * pad + list(range(start, start + take)))
            seq.n_cached += take
        rows = torch.tensor([seq.slot for seq, _ in chunk], device=self.device)
        pos = torch.tensor(positions, device=self.device)
        logits = self._forward(torch.tensor(ids, device=self.device), pos, rows, max(s.n_cached for s, _ in chunk))
        self.num_prefills += 1
        done = [i for i, (seq, _) in enumerate(chunk) if seq.prefilled]
        if not done:
            return []
        seqs = [chunk[i][0] for i in done]
        keys = [seq.params.key for seq in seqs]
        temp, top_k, top_p = (torch.tensor(v, device=self.device) for v in zip(*keys))
        processed = process_logits_rows(
            logits[torch.tensor(done, device=self.device)], temp.float(), top_k.long(), top_p.float(),
            use_top_k=any(t == 0 or 0 < k < self.vocab_size for t, k, _ in keys), use_top_p=any(p < 1 for *_, p in keys))
        tokens = sample_tokens(processed, self.generator)
        logprobs = token_logprobs(processed, tokens)
        return self._record(seqs, tokens.tolist(), logprobs.tolist())

    def _forward(self, ids: torch.Tensor, columns: torch.Tensor, rows: torch.Tensor | int, seen: int) -> torch.Tensor:
        """One forward pass of ``ids`` ``[n, C]`` writing ``columns`` (real tokens': their positions;
        padding's: the scratch column) through the slot cache; returns the last input's logits
        ``[n, V]``. ``seen``: columns any real input may attend to."""
        width = self.cache.columns if self._graphs is not None else min(self.cache.columns, round_up(seen, 8))
        self.cache.select(rows, columns, width)
        mask = self.cache.attention_mask(columns, width)
        positions = self.cache.positions(columns)  # on a graph's static inputs too: captured with it
        if self._direct:
            return direct_forward(self.model, ids, positions, mask, self.cache)
        out = self.model(input_ids=ids, position_ids=positions, attention_mask=mask, past_key_values=self.cache,
                         use_cache=True, logits_to_keep=1)
        return out.logits[:, -1]

    def _decode_pass(self, rows: torch.Tensor | int, n: int, seen: int, use_top_k: bool,
                     use_top_p: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward, logit processing, sampling and log-probs of ``n`` rows from the static inputs
        (what a CUDA graph captures). ``rows``: slots ``0..n-1`` (an int) or ``[n]`` slot ids.
        Returns ``[n]`` tokens and ``[n]`` log-probs."""
        logits = self._forward(self._in_ids_pos[0, :n, None], self._in_ids_pos[1, :n, None], rows, seen)
        processed = process_logits_rows(logits, self._in_temp[:n], self._in_top_k[:n], self._in_top_p[:n],
                                        use_top_k=use_top_k, use_top_p=use_top_p)
        tokens = sample_tokens(processed, self.generator)
        return tokens, token_logprobs(processed, tokens)

    def _decode(self) -> list[GenResult]:
        decoding = [seq for seq in self._running if seq.prefilled and not seq.done]
        if not decoding:
            return []
        n = max(seq.slot for seq in decoding) + 1
        seen = max(seq.n_cached for seq in decoding) + 1
        if self._graphs is not None:
            n = self._graphs.bucket(n)
            row_of = [seq.slot for seq in decoding]
            use_top_k, use_top_p = self._load_inputs(decoding, row_of, n)
            tokens, logprobs = self._graphs.run(n, use_top_k, use_top_p)
        else:
            # Eagerly, a batch with a still-prefilling slot inside it runs the decoding slots only (gathered).
            packed = len(decoding) < n
            rows: torch.Tensor | int = torch.tensor([seq.slot for seq in decoding], device=self.device) if packed else n
            row_of = list(range(len(decoding))) if packed else [seq.slot for seq in decoding]
            n = len(decoding) if packed else n
            use_top_k, use_top_p = self._load_inputs(decoding, row_of, n)
            tokens, logprobs = self._decode_pass(rows, n, seen, use_top_k, use_top_p)
        token_list = tokens.tolist()  # the one device sync of the step
        logprob_list = logprobs.tolist()
        self.num_steps += 1
        for seq in decoding:  # its input went into column n_cached
            seq.n_cached += 1
        return self._record(decoding, [token_list[i] for i in row_of], [logprob_list[i] for i in row_of])

    def _load_inputs(self, decoding: list[_Seq], row_of: list[int], n: int) -> tuple[bool, bool]:
        """Fill the static inputs of rows ``0..n-1`` (``decoding[i]`` feeds row ``row_of[i]``); rows
        no sequence feeds get a pad token at the scratch column. Returns whether any row filters
        by top-k / top-p."""
        ids_pos = [[self.pad_id] * n, [self.cache.scratch] * n]
        for seq, row in zip(decoding, row_of):
            ids_pos[0][row], ids_pos[1][row] = seq.next_input, seq.n_cached
        self._in_ids_pos[:, :n].copy_(torch.tensor(ids_pos), non_blocking=True)
        keys = {row: seq.params.key for seq, row in zip(decoding, row_of)}
        if keys != self._loaded_keys or n > self._loaded_rows:  # settings change only on admission
            temp, top_k, top_p = [1.0] * n, [0] * n, [1.0] * n
            for row, (t, k, p) in keys.items():
                temp[row], top_k[row], top_p[row] = t, k, p
            self._in_temp[:n].copy_(torch.tensor(temp), non_blocking=True)
            self._in_top_k[:n].copy_(torch.tensor(top_k), non_blocking=True)
            self._in_top_p[:n].copy_(torch.tensor(top_p), non_blocking=True)
            self._loaded_keys, self._loaded_rows = keys, n
            self._filters = (any(t == 0 or 0 < k < self.vocab_size for t, k in zip(temp, top_k)), any(p < 1 for p in top_p))
        return self._filters

    def _record(self, decoding: list[_Seq], token_list: list[int], logprob_list: list[float]) -> list[GenResult]:
        """Append each sequence's sampled token, stamped with the version now; a sequence's first
        one at most with the version at its admission (module :mod:`rollout_workers.engine`)."""
        version, finished = self.version, []
        for seq, token, logprob in zip(decoding, token_list, logprob_list):
            seq.next_input = token
            seq.tokens.append(token)
            seq.logprobs.append(logprob)
            seq.versions.append(version if len(seq.tokens) > 1 else min(version, seq.admitted_version))
            reason = self._finish_reason(seq, token)
            if reason is not None:
                seq.done = True
                del self._known[seq.request.request_id]
                finished.append(seq.result(reason, self.tokenizer))
        return finished

    def _finish_reason(self, seq: _Seq, token: int) -> FinishReason | None:
        if token in seq.stop_ids:
            return "stop"
        if seq.params.stop_strings:
            tail = self.tokenizer.decode(seq.tokens[-seq.stop_window:], skip_special_tokens=True)
            if any(s in tail for s in seq.params.stop_strings):
                return "stop"
        if len(seq.tokens) >= seq.params.max_new_tokens or len(seq.prompt) + len(seq.tokens) >= self.max_model_len:
            return "length"
        return None


class _DecodeGraphs:
    """The decoding pass captured as one CUDA graph per (batch bucket, top-k used, top-p used),
    on first use; buckets are powers of two up to the slot count. The sampling generator is
    registered with each graph, so replays draw fresh random numbers."""

    def __init__(self, engine: HFEngine) -> None:
        self.engine = engine
        self.buckets = sorted({1 << i for i in range(engine.slots.bit_length()) if 1 << i < engine.slots} | {engine.slots})
        self.graphs: dict[tuple[int, bool, bool], tuple[Any, tuple[torch.Tensor, torch.Tensor]] | None] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def run(self, n: int, use_top_k: bool, use_top_p: bool) -> tuple[torch.Tensor, torch.Tensor]:
        key = (n, use_top_k, use_top_p)
        if key not in self.graphs:
            self.graphs[key] = self._capture(*key)
        entry = self.graphs[key]
        if entry is None:  # capture failed: this bucket runs eagerly
            return self.engine._decode_pass(n, n, self.engine.cache.columns, use_top_k, use_top_p)
        graph, outputs = entry
        graph.replay()
        return outputs

    def _capture(self, n: int, use_top_k: bool, use_top_p: bool) -> tuple[Any, tuple[torch.Tensor, torch.Tensor]] | None:
        engine, columns = self.engine, self.engine.cache.columns
        # Warm-up passes run for real: they write the K/V the replay will write and advance the generator.
        stream = torch.cuda.Stream(device=engine.device)
        stream.wait_stream(torch.cuda.current_stream(engine.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                engine._decode_pass(n, n, columns, use_top_k, use_top_p)
        torch.cuda.current_stream(engine.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            graph.register_generator_state(engine.generator)
            # thread_local: a weight pull copying on another thread must not break the capture
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                outputs = engine._decode_pass(n, n, columns, use_top_k, use_top_p)
        except Exception as exc:  # noqa: BLE001 - any capture failure falls back to eager for this bucket
            log.warning("hf engine: capturing the decoding step of %d slots as a CUDA graph failed (%s); "
                        "that bucket runs eagerly", n, exc)
            return None
        return graph, outputs


def _eos_ids(tokenizer: Any, model: torch.nn.Module) -> set[int]:
    """The tokenizer's EOS id and the model's generation config's (one id or a list)."""
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = [tokenizer.eos_token_id, *([gen_eos] if isinstance(gen_eos, int) else gen_eos or [])]
    return {int(t) for t in ids if t is not None}
