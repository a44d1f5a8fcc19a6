"""The official ``openai`` client against the gateway (2 sim replicas)."""

from __future__ import annotations

import time

import openai
import pytest
from rollout_testbed.sim.config import SimConfig
from rollout_testbed.sim.latency import LatencyModel

from tests.cluster import cluster
from tests.conftest import CLIENT_KEY


async def test_openai_client_end_to_end() -> None:
    slow = SimConfig(latency=LatencyModel(decode=0.04))
    async with cluster(2, sim_config=slow, api_key=CLIENT_KEY) as c:
        client = openai.AsyncOpenAI(base_url=f"{c.url}/v1", api_key=CLIENT_KEY, max_retries=0)
        async with client:
            completion = await client.completions.create(
                model="tiny-base", prompt="The capital of France is", n=4, max_tokens=3
            )
            assert len(completion.choices) == 4
            assert sorted(ch.index for ch in completion.choices) == [0, 1, 2, 3]

            chat = await client.chat.completions.create(
                model="tiny-base",
                messages=[{"role": "user", "content": "Say hi"}],
                max_tokens=3,
            )
            assert chat.choices[0].message.role == "assistant"
            assert chat.choices[0].message.content

            started = time.perf_counter()
            first: float | None = None
            deltas = []
            stream = await client.chat.completions.create(
                model="tiny-base",
                messages=[{"role": "user", "content": "Count"}],
                max_tokens=20,
                stream=True,
            )
            async for chunk in stream:
                if first is None:
                    first = time.perf_counter() - started
                if chunk.choices and chunk.choices[0].delta.content:
                    deltas.append(chunk.choices[0].delta.content)
            total = time.perf_counter() - started
            assert first is not None and len(deltas) >= 10
            # 20 tokens x 40 ms upstream: the first chunk is relayed long before the end.
            assert total - first > 0.4, (first, total)  # not a ratio: a stall delays both

            with pytest.raises(openai.NotFoundError):
                await client.completions.create(model="no-such-model", prompt="x", max_tokens=1)

            bad = openai.AsyncOpenAI(base_url=f"{c.url}/v1", api_key="sk-wrong", max_retries=0)
            async with bad:
                with pytest.raises(openai.AuthenticationError):
                    await bad.models.list()
