"""One model over two ranks (issue 9): `mlx.launch --backend ring -n 2 -- mlx-server --parallel pipeline`
on this machine's loopback, against the same model in one process.

SmolLM2 (all 30 layers) is exported as an MLX folder whose weights are split into two files; each
rank reads only its own layers. Both servers must give the same greedy tokens: plain, streamed,
4 clients at once, with stop strings and a JSON schema, and after a cancelled stream.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import CACHE, READY, ServerProcess

LAUNCH = str(Path(sys.executable).with_name("mlx.launch"))
QUESTIONS = [
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "Write one sentence about the sea.",
    "What is 2 + 2?",
]


def ring_port() -> int:
    """A port p with p and p+1 free (mlx.launch's ring backend listens on one port per rank)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            p = a.getsockname()[1]
        if p > 65000:
            continue
        try:
            with socket.socket() as b:
                b.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")


def launch_group(model_dir: Path, *args: str, parallel: str = "pipeline") -> ServerProcess:
    """Two ranks started by `mlx.launch --backend ring -n 2` (the way users start them)."""
    launcher = [LAUNCH, "--backend", "ring", "-n", "2", "-p", str(ring_port()), "--"]
    return ServerProcess("--model", str(model_dir), "--parallel", parallel, "--model-id", "smol", *args, launcher=launcher)


class RankGroup(ServerProcess):
    """Two ranks started directly, with the variables mlx.launch would set (MLX_RANK, MLX_HOSTFILE).

    mlx.launch 0.32's output threads poll their child's stdin, which is always writable, so each
    spins on a CPU core for as long as the group lives; on a 2-core test machine that halves the
    model's speed, so the long-lived groups here are started without it. Rank 1's lines join rank 0's."""

    def __init__(self, model_dir: Path, *args: str, tmp: Path, parallel: str = "pipeline", netns: str | None = None,
                 ips: tuple[str, str] = ("127.0.0.1", "127.0.0.1")):
        ring = ring_port()
        ports = (ring, ring + 1) if ips[0] == ips[1] else (ring, ring)
        hostfile = tmp / f"hosts-{ring}.json"
        hostfile.write_text(json.dumps([[f"{ips[0]}:{ports[0]}"], [f"{ips[1]}:{ports[1]}"]]))
        common = ["--model", str(model_dir), "--parallel", parallel, "--model-id", "smol", *args]
        super().__init__(*common, env={"MLX_RANK": "0", "MLX_HOSTFILE": str(hostfile)})
        cmd = [sys.executable, "-m", "mlx_server", "--port", str(self.port), *common]
        self.follower = subprocess.Popen(
            (["ip", "netns", "exec", netns] if netns else []) + cmd,
            env={**os.environ, "MLX_RANK": "1", "MLX_HOSTFILE": str(hostfile)},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        threading.Thread(target=lambda: [self.lines.append(line.rstrip("\n")) for line in self.follower.stdout], daemon=True).start()

    def stop(self):
        super().stop()  # rank 0 stops the group: rank 1 follows it out
        try:
            self.follower.wait(15)
        except subprocess.TimeoutExpired:
            self.follower.kill()
            self.follower.wait()


@pytest.fixture(scope="module")
def sharded_dir(gguf_path) -> Path:
    from mlx_server.engine.gguf import export_mlx_dir

    out = CACHE / "models" / "smollm2-135m-2shards"
    if not (out / "model.safetensors.index.json").exists():
        export_mlx_dir(gguf_path, out, shards=2)
    return out


@pytest.fixture(scope="module")
def single(sharded_dir):
    server = ServerProcess("--model", str(sharded_dir), "--model-id", "smol").wait_ready()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def group(sharded_dir, tmp_path_factory):
    server = RankGroup(sharded_dir, tmp=tmp_path_factory.mktemp("ranks")).wait_ready(timeout=180)
    yield server
    server.stop()
    assert server.follower.returncode == 0, "\n".join(server.lines)


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=120, max_retries=0)


def ask(server, question: str, stream: bool = False, **extra) -> tuple[str, str]:
    kwargs = dict(model="smol", messages=[{"role": "user", "content": question}], temperature=0, max_tokens=24, **extra)
    if not stream:
        r = client(server).chat.completions.create(**kwargs)
        return r.choices[0].message.content, r.choices[0].finish_reason
    text, finish = "", None
    for chunk in client(server).chat.completions.create(stream=True, **kwargs):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


@pytest.fixture(scope="module")
def expected(single):
    """One process's greedy answers, asked one at a time."""
    return {q: ask(single, q) for q in QUESTIONS}


def test_each_rank_holds_half_the_layers(group):
    loaded = [line for line in group.lines if "Model loaded" in line]
    assert any("rank 0 of 2 holds layers 15-29 of 30" in line for line in loaded), loaded
    assert any("[rank 1]" in line and "rank 1 of 2 holds layers 0-14 of 30" in line for line in loaded), loaded
    # Only rank 0 serves HTTP: one pair of readiness lines.
    assert sum(READY in line for line in group.lines) == 1


def weights_mib(lines: list[str]) -> list[float]:
    """The weight sizes the start-up 'Memory:' lines report, in MiB."""
    return [float(m.group(1)) for line in lines if (m := re.search(r"Memory: .* weights ([\d.]+) MiB", line))]


def test_each_rank_holds_only_its_share_of_the_weights(group, single):
    (whole,) = weights_mib(single.lines)
    ranks = weights_mib(group.lines)
    assert len(ranks) == 2
    # Half the layers each, plus the embedding table both keep (a fifth of SmolLM2's weights).
    for part in ranks:
        assert part < 0.65 * whole, (ranks, whole)


def test_same_greedy_tokens_plain_and_streamed(group, expected):
    for q in QUESTIONS:
        assert ask(group, q) == expected[q], q
    for q in QUESTIONS[:2]:
        assert ask(group, q, stream=True) == expected[q], q


def test_four_concurrent_clients(group, expected):
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda q: ask(group, q, stream=q.startswith("W")), QUESTIONS))
    assert answers == [expected[q] for q in QUESTIONS]


