"""``weightsync.Controller``: the job's controller in this process. It serves on the ports it
says (port 0: a free one), hides its tokens from ``repr``, stops on ``close()`` and at the end of
a ``with`` block, and refuses to start with a typed error naming what is wrong."""

from __future__ import annotations

import json
import socket
import urllib.request
from pathlib import Path

import pytest

import weightsync

CONFIG = {"model_type": "qwen3", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 320,
          "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


@pytest.fixture
def config(tmp_path: Path) -> str:
    p = tmp_path / "config.json"
    p.write_text(json.dumps(CONFIG))
    return str(p)


def healthz(url: str) -> object:
    with urllib.request.urlopen(url + "/healthz", timeout=10) as r:
        return json.loads(r.read())


def workers(c: weightsync.Controller) -> dict:
    with urllib.request.urlopen(c.http_url + "/v1/workers", timeout=10) as r:
        return json.loads(r.read())


def test_serves_on_free_ports_and_stops(config: str) -> None:
    with weightsync.Controller(model=config, train="fsdp=2", infer="tp=1,dp=2,format=hf") as c:
        host, port = c.control_address.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0, c.control_address
        assert c.http_url.startswith("http://127.0.0.1:") and not c.http_url.endswith(":0")
        assert (c.trainers, c.engines) == (2, 2)
        assert c.running
        healthz(c.http_url)
        assert c.client().healthz() is not None
        with socket.create_connection(("127.0.0.1", int(port)), timeout=5):
            pass
        assert len(c.job_token) >= 32 and len(c.api_token) >= 32 and c.job_token != c.api_token
        r = repr(c)
        assert c.job_token not in r and c.api_token not in r and "running" in r, r
    assert not c.running
    with pytest.raises(OSError):
        healthz(c.http_url)
    c.close()  # idempotent


def test_given_tokens_are_used(config: str) -> None:
    with weightsync.Controller(config, "fsdp=2", "tp=1,dp=2,format=hf", job_token="j" * 20,
                               api_token="a" * 20) as c:
        assert (c.job_token, c.api_token) == ("j" * 20, "a" * 20)
        with pytest.raises(weightsync.ClientError) as e:
            weightsync.Client(c.http_url, "wrong").sync(1)
        assert e.value.status == 401, e.value
        with pytest.raises(weightsync.ClientError) as e:
            c.client().sync(1)
        assert e.value.code == "not_ready", e.value


def test_a_taken_port_names_the_address(config: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = f"127.0.0.1:{s.getsockname()[1]}"
        with pytest.raises(weightsync.ControllerError) as e:
            weightsync.Controller(config, "fsdp=2", "tp=1,dp=2,format=hf", control=taken)
        assert e.value.address == taken and taken in str(e.value) and "control" in str(e.value), e.value
        with pytest.raises(weightsync.ControllerError) as e:
            weightsync.Controller(config, "fsdp=2", "tp=1,dp=2,format=hf", http=taken)
        assert e.value.address == taken and "HTTP" in str(e.value), e.value
    assert isinstance(e.value, weightsync.SyncError)


def test_a_bad_layout_names_it(config: str) -> None:
    with pytest.raises(weightsync.ControllerError, match="fsdp=two") as e:
        weightsync.Controller(config, "fsdp=two", "tp=1")
    assert e.value.address is None
    # Heads (4) do not split over tp=3.
    with pytest.raises(weightsync.ControllerError, match="tp=3"):
        weightsync.Controller(config, "fsdp=2", "tp=3")


def test_a_bad_delta_mode_names_it(config: str) -> None:
    with pytest.raises(ValueError, match="sometimes") as e:
        weightsync.Controller(config, "fsdp=2", "tp=1,dp=2,format=hf", delta="sometimes")
    assert "auto, on or off" in str(e.value), e.value


def test_an_unknown_model_names_it() -> None:
    with pytest.raises(weightsync.ControllerError, match="no-such-model"):
        weightsync.Controller("no-such-model", "fsdp=2", "tp=1")
    with pytest.raises(weightsync.ControllerError, match="dtype"):
        weightsync.Controller("qwen3-0.6b", "fsdp=2", "tp=1", dtype="int3")


def test_each_role_has_its_own_secret_and_an_engine_secret_cannot_register_a_trainer(config: str) -> None:
    with weightsync.Controller(config, "fsdp=1", "tp=1,dp=1,format=hf", role_secrets=True) as c:
        tokens = {c.job_token, c.trainer_token, c.engine_token, c.fabric_token, c.api_token}
        assert len(tokens) == 5, "role_secrets=True gives every role a secret of its own"
        r = repr(c)
        assert not any(t in r for t in tokens), r
        assert c.worker_token("trainer") == c.trainer_token
        env = c.worker_env("engine")
        assert env["WEIGHTSYNC_ENGINE_TOKEN"] == c.engine_token
        assert env["WEIGHTSYNC_FABRIC_TOKEN"] == c.fabric_token
        assert not {c.trainer_token, c.api_token} & set(env.values()), "an engine host got too much"
        with pytest.raises(ValueError, match="role must be"):
            c.worker_env("admin")
        # An engine's secret presented by a trainer is refused, naming why; nothing registers.
        with pytest.raises(weightsync.ConnectError, match="rollout credential cannot register a trainer"):
            weightsync.Trainer(c.control_address, 0, job_token=c.engine_token, fabric_token=c.fabric_token)
        assert workers(c)["missing"] == ["trainer-0", "rollout-0"], workers(c)
        # The right one is accepted.
        t = weightsync.Trainer(c.control_address, 0, job_token=c.trainer_token, fabric_token=c.fabric_token)
        assert t.worker_id == "trainer-0"
