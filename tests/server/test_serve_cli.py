"""`specserve serve`: flag precedence (command line > YAML > SPECSERVE_* env > defaults), the shipped
presets, and the real command in a subprocess."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from specserve.cli import build_parser, engine_kwargs
from specserve.config import engine_config_from_args
from specserve.server.cli import load_yaml_config, resolve_serve_args
from tests.server.harness import free_port, wait_until_healthy

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _resolve(argv: list[str], env: dict[str, str]):
    args = build_parser().parse_args(["serve", *argv])
    return resolve_serve_args(args, env)


def test_precedence_command_line_over_yaml_over_env_over_defaults(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("port: 8500\nmax-model-len: 512\napi_key: from-yaml\nenable-prefix-caching: false\n"
                   "kv-cache-memory: 64M\nspeculative-config: {method: ngram, num_speculative_tokens: 2}\n")
    env = {"SPECSERVE_PORT": "7000", "SPECSERVE_HOST": "0.0.0.0", "SPECSERVE_MAX_MODEL_LEN": "1024",
           "SPECSERVE_MAX_NUM_SEQS": "8", "SPECSERVE_API_KEY": "from-env"}
    a = _resolve(["--port", "9000", "--config", str(cfg)], env)
    assert a.port == 9000  # command line
    assert a.max_model_len == 512 and a.api_key == "from-yaml" and a.enable_prefix_caching is False  # YAML
    assert a.kv_cache_memory == 64 << 20
    assert a.host == "0.0.0.0" and a.max_num_seqs == 8  # environment
    assert a.dtype == "auto" and a.block_size == 16 and a.model is None  # defaults
    config = engine_config_from_args(model=a.model, **engine_kwargs(a))
    assert config.spec.num_speculative_tokens == 2 and config.cache.enable_prefix_caching is False
    assert config.scheduler.async_drafting is False  # off unless asked for
    a = _resolve(["--async-drafting", "--no-async-scheduling"], {})
    config = engine_config_from_args(model=a.model, **engine_kwargs(a))
    assert config.scheduler.async_drafting is True and config.scheduler.async_scheduling is False


def test_env_and_yaml_values_are_checked(tmp_path):
    assert _resolve([], {"SPECSERVE_ENABLE_PREFIX_CACHING": "off", "SPECSERVE_MODEL": "m"}).model == "m"
    assert _resolve([], {"SPECSERVE_ENABLE_PREFIX_CACHING": "off"}).enable_prefix_caching is False
    env = {"SPECSERVE_ENABLE_PREFIX_CACHING": "0"}
    assert _resolve(["--enable-prefix-caching"], env).enable_prefix_caching
    with pytest.raises(ValueError, match="SPECSERVE_PORT"):
        _resolve([], {"SPECSERVE_PORT": "eighty"})
    with pytest.raises(ValueError, match="SPECSERVE_DTYPE"):
        _resolve([], {"SPECSERVE_DTYPE": "float8"})
    bad = tmp_path / "bad.yaml"
    bad.write_text("prot: 80\n")
    with pytest.raises(ValueError, match="unknown key 'prot'"):
        load_yaml_config(bad)
    bad.write_text("port: [1, 2]\n")
    with pytest.raises(ValueError, match="port"):
        load_yaml_config(bad)


@pytest.mark.parametrize("preset", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_presets_build_valid_configs(preset):
    a = _resolve(["--config", str(CONFIGS / preset)], {})
    config = engine_config_from_args(model=a.model, **engine_kwargs(a))
    assert a.host == "127.0.0.1"
    if "spec" in preset:
        assert config.spec is not None and config.spec.method == "draft_model"
        assert config.model.load_format == "dummy" and config.device == "cuda"


def test_specserve_serve_subprocess(tiny_chat_dir, tmp_path):
    port = free_port()
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"port: {port}\ndtype: float32\ndevice: cpu\nnum-kv-blocks: 32\n"
                   "served-model-name: tiny-cli\n")
    env = dict(os.environ, SPECSERVE_API_KEY="k1", SPECSERVE_PORT="1")  # YAML's port wins over the env's
    cmd = [sys.executable, "-m", "specserve.cli", "serve", str(tiny_chat_dir), "--config", str(cfg)]
    proc = subprocess.Popen(cmd,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_healthy(port, proc, proc.stdout.read)
        denied = httpx.post(url + "/v1/completions", json={"prompt": "ab", "max_tokens": 2})
        ok = httpx.post(url + "/v1/completions", json={"model": "tiny-cli", "prompt": "ab", "max_tokens": 2,
                                                       "ignore_eos": True},
                        headers={"Authorization": "Bearer k1"}, timeout=60)
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    assert denied.status_code == 401
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    assert proc.returncode == 0, out
    assert f"serving tiny-cli on http://127.0.0.1:{port}" in out and "is ready" in out and "stopped" in out


def test_serve_reports_bad_flags_before_listening(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "specserve.cli", "serve", "--block-size", "3", "--port",
                           str(free_port())], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "block_size" in proc.stderr


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command for a test certificate")
def test_vllm_style_flags_tls_names_root_path_chat_template(tiny_chat_dir, tmp_path):
    """`--ssl-keyfile/--ssl-certfile` (HTTPS), several `--served-model-name`s, `--root-path`,
    `--chat-template` (a file), `--enable-chunked-prefill`, `--uvicorn-log-level`, on the real command."""
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1"], check=True, capture_output=True)
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}")
    port = free_port()
    cmd = [sys.executable, "-m", "specserve.cli", "serve", str(tiny_chat_dir), "--port", str(port), "--dtype",
           "float32", "--device", "cpu", "--num-kv-blocks", "32", "--served-model-name", "first", "second",
           "--ssl-keyfile", str(key), "--ssl-certfile", str(cert), "--root-path", "/api",
           "--chat-template", str(template), "--enable-chunked-prefill", "--uvicorn-log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"https://127.0.0.1:{port}"
    try:
        wait_until_healthy(port, proc, proc.stdout.read, scheme="https", verify=False)  # a self-signed certificate
        answers = [httpx.post(url + "/v1/chat/completions", verify=False, timeout=60,
                              json={"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                    "ignore_eos": True})
                   for name in ("first", "second")]
        models = httpx.get(url + "/v1/models", verify=False).json()
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
    assert answers[0].json()["usage"]["prompt_tokens"] == len("<<hi>>")  # the template was used (char tokenizer)
    assert models["data"][0]["id"] == "first"
    assert f"serving first on https://127.0.0.1:{port}/api" in out


def test_chunked_prefill_cannot_be_turned_off():
    from specserve import LLM
    with pytest.raises(ValueError, match="always chunks prefill"):
        LLM(enable_chunked_prefill=False)