def test_stop_strings_and_json_schema_match(single, group):
    stop = dict(stop=["Paris", " is"])
    assert ask(group, QUESTIONS[0], **stop) == ask(single, QUESTIONS[0], **stop)
    schema = {
        "type": "json_schema",
        "json_schema": {"name": "city", "schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
    }
    answer = ask(group, "Reply in JSON: which city is the capital of France?", response_format=schema)
    assert answer == ask(single, "Reply in JSON: which city is the capital of France?", response_format=schema)
    if answer[1] == "stop":
        assert "city" in json.loads(answer[0])


def test_cancelled_stream_leaves_the_group_in_step(group, expected):
    # Start a long answer, read a little, hang up mid-stream, while other clients keep going.
    body = {"model": "smol", "messages": [{"role": "user", "content": "Tell me a long story about a dragon."}],
            "temperature": 0, "max_tokens": 400, "stream": True}
    with ThreadPoolExecutor(2) as pool:
        others = [pool.submit(ask, group, q) for q in QUESTIONS[:2]]
        with httpx.Client(timeout=60) as http, http.stream("POST", group.url + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            for i, _ in enumerate(r.iter_lines()):
                if i >= 6:
                    break
        assert [f.result() for f in others] == [expected[q] for q in QUESTIONS[:2]]
    # The cancellation reached both ranks at the same step: later answers are still identical.
    for q in QUESTIONS:
        assert ask(group, q) == expected[q], q


def test_prefix_cache_works_across_ranks(group):
    messages = [{"role": "user", "content": "Describe a lighthouse in two sentences."}]
    first = client(group).chat.completions.create(model="smol", messages=messages, temperature=0, max_tokens=16)
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "And a harbour?"}]
    second = client(group).chat.completions.create(model="smol", messages=messages, temperature=0, max_tokens=16)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens


