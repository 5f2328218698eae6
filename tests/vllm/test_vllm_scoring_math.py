"""The vLLM engine's scoring arithmetic and request discipline, against a fake vLLM that knows the true answer.

The fake answers ``/v1/completions`` like vLLM 0.32 with ``--logprobs-mode processed_logprobs``, from a fixed
table of logits (the row is chosen by the prefix length): ``prompt_logprobs`` from the untempered distribution,
one-token generations with the tempered one (top-k or at ``logprob_token_ids``). So the exact answer of every
score is known, whichever path (probe only, tail bracket, exact per-position requests) the engine takes. No vLLM
needed: these run in every session.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from clawloop.engines.base import SamplingParams, ScoreRequest
from clawloop.engines.vllm import VLLMEngine

VOCAB = 500


class FakeVLLM:
    def __init__(self, seed: int = 0, delay_s: float = 0.0):
        generator = torch.Generator().manual_seed(seed)
        # Rows of very different sharpness: some peaked (the tail bracket suffices), some flat (it does not).
        scale_N = torch.tensor([0.5, 2.0, 6.0, 12.0] * 16, dtype=torch.float64)
        self.logits_N_V = torch.randn(len(scale_N), VOCAB, generator=generator, dtype=torch.float64) * scale_N[:, None]
        self.delay_s = delay_s
        self.bodies: list[dict] = []
        self.intervals: list[tuple[str, float, float]] = []
        self.lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                start = time.monotonic()
                answer = owner.answer(body)
                time.sleep(owner.delay_s)
                kind = "ids" if body.get("logprob_token_ids") else "top" if body.get("logprobs") else "none"
                with owner.lock:
                    owner.bodies.append(body)
                    owner.intervals.append((kind, start, time.monotonic()))
                payload = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def logprobs(self, prefix_len: int, temperature: float = 1.0) -> torch.Tensor:
        return torch.log_softmax(self.logits_N_V[prefix_len % len(self.logits_N_V)] / temperature, dim=-1)

    def answer(self, body: dict) -> dict:
        prompt = body["prompt"]
        choice: dict = {"text": "", "finish_reason": "length"}
        if body.get("prompt_logprobs"):
            k = body["prompt_logprobs"]
            rows: list = [None]
            for i in range(1, len(prompt)):
                lp = self.logprobs(i)
                order = lp.argsort(descending=True).tolist()
                row = {str(prompt[i]): {"logprob": float(lp[prompt[i]]), "rank": order.index(prompt[i]) + 1}}
                for rank, token in enumerate(order[:k], start=1):
                    row[str(token)] = {"logprob": float(lp[token]), "rank": rank}
                rows.append(row)
            choice["prompt_logprobs"] = rows
        lp = self.logprobs(len(prompt), body["temperature"] or 1.0)
        sampled = int(lp.argmax())
        if body.get("logprob_token_ids"):
            ids = [sampled] + list(body["logprob_token_ids"])
        else:
            ids = [sampled] + lp.argsort(descending=True)[: body.get("logprobs") or 0].tolist()
        choice["token_ids"] = [sampled]
        choice["logprobs"] = {"token_logprobs": [float(lp[sampled])], "tokens": [f"token_id:{sampled}"],
                              "top_logprobs": [{f"token_id:{i}": float(lp[i]) for i in ids}]}
        return {"choices": [choice]}

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake():
    server = FakeVLLM()
    yield server
    server.close()


def expected(fake: FakeVLLM, request: ScoreRequest):
    P, temperature = len(request.prompt_ids), request.temperature if request.temperature > 0 else 1.0
    rows = [fake.logprobs(P + t, temperature) for t in range(len(request.response_ids))]
    logprobs_T = torch.stack([row[r] for row, r in zip(rows, request.response_ids)])
    top_T_K = torch.stack([row.topk(request.top_k).values for row in rows])
    ids_T_K = torch.stack([row.topk(request.top_k).indices for row in rows])
    at = None
    if request.at_ids_T_K is not None:
        at = torch.stack([row[ids] for row, ids in zip(rows, request.at_ids_T_K)])
    return logprobs_T, ids_T_K, top_T_K, at


@pytest.mark.parametrize("temperature", [1.0, 0.6, 0.3, 1.5])
@pytest.mark.parametrize("use_probe", [True, False])
def test_scores_equal_the_true_tempered_log_probs(fake, temperature, use_probe):
    engine = VLLMEngine(fake.url, "base", max_context=4096, vocab_size=VOCAB, max_logprobs=20,
                        prompt_logprobs=use_probe, score_tolerance=1e-4)
    generator = torch.Generator().manual_seed(1)
    response = torch.randint(0, VOCAB, (40,), generator=generator).tolist()
    at_ids_T_K = torch.randint(0, VOCAB, (40, 3), generator=generator)
    at_ids_T_K[:, 0] = torch.tensor(response)  # one requested id per position is surely covered
    request = ScoreRequest([7, 8, 9], response, top_k=4, temperature=temperature, at_ids_T_K=at_ids_T_K)
    (result,) = asyncio.run(engine.score([request]))
    logprobs_T, ids_T_K, top_T_K, at = expected(fake, request)
    assert torch.equal(result.topk_ids_T_K, ids_T_K)
    # float32 results; the bracket midpoint is within score_tolerance of the truth.
    assert torch.allclose(result.logprobs_T.double(), logprobs_T, atol=2e-4)
    assert torch.allclose(result.topk_logprobs_T_K.double(), top_T_K, atol=2e-4)
    assert torch.allclose(result.at_ids_logprobs_T_K.double(), at, atol=2e-4)
    positions = engine.stats["score_position"]
    if use_probe:
        assert engine.stats["score_probe"] == 1
        assert 0 < positions <= 40  # random requested ids are outside the probe's top-20 somewhere
    else:
        assert engine.stats["score_probe"] == 0 and positions >= 40


def test_probe_alone_is_exact_at_temperature_one_and_peaked_rows_skip_exact_requests(fake):
    engine = VLLMEngine(fake.url, "base", max_context=4096, vocab_size=VOCAB, max_logprobs=20, score_tolerance=1e-3)
    response = [int(fake.logprobs(3 + t).argmax()) for t in range(32)]  # likely tokens: inside every top-20
    (at_one,) = asyncio.run(engine.score([ScoreRequest([1, 2, 3], response, top_k=4, temperature=1.0)]))
    assert engine.stats["score_position"] == 0
    assert torch.allclose(at_one.logprobs_T.double(), expected(fake, ScoreRequest([1, 2, 3], response))[0], atol=1e-5)
    request = ScoreRequest([1, 2, 3], response, top_k=4, temperature=0.3)
    (cold,) = asyncio.run(engine.score([request]))
    # At T=0.3 the sharp rows (3 of 4) are settled by the bracket; the flattest ones may need a request.
    assert engine.stats["score_position"] < 32
    assert torch.allclose(cold.logprobs_T.double(), expected(fake, request)[0], atol=1e-3)


def test_top_k_and_chosen_id_requests_never_overlap():
    fake = FakeVLLM(delay_s=0.03)
    try:
        engine = VLLMEngine(fake.url, "base", max_context=4096, vocab_size=VOCAB, max_logprobs=20,
                            prompt_logprobs=False, score_concurrency=8)
        response = list(range(100, 112))
        at = torch.tensor([[i + 1, 499] for i in response])

        async def run():
            return await asyncio.gather(
                engine.score([ScoreRequest([1, 2], response, top_k=3, temperature=0.7, at_ids_T_K=at)]),
                *(engine.generate([5, 6, i], SamplingParams(temperature=0.5, max_tokens=1, top_logprobs=2))
                  for i in range(6)),
                *(engine.generate([5, 6, i], SamplingParams(temperature=0.5, max_tokens=1)) for i in range(6)),
            )

        asyncio.run(run())
    finally:
        fake.close()
    ids = [(s, e) for kind, s, e in fake.intervals if kind == "ids"]
    tops = [(s, e) for kind, s, e in fake.intervals if kind == "top"]
    assert ids and tops
    overlaps = [(a, b) for a in ids for b in tops if a[0] < b[1] and b[0] < a[1]]
    assert not overlaps


def test_requests_pin_every_sampling_knob(fake):
    engine = VLLMEngine(fake.url, "base", max_context=4096, eos_token_ids=[2], max_logprobs=20)
    asyncio.run(engine.generate([1, 2, 3], SamplingParams(temperature=0.0, top_p=0.5, max_tokens=3, seed=9,
                                                         stop=("END",), stop_token_ids=(7,))))
    body = fake.bodies[-1]
    assert body["prompt"] == [1, 2, 3] and body["model"] == "base" and body["seed"] == 9
    assert body["top_p"] == 1.0  # greedy: top-p must not reshape the reported distribution
    assert (body["top_k"], body["min_p"], body["repetition_penalty"]) == (0, 0.0, 1.0)
    assert (body["presence_penalty"], body["frequency_penalty"]) == (0.0, 0.0)
    assert body["stop_token_ids"] == [2, 7] and body["stop"] == ["END"]
    assert body["return_token_ids"] and body["return_tokens_as_token_ids"] and not body["skip_special_tokens"]


@pytest.mark.parametrize("temperature", [0.6, 0.3, 1.5])
def test_the_tail_bracket_never_accepts_a_value_outside_the_tolerance(temperature):
    """Unlikely response tokens (ranked far below the probe's top-k) must not loosen the bound on the tail."""
    fake = FakeVLLM(seed=3)
    try:
        engine = VLLMEngine(fake.url, "base", max_context=4096, vocab_size=VOCAB, max_logprobs=20, score_probe_k=5,
                            score_tolerance=1e-3)
        generator = torch.Generator().manual_seed(5)
        # Each response token is one of the 50 least likely ids at its position.
        response = [int(fake.logprobs(2 + t).argsort()[torch.randint(0, 50, (1,), generator=generator)])
                    for t in range(64)]
        request = ScoreRequest([1, 2], response, top_k=4, temperature=temperature)
        (result,) = asyncio.run(engine.score([request]))
        logprobs_T, _, top_T_K, _ = expected(fake, request)
        if temperature < 1:  # above 1 the bracket is loose and exact requests settle (nearly) every position
            assert engine.stats["score_position"] < 64  # some positions were settled by the bracket alone
        assert float((result.logprobs_T.double() - logprobs_T).abs().max()) <= 1e-3 + 1e-5
        assert float((result.topk_logprobs_T_K.double() - top_T_K).abs().max()) <= 1e-3 + 1e-5
    finally:
        fake.close()
