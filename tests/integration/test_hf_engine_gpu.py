"""The hf engine on a GPU: the CUDA-graph decoding step against the same engine run eagerly, and
replays after a weight update computing with the new weights. Skipped without CUDA."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from rlhf_core.models import load_policy, load_tokenizer
from rollout_workers.engine import GenRequest, SamplingParams
from rollout_workers.hf_engine import HFEngine

pytestmark = [pytest.mark.integration, pytest.mark.gpu, pytest.mark.timeout(300)]


@pytest.fixture
def gpu_policy(tiny_model_cfg):
    return load_policy(tiny_model_cfg).eval().to("cuda")


def run_greedy(engine: HFEngine, prompts: list[list[int]], lengths: list[int], update_after: int | None = None,
               new_weights: dict | None = None) -> dict:
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        engine.add(GenRequest(f"r{i}", p, SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)))
    results, steps = {}, 0
    while engine.has_work():
        results.update({r.request_id: r for r in engine.step()})
        steps += 1
        if steps == update_after:
            engine.update_weights(new_weights, version=1)
    return results


def test_graph_replays_match_eager_decoding_across_buckets_and_a_weight_update(gpu_policy, tiny_model_cfg):
    tokenizer = load_tokenizer(tiny_model_cfg)
    prompts = [tokenizer(f"prompt number {i} " * (1 + i % 3))["input_ids"] for i in range(12)]
    # The bucket is the highest busy slot's: later requests refill the low slots first, so the
    # later ones finish first here and the batch shrinks through the 8, 4, 2 and 1 buckets
    lengths = [3 + 2 * (11 - i) for i in range(12)]
    changed = copy.deepcopy(gpu_policy)
    with torch.no_grad():
        for p in changed.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    new_weights = {n: t.detach().clone() for n, t in changed.state_dict().items()}
    original, eager_model = copy.deepcopy(gpu_policy), copy.deepcopy(gpu_policy)
    graphs = HFEngine(gpu_policy, tokenizer, slots=8, cuda_graphs=True)
    eager = HFEngine(eager_model, tokenizer, slots=8, cuda_graphs=False)
    assert graphs._graphs is not None and eager._graphs is None
    got = run_greedy(graphs, prompts, lengths, update_after=6, new_weights=new_weights)
    want = run_greedy(eager, prompts, lengths, update_after=6, new_weights=new_weights)
    captured = [key for key, entry in graphs._graphs.graphs.items() if entry is not None]
    assert {key[0] for key in captured} >= {8, 4, 2, 1}, f"graphs captured: {captured}"
    for rid in want:
        assert got[rid].token_ids.tolist() == want[rid].token_ids.tolist(), rid
        assert got[rid].versions.tolist() == want[rid].versions.tolist(), rid
    # The update changed what the replays compute: without it the tokens differ.
    before = run_greedy(HFEngine(original, tokenizer, slots=8, cuda_graphs=False), prompts, lengths)
    assert any(before[r].token_ids.tolist() != want[r].token_ids.tolist() for r in want if want[r].versions[-1] == 1)


def test_sampled_logprobs_on_the_gpu_match_the_learner_recomputation(gpu_policy, tiny_model_cfg):
    from rlhf_core.sampling import response_logprobs

    tokenizer = load_tokenizer(tiny_model_cfg)
    engine = HFEngine(gpu_policy, tokenizer, slots=4, seed=3)
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, max_new_tokens=12, ignore_eos=True)
    for i in range(6):
        engine.add(GenRequest(f"s{i}", tokenizer(f"sample {i}")["input_ids"], params))
    results = {}
    while engine.has_work():
        results.update({r.request_id: r for r in engine.step()})
    for r in results.values():
        full = torch.tensor(np.concatenate([r.prompt_ids, r.token_ids]), dtype=torch.long, device="cuda")[None]
        with torch.no_grad():
            logits = gpu_policy(input_ids=full).logits[:, len(r.prompt_ids) - 1 : -1]
        ref = response_logprobs(logits, torch.from_numpy(r.token_ids.astype(np.int64)).cuda()[None],
                                params.temperature, params.top_k, params.top_p)[0].cpu().numpy()
        np.testing.assert_allclose(r.logprobs, ref, rtol=0, atol=1e-3)