def test_sampled_answers_are_seeded_the_same_on_every_rank(group, single):
    # temperature 1 with a seed: rank 0 and rank 1 must draw the same tokens, or the group would
    # detect that it is out of step and fail; and the seed gives the single process's answer.
    q = dict(temperature=1.0, seed=1234)
    kwargs = dict(model="smol", messages=[{"role": "user", "content": QUESTIONS[2]}], max_tokens=24, **q)
    a = client(group).chat.completions.create(**kwargs).choices[0].message.content
    b = client(single).chat.completions.create(**kwargs).choices[0].message.content
    assert a == b
    # Without a seed the answer is random but the group stays in step.
    del kwargs["seed"]
    assert client(group).chat.completions.create(**kwargs).choices[0].finish_reason in ("stop", "length")
    assert ask(group, QUESTIONS[0])[1] in ("stop", "length")


def rank_pid(server: ServerProcess, rank: int) -> int:
    for line in server.lines:
        m = re.search(rf"rank {rank} of 2 \(pid (\d+)\)", line)
        if m:
            return int(m.group(1))
    raise AssertionError("no pid line for rank %d:\n%s" % (rank, "\n".join(server.lines)))


def test_killing_rank_1_mid_stream_gives_an_error_and_the_group_exits(sharded_dir):
    server = launch_group(sharded_dir).wait_ready(timeout=180)
    try:
        rank0, rank1 = rank_pid(server, 0), rank_pid(server, 1)
        eos = client(server).models.list()  # the server answers before the kill
        assert eos.data
        body = {"model": "smol", "messages": [{"role": "user", "content": "Tell me a long story about a dragon."}],
                "temperature": 0, "max_tokens": 2000, "stream": True, "logit_bias": {"2": -100}}
        # A non-streamed request in flight at the same time must get a 503, not hang.
        with ThreadPoolExecutor(1) as pool:
            plain = pool.submit(httpx.post, server.url + "/v1/chat/completions", json={**body, "stream": False}, timeout=30)
            events, error, t_kill = stream_until_error(server, body, lambda: os.kill(rank1, signal.SIGKILL))
            plain = plain.result()
        assert plain.status_code == 503, plain.text
        assert re.search("distributed group failed|shutting down", plain.json()["error"]["message"])
        assert t_kill is not None, "the stream ended before rank 1 was killed"
        assert error is not None, "the stream ended without an error after rank 1 died"
        assert "distributed group failed" in error["message"] or "shutting down" in error["message"]
        # A finished answer was not faked: no finish_reason stop/length after the kill.
        assert not any(c.get("finish_reason") in ("stop", "length") for e in events for c in e.get("choices", []))
        server.proc.wait(timeout=max(1.0, 10 - (time.monotonic() - t_kill)))
        assert time.monotonic() - t_kill < 10
        with pytest.raises(ProcessLookupError):
            os.kill(rank0, 0)
        assert any("distributed group failed" in line for line in server.all_lines()), "\n".join(server.lines)
    finally:
        server.stop()


def stream_until_error(server, body, kill):
    """Stream `body`; after 5 events call `kill`; returns (events, the error event's error, when killed)."""
    events, error, t_kill = [], None, None
    with httpx.Client(timeout=30) as http, http.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                events.append(event)
                if "error" in event:
                    error = event["error"]
                    break
                if len(events) == 5:
                    kill()
                    t_kill = time.monotonic()
    return events, error, t_kill


