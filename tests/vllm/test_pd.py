"""P/D disaggregation on CPU: two real vLLM pods with NixlConnector (NIXL over UCX on loopback, CPU
KV buffers). The prefill leg on pod A, the decode leg on pod B with A's ``kv_transfer_params``; B's
KV events then report the pulled blocks, so the precise index predicts B's next hit exactly.

Runs last, on its own two pods (the session's pods are stopped first: two cores)."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import Iterator

import httpx
import pytest

from bench.sim.tokenizer import HFTokenizer
from bench.vllm_pods import MODEL_NAME, VLLMPod, chat, free_port, start_pods
from extproc.index.precise import PreciseIndex
from extproc.pd import PREFILL_PARAMS
from tests.vllm.conftest import VLLM_PYTHON
from tests.vllm.harness import request_keys, save_result, send_chat
from tests.vllm.recorder import RecordingSink, subscriber_for

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.restarts_pods]

KV_TRANSFER = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"})


def _nixl_env() -> dict[str, str]:
    return {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
        "UCX_NET_DEVICES": "lo",  # UCX would otherwise listen on every interface
    }


@pytest.fixture(scope="module")
def pd_pods(pods: list[VLLMPod], model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[VLLMPod]]:
    for p in pods:  # free the cores; nothing runs after this module
        p.stop()
    assert VLLM_PYTHON
    if subprocess.run([VLLM_PYTHON, "-c", "import nixl._api"], check=False).returncode != 0:
        pytest.fail("the nixl package is missing from .venv-vllm (make vllm-venv installs it)")
    workdir = tmp_path_factory.mktemp("vllm-pd")
    started = start_pods(
        VLLM_PYTHON, model_dir, 2, workdir, ["--kv-transfer-config", KV_TRANSFER], lambda _: _nixl_env()
    )
    try:
        yield started
    finally:
        for p in started:
            p.stop()


async def test_nixl_prefill_then_decode(pd_pods: list[VLLMPod], tok: HFTokenizer, aclient: httpx.AsyncClient) -> None:
    prefill, decode = pd_pods
    sink = RecordingSink(PreciseIndex(capacity_blocks=1 << 14))
    subs = [subscriber_for(p.address, p.pub_address, p.replay_address, sink) for p in pd_pods]
    for s in subs:
        await s.start()
    await asyncio.sleep(0.3)
    try:
        msgs = chat(900, 400)
        tokens = tok.render_chat([dict(m) for m in msgs], None)
        headers = {"X-Request-Id": "pd-test-1"}
        body = {"model": MODEL_NAME, "messages": msgs, "max_tokens": 1, "stream": False}
        r = await aclient.post(
            f"{prefill.url}/v1/chat/completions", json={**body, "kv_transfer_params": PREFILL_PARAMS}, headers=headers
        )
        r.raise_for_status()
        kvp = r.json()["kv_transfer_params"]
        assert kvp["do_remote_prefill"] is True and kvp["remote_block_ids"], kvp
        assert kvp["remote_host"] == "127.0.0.1", kvp
        r = await aclient.post(
            f"{decode.url}/v1/chat/completions",
            json={**body, "max_tokens": 8, "kv_transfer_params": kvp},
            headers=headers,
        )
        r.raise_for_status()
        usage = r.json()["usage"]
        # The decode leg reports the prefill leg's own hits (passed in kv_transfer_params), not the
        # pulled blocks: 0 here, as bench.sim reports it (tests/sim/test_pd.py).
        pulled = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        assert kvp.get("remote_prefill_cached_tokens") == 0 and pulled == 0, (kvp, usage)
        full = request_keys(tokens, None, lookup=False)
        await sink.wait_for(lambda: sink.index.match(full, [decode.address]).get(decode.address, 0) == len(full))
        again = await send_chat(aclient, decode.url, tok, decode.address, msgs, index=sink.index, sink=sink)
        assert again.predicted_tokens == again.cached_tokens > 0, again
        save_result(
            "pd",
            {"prompt_tokens": len(tokens), "decode_leg_cached": pulled, "decode_repeat_cached": again.cached_tokens},
        )
    finally:
        for s in subs:
            await s.aclose()
