"""batchgate behind a real nginx (gRPC load balancing), with real replica processes under load.

Two single-process replicas serve the example ``mlp``; nginx (Debian's, installed by
``scripts/install-nginx.sh``) balances over them with ``grpc_pass``, as ``deploy/compose`` does.
Closed-loop SDK clients load it through nginx while replicas are restarted one at a time
(SIGTERM: drain, exit 0, a new process on the same port) or killed with SIGKILL. Every answer is
checked against the model's own output, and no request may be lost: what a draining replica
refuses (UNAVAILABLE) the SDK retries; what a dead one cannot take nginx sends to the other.

nginx's access log records each attempt that reached it (HTTP status, grpc-status, the
upstream(s) tried), so the test reports how many attempts the SDK had to retry and how many
nginx re-routed itself.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
from collections import Counter
from pathlib import Path

import pytest
import yaml

from batchgate.clients import BatchgateError, Client, RetryPolicy
from batchgate.bench.harness.server import ServeProcess
from batchgate.bench.harness.metrics import metrics_url, scrape, total
from tests.support import EXAMPLE_MODELS, ROOT
from tests.support.load import Load
from tests.support.polling import poll

# Slow (servers behind a real nginx): make test-fast leaves it out.
pytestmark = pytest.mark.slow

# The SDK's retries carry what a stopping or killed replica had in flight to the other one.
# A replaced replica (one process) listens while its model loads, answering UNAVAILABLE
# "loading" until it is ready, and nginx spreads attempts over both replicas: a request is
# lost only if every attempt lands on the loading one, (1/2)^attempts, so attempts are many.
RETRY = RetryPolicy(max_attempts=20, initial_backoff_s=0.02, max_backoff_s=0.5)

COMPOSE = ROOT / "deploy" / "compose"
NGINX = shutil.which("nginx") or next(
    (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None)

# The test's nginx: the directives of deploy/compose/nginx.conf that matter, on loopback, with
# every path in the temp dir and a short fail_timeout so that the test stays short.
NGINX_TEMPLATE = """
{user}
worker_processes 1;
error_log {dir}/error.log warn;
pid {dir}/nginx.pid;
events {{ worker_connections 1024; }}
http {{
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    log_format attempts escape=json '{{"status":"$status","grpc":"$upstream_http_grpc_status",'
        '"grpc_trailer":"$upstream_trailer_grpc_status","upstream":"$upstream_addr",'
        '"upstream_status":"$upstream_status","uri":"$request_uri"}}';
    access_log {dir}/access.log attempts;

    upstream batchgate {{
{servers}
{keepalive}
    }}
    server {{
        listen 127.0.0.1:{port} http2;
        client_max_body_size 64m;
        keepalive_requests 100000;
        grpc_connect_timeout 2s;
        grpc_send_timeout 30s;
        grpc_read_timeout 30s;
        grpc_next_upstream {next_upstream};
        grpc_next_upstream_tries 3;
        grpc_next_upstream_timeout 10s;
        location / {{ grpc_pass grpc://batchgate; }}
    }}
}}
"""
NEXT_UPSTREAM = "error timeout invalid_header non_idempotent"
# No keepalive connections to the replicas, on purpose (as in deploy/compose/nginx.conf): with
# them, a request nginx sends on a kept connection just as a replica's drain closes its gRPC server
# is answered grpc-status 1 CANCELLED by grpc core (not retryable: 1-2 per rolling restart, seen in
# 3 runs of 4). With a connection per request, a replica that stops listening is refused at
# connect and nginx goes to the other one itself.
UPSTREAM_KEEPALIVE = ""
INFER_URI = "/inference.GRPCInferenceService/ModelInfer"


def nginx_missing() -> str | None:
    """Why nginx cannot run these tests, or None."""
    if NGINX is None:
        return "nginx is not installed (bash scripts/install-nginx.sh, or make tools)"
    version = subprocess.run([NGINX, "-V"], capture_output=True, text=True, check=False).stderr
    if "--with-http_v2_module" not in version or "--without-http_grpc_module" in version:
        return f"this nginx cannot proxy gRPC (needs http_v2 and grpc modules): {version[:200]}"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Replica:
    """One batchgate process (single-process mode) serving ``mlp`` only."""

    def __init__(self, repository: Path, grpc_port: int = 0) -> None:
        self.process = ServeProcess(
            "serve", "--host", "127.0.0.1", "--grpc-port", str(grpc_port), "--metrics-port", "0",
            "--model-repository", str(repository), "--drain-timeout-s", "10",
            "--log-format", "json", "--frontend", "single", "--no-gc-freeze")
        self.grpc_port = grpc_port
        self.metrics_port = 0

    def wait_serving(self) -> Replica:
        try:
            self.process.wait_for("serving", 120)
        except BaseException:
            self.process.proc.kill()
            raise
        # Single-process mode logs its ports on "listening" (before the models load).
        listening = self.process.wait_for("listening", 5)
        self.grpc_port, self.metrics_port = listening["grpc_port"], listening["metrics_port"]
        return self

    def requests(self) -> float:
        return total(scrape(metrics_url(self.metrics_port), timeout_s=5),
                     "batchgate_requests_total", status="OK")

    def stop(self) -> int:
        return self.process.stop()

    def kill(self) -> None:
        if self.process.proc.poll() is None:
            self.process.proc.kill()
        self.process.proc.wait(30)


class Nginx:
    def __init__(self, directory: Path, upstream_ports: list[int]) -> None:
        self.dir = directory
        self.port = free_port()
        servers = "\n".join(f"        server 127.0.0.1:{p} max_fails=1 fail_timeout=2s;"
                            for p in upstream_ports)
        user = "user root;" if os.geteuid() == 0 else ""
        self.conf = directory / "nginx.conf"
        self.conf.write_text(NGINX_TEMPLATE.format(
            user=user, dir=directory, servers=servers, port=self.port,
            next_upstream=NEXT_UPSTREAM, keepalive=UPSTREAM_KEEPALIVE))
        self.proc = subprocess.Popen(
            [NGINX, "-p", str(directory), "-e", str(directory / "error.log"), "-c", str(self.conf),
             "-g", "daemon off;"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def wait_live(self, timeout_s: float = 30) -> None:
        with Client(self.address, timeout_s=2, retry=RetryPolicy(max_attempts=1)) as client:
            def live() -> bool:
                if self.proc.poll() is not None:
                    raise AssertionError(f"nginx exited {self.proc.returncode}: "
                                         f"{self.proc.stderr.read()} {self.error_log()}")
                try:
                    return client.server_live()
                except BatchgateError:
                    return False

            try:
                poll(live, timeout_s, "nginx live", interval_s=0.05)
            except AssertionError as exc:
                raise AssertionError(f"{exc}: {self.error_log()}") from None

    def error_log(self) -> str:
        path = self.dir / "error.log"
        return path.read_text()[-2000:] if path.exists() else ""

    def attempts(self) -> list[dict]:
        """One record per ModelInfer attempt nginx answered (the SDK's retries included)."""
        path = self.dir / "access.log"
        if not path.exists():
            return []
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return [r for r in records if r["uri"] == INFER_URI]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)  # graceful: finish what is in flight
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def summarize(attempts: list[dict]) -> dict:
    """What nginx saw: attempts by (HTTP status, grpc-status), and how many it re-routed."""
    outcome = Counter()
    for a in attempts:
        grpc_status = a["grpc"] or a["grpc_trailer"] or "-"
        outcome[f"http {a['status']} grpc {grpc_status}"] += 1
    rerouted = sum(1 for a in attempts if "," in a["upstream"])
    return {"attempts": len(attempts), "by_status": dict(outcome), "nginx_rerouted": rerouted,
            "failed_attempts": sum(n for k, n in outcome.items() if k != "http 200 grpc 0")}


class Cluster:
    def __init__(self, repository: Path, directory: Path) -> None:
        self.repository = repository
        self.replicas: list[Replica] = []
        self.nginx: Nginx | None = None
        self.dir = directory

    def start(self) -> None:
        starting = [Replica(self.repository), Replica(self.repository)]
        self.replicas = starting  # owned from here on, for teardown
        for replica in starting:
            replica.wait_serving()
        self.nginx = Nginx(self.dir, [r.grpc_port for r in self.replicas])
        self.nginx.wait_live()

    def replace(self, index: int) -> Replica:
        """A new replica on the old one's port (free once the old one has exited)."""
        port = self.replicas[index].grpc_port
        self.replicas[index] = Replica(self.repository, grpc_port=port)
        return self.replicas[index].wait_serving()

    def close(self) -> None:
        if self.nginx is not None:
            self.nginx.stop()
        for replica in self.replicas:
            if replica.process.proc.poll() is None:
                try:
                    replica.stop()
                except subprocess.TimeoutExpired:
                    replica.kill()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = nginx_missing()
    if reason:
        pytest.skip(reason)
    repository = tmp_path_factory.mktemp("nginx-models")
    shutil.copytree(EXAMPLE_MODELS / "mlp", repository / "mlp",
                    ignore=shutil.ignore_patterns("__pycache__"))
    cluster = Cluster(repository, tmp_path_factory.mktemp("nginx"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.close()


def test_rolling_restart_through_nginx_loses_nothing(cluster):
    nginx = cluster.nginx
    phases = {}
    log_start = len(nginx.attempts())
    with Load(nginx.address, retry=RETRY) as load:
        phases["before"] = load.progress(100, 30, "load through nginx")
        for index, name in ((0, "A"), (1, "B")):
            old = cluster.replicas[index]
            marker = load.answered()
            code = old.stop()  # SIGTERM: drain (UNAVAILABLE to new requests), exit
            assert code == 0, f"replica {name} exited {code}"
            phases[f"{name} stopped"] = load.answered() - marker
            marker = load.answered()
            new = cluster.replace(index)
            phases[f"{name} restarting"] = load.answered() - marker
            # The new process on the same port takes traffic again (nginx retries it after
            # fail_timeout), and the load keeps flowing.
            poll(lambda new=new: new.requests() >= 20, 30,
                 f"new replica {name} serving through nginx")
            phases[f"{name} back"] = load.progress(100, 30, f"load after replica {name} came back")
    report = summarize(nginx.attempts()[log_start:])
    print(f"rolling restart: ok={load.ok} wrong={load.wrong} failures={dict(load.failures)} "
          f"phases={phases} nginx={report}")
    assert load.wrong == 0
    for name in ("before", "A back", "B back"):
        assert phases[name] >= 100, phases
    # Both replicas stayed in service behind nginx: some answers came while each was away.
    assert phases["A restarting"] + phases["A stopped"] > 0, phases
    assert phases["B restarting"] + phases["B stopped"] > 0, phases
    # A call that reaches a replica just as its drain stops the gRPC server is answered
    # CANCELLED by grpc itself (nginx logs "http 200 grpc 1" from that replica); the SDK retries
    # it like UNAVAILABLE, so no request may be lost.
    assert not load.failures, load.failure_details[:5]


def test_kill_9_of_a_replica_under_load_through_nginx(cluster):
    nginx = cluster.nginx
    log_start = len(nginx.attempts())
    with Load(nginx.address, retry=RETRY) as load:
        load.progress(100, 30, "load through nginx")
        victim = cluster.replicas[1]
        victim.kill()  # SIGKILL: its in-flight requests' connections are reset
        after_kill = load.progress(100, 30, "load after the kill (the other replica)")
        survivor_before = cluster.replicas[0].requests()
        new = cluster.replace(1)
        poll(lambda: new.requests() >= 20, 30, "the restarted replica serving through nginx")
        load.progress(50, 30, "load after the restart")
    report = summarize(nginx.attempts()[log_start:])
    print(f"kill -9: ok={load.ok} wrong={load.wrong} failures={dict(load.failures)} "
          f"after_kill={after_kill} survivor_ok_before_restart={survivor_before:.0f} nginx={report}")
    assert load.wrong == 0
    # Only what was in flight on the killed replica could fail, and idempotent inference is
    # retried (by nginx on a reset connection, else by the SDK): nothing fails in the end.
    assert not load.failures, load.failure_details[:5]


def test_compose_files_agree():
    compose = yaml.safe_load((COMPOSE / "compose.yaml").read_text())
    services = compose["services"]
    for name, service in services.items():
        assert service.get("image") or service.get("build"), f"{name}: no image or build"
    replicas = [n for n, s in services.items() if s.get("build")]
    assert len(replicas) == 2, replicas
    for name in replicas:
        build = services[name]["build"]
        context = COMPOSE / (build["context"] if isinstance(build, dict) else build)
        assert (context / build.get("dockerfile", "Dockerfile")).is_file()
        command = services[name]["command"]
        assert command[command.index("--metrics-port") + 1] == "8002"
        assert command[command.index("--grpc-port") + 1] == "8001"

    mounts = {m.split(":")[1]: COMPOSE / m.split(":")[0] for m in services["nginx"]["volumes"]}
    nginx_conf = mounts["/etc/nginx/nginx.conf"]
    assert nginx_conf.is_file()
    text = nginx_conf.read_text()
    assert "grpc_pass grpc://batchgate" in text and "http2" in text
    for name in replicas:
        assert f"server {name}:8001" in text, f"nginx upstream lacks {name}"
    assert "8001:8001" in services["nginx"]["ports"]

    prometheus_mounts = {m.split(":")[1]: COMPOSE / m.split(":")[0]
                         for m in services["prometheus"]["volumes"]}
    prometheus = yaml.safe_load(prometheus_mounts["/etc/prometheus/prometheus.yml"].read_text())
    targets = {t for job in prometheus["scrape_configs"] for sc in job["static_configs"]
               for t in sc["targets"]}
    assert targets == {f"{name}:8002" for name in replicas}, targets

    grafana = {m.split(":")[1]: COMPOSE / m.split(":")[0] for m in services["grafana"]["volumes"]}
    provisioning = grafana["/etc/grafana/provisioning"]
    datasource = yaml.safe_load(
        (provisioning / "datasources" / "prometheus.yaml").read_text())["datasources"][0]
    assert datasource["type"] == "prometheus" and "prometheus:9090" in datasource["url"]
    provider = yaml.safe_load(
        (provisioning / "dashboards" / "batchgate.yaml").read_text())["providers"][0]
    dashboard_dir = provider["options"]["path"]
    dashboards = {target: source for target, source in grafana.items()
                  if target.startswith(dashboard_dir + "/")}
    assert dashboards, f"nothing mounted under {dashboard_dir}"
    for source in dashboards.values():
        assert source.is_file(), source
        json.loads(source.read_text())


def test_compose_nginx_conf_is_valid_for_nginx():
    """The compose nginx.conf passes ``nginx -t`` (replica names pointed at loopback)."""
    reason = nginx_missing()
    if reason:
        pytest.skip(reason)
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        text = (COMPOSE / "nginx.conf").read_text()
        text = text.replace("batchgate-a:", "127.0.0.1:").replace("batchgate-b:", "127.0.0.1:")
        text = text.replace("/tmp/nginx.pid", f"{directory}/nginx.pid")
        text = text.replace("/dev/stderr", f"{directory}/error.log")
        text = text.replace("access_log /dev/stdout", f"access_log {directory}/access.log")
        conf = Path(directory) / "nginx.conf"
        conf.write_text(text)
        result = subprocess.run(
            [NGINX, "-t", "-p", directory, "-e", f"{directory}/error.log", "-c", str(conf)],
            capture_output=True, text=True, timeout=30, check=False)
        assert result.returncode == 0, result.stderr