def test_a_hung_rank_is_given_up_after_peer_timeout(sharded_dir):
    # Rank 1 stops answering without closing its connections (SIGSTOP): rank 0 gives up after
    # --peer-timeout, ends the stream with an error and exits non-zero.
    timeout = 8  # well above one step of this model, even on a slow shared machine
    server = launch_group(sharded_dir, "--peer-timeout", str(timeout)).wait_ready(timeout=180)
    rank1 = rank_pid(server, 1)
    try:
        body = {"model": "smol", "messages": [{"role": "user", "content": "Tell me a long story about a dragon."}],
                "temperature": 0, "max_tokens": 2000, "stream": True, "logit_bias": {"2": -100}}
        events, error, t_stop = stream_until_error(server, body, lambda: os.kill(rank1, signal.SIGSTOP))
        assert t_stop is not None and error is not None
        assert "stopped answering" in error["message"]
        assert time.monotonic() - t_stop < timeout + 10
        deadline = time.monotonic() + 10
        while not any("server stopped" in line for line in server.lines) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert any("server stopped" in line for line in server.lines), "\n".join(server.lines)
    finally:
        try:
            os.kill(rank1, signal.SIGCONT)
        except ProcessLookupError:
            pass
        server.stop()


def test_a_model_that_cannot_be_split_that_way_is_a_clear_startup_error(sharded_dir):
    # SmolLM2 has 9 query and 3 key/value heads: no even tensor-parallel split over 2 ranks.
    server = launch_group(sharded_dir, parallel="tensor")
    try:
        out = "\n".join(server.all_lines(120)) + server.stderr()
        assert "attention heads to divide evenly over 2 ranks" in out
        assert "9 query and 3 key/value heads" in out
        assert READY not in out
    finally:
        server.stop()


def test_a_gguf_file_is_refused_with_a_clear_message(gguf_path):
    server = ServerProcess("--model", str(gguf_path), "--parallel", "pipeline",
                           launcher=[LAUNCH, "--backend", "ring", "-n", "2", "-p", str(ring_port()), "--"])
    try:
        out = "\n".join(server.all_lines(120)) + server.stderr()
        assert "--parallel needs an MLX model folder" in out
        assert READY not in out
    finally:
        server.stop()


def test_mismatched_files_on_a_rank_are_a_startup_error(sharded_dir, tmp_path):
    # Two "machines" with different copies of the model: rank 1's config says something else.
    other = tmp_path / "other"
    other.mkdir()
    for f in sharded_dir.iterdir():
        (other / f.name).symlink_to(f)
    (other / "config.json").unlink()
    config = json.loads((sharded_dir / "config.json").read_text())
    config["rms_norm_eps"] = 1e-6
    (other / "config.json").write_text(json.dumps(config))
    port, ring = free_ports()
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{ring}"], [f"127.0.0.1:{ring + 1}"]]))
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "mlx_server", "--model", str(d), "--parallel", "pipeline", "--port", str(port)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)},
        )
        for rank, d in enumerate([sharded_dir, other])
    ]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
        assert all(p.returncode != 0 for p in procs), outs
        assert all("the ranks do not agree" in out for out in outs), outs
        assert not any(READY in out for out in outs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def test_a_rank_that_never_comes_is_a_startup_error_not_a_hang(sharded_dir, tmp_path):
    # Rank 0 alone, told of a rank 1 that never starts: it gives up after --peer-timeout.
    port, ring = free_ports()
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{ring}"], [f"127.0.0.1:{ring + 1}"]]))
    proc = subprocess.run(
        [sys.executable, "-m", "mlx_server", "--model", str(sharded_dir), "--parallel", "pipeline",
         "--port", str(port), "--peer-timeout", "3"],
        env={**os.environ, "MLX_RANK": "0", "MLX_HOSTFILE": str(hostfile)}, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode != 0
    assert "waiting up to 3 s for every rank" in proc.stdout
    assert READY not in proc.stdout


def free_ports() -> tuple[int, int]:
    from tests.conftest import free_port

    return free_port(), ring_port()


# ---- two "hosts": network namespaces joined by a veth pair ----

NS = "mlxsrv9"


def _netns_available() -> str | None:
    """None when this machine lets us make a network namespace and a veth pair, else why not."""
    if os.geteuid() != 0:
        return "needs root for ip netns"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    r = subprocess.run(["ip", "netns", "add", NS + "probe"], capture_output=True, text=True)
    if r.returncode != 0:
        return f"ip netns add failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", NS + "probe"], capture_output=True)
    return None


@pytest.fixture
def two_hosts():
    """Rank 0's host is this namespace (10.77.0.1), rank 1's a new one (10.77.0.2), joined by a veth pair."""
    why = _netns_available()
    if why:
        pytest.skip(f"this machine cannot make network namespaces ({why})")
    cmds = [
        f"ip netns add {NS}",
        f"ip link add {NS}a type veth peer name {NS}b",
        f"ip link set {NS}b netns {NS}",
        f"ip addr add 10.77.0.1/24 dev {NS}a",
        f"ip link set {NS}a up",
        f"ip -n {NS} addr add 10.77.0.2/24 dev {NS}b",
        f"ip -n {NS} link set {NS}b up",
        f"ip -n {NS} link set lo up",
    ]
    try:
        for c in cmds:
            subprocess.run(c.split(), check=True, capture_output=True)
        yield NS
    finally:
        subprocess.run(["ip", "link", "del", f"{NS}a"], capture_output=True)
        subprocess.run(["ip", "netns", "del", NS], capture_output=True)


def test_two_network_namespaces(two_hosts, sharded_dir, expected, tmp_path):
    server = RankGroup(sharded_dir, tmp=tmp_path, netns=two_hosts, ips=("10.77.0.1", "10.77.0.2"))
    try:
        server.wait_ready(timeout=180)
        assert any("[rank 1]" in line and "rank 1 of 2 holds layers 0-14" in line for line in server.lines), server.lines
        for q in QUESTIONS[:2]:
            assert ask(server, q) == expected[q]
        assert ask(server, QUESTIONS[2], stream=True) == expected[QUESTIONS[2]]
    finally:
        server.stop()
    # Rank 0 stopped the group: rank 1 followed it out cleanly.
    assert server.follower.returncode == 0, "\n".join(server.lines)


# ---- tensor parallel: every layer split over the ranks ----


@pytest.fixture(scope="module")
def tensor_model_dir(sharded_dir) -> Path:
    """A small llama with SmolLM2's tokenizer and random weights whose heads split over 2 ranks
    (4 query, 2 key/value heads); SmolLM2 itself (9 and 3) cannot be split that way."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map
    from mlx_lm.models import llama
    from mlx_lm.utils import save_config

    out = CACHE / "models" / "llama-tiny-tensor-v1"
    if (out / "config.json").exists():
        return out
    config = json.loads((sharded_dir / "config.json").read_text())
    config.pop("quantization", None)
    config.pop("quantization_config", None)
    config.update(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32)
    mx.random.seed(7)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    model.update(tree_map(lambda p: mx.random.normal(p.shape) * 0.05, model.parameters()))
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    save_config(config, out / "config.json")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (out / f).write_bytes((sharded_dir / f).read_bytes())
    return out


def test_tensor_parallel_gives_the_same_greedy_tokens(tensor_model_dir, tmp_path):
    single = ServerProcess("--model", str(tensor_model_dir), "--model-id", "smol").wait_ready()
    try:
        want = [ask(single, q) for q in QUESTIONS[:2]]
    finally:
        single.stop()
    group = RankGroup(tensor_model_dir, tmp=tmp_path, parallel="tensor").wait_ready(timeout=180)
    try:
        assert any("tensor parallel: rank 0 of 2" in line for line in group.lines)
        assert [ask(group, q) for q in QUESTIONS[:2]] == want
        with ThreadPoolExecutor(2) as pool:
            assert list(pool.map(lambda q: ask(group, q, stream=True), QUESTIONS[:2])) == want
    finally:
        group.stop()
