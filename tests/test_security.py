"""Security: TLS and mutual TLS on the gRPC port, bearer tokens, and model names that would
leave the repository.

A server with mutual TLS, an admin token (from the environment) and an infer token (from a
file) runs as ``batchgate serve`` in both modes (one process; a supervisor with a front end),
with certificates made for the test by the ``openssl`` command. Its whole log, at debug level,
is kept, to show that no token ever reaches it. tritonclient, with ``ssl=True``, runs in a
subprocess (it cannot share a process with our protos).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from batchgate.batcher.errors import InvalidRequest, ModelNotFound
from batchgate.clients import AsyncClient, BatchgateError, Client, RetryPolicy
from batchgate.protos import inference_pb2 as pb
from batchgate.protos import inference_pb2_grpc, wire_pb2
from batchgate.server.frontend.auth import accepted_tokens, bearer_token
from batchgate.server.executor.repository import ModelRepository
from batchgate.server.config.settings import Settings
from batchgate.bench.harness.server import ServeProcess, start_process
from batchgate.bench.harness.repository import renamed, write_model
from tests.support import EXAMPLE_MODELS
from tests.support.models import FAILING_CONFIG, FAILING_MODEL, reference
from tests.support.servers import SERVER_MODES, native_or_skip, start_server

ADMIN_TOKEN = secrets.token_hex(20)
INFER_TOKEN = secrets.token_urlsafe(24)
WRONG_TOKEN = secrets.token_hex(20)
NO_RETRY = RetryPolicy(max_attempts=1)
X = np.random.default_rng(7).standard_normal((2, 512), dtype=np.float32)


def small_repository(root: Path) -> Path:
    """``mlp`` from the examples and ``spare`` (y = x + 1) to load and unload."""
    shutil.copytree(EXAMPLE_MODELS / "mlp", root / "mlp",
                    ignore=shutil.ignore_patterns("__pycache__"))
    write_model(root, renamed(FAILING_CONFIG, "spare"), FAILING_MODEL)
    return root


class Secured:
    """A ``batchgate serve`` process with mutual TLS and both tokens."""

    def __init__(self, mode: str, process: ServeProcess, port: int, pki: dict) -> None:
        self.mode, self.process, self.port, self.pki = mode, process, port, pki
        self.address = f"127.0.0.1:{self.port}"

    def client(self, *, token: str | None = None, client_cert: bool = True, **kw) -> Client:
        certs = dict(certificate_chain=self.pki["client_cert"],
                     private_key=self.pki["client_key"]) if client_cert else {}
        return Client(self.address, timeout_s=30, retry=NO_RETRY,
                      root_certificates=self.pki["ca"], token=token, **certs, **kw)


@pytest.fixture(scope="module", params=SERVER_MODES)
def secured(request, tmp_path_factory, pki):
    root = tmp_path_factory.mktemp(f"secured-{request.param}")
    repository = small_repository(root / "models")
    token_file = root / "infer-token"
    token_file.write_text(INFER_TOKEN + "\n")
    env = {**os.environ, "BATCHGATE_ADMIN_TOKEN": ADMIN_TOKEN}
    arena = [] if request.param == "single" else ["--arena-bytes", str(64 << 20)]
    if request.param == "native":
        native_or_skip()
    running = start_process(repository, request.param, env=env, extra_args=[
        *arena,
        "--tls-cert", str(pki["server_cert"]), "--tls-key", str(pki["server_key"]),
        "--tls-client-ca", str(pki["ca"]), "--infer-token-file", str(token_file),
        "--log-level", "debug", "--no-gc-freeze", "--drain-timeout-s", "5"])
    listening = running.supervisor.wait_for("listening")
    assert (listening["tls"], listening["admin_token"], listening["infer_token"]) == (
        "mutual", True, True)
    yield Secured(request.param, running.supervisor, running.grpc_port, pki)
    running.stop()  # fails unless it exits 0


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(BatchgateError) as err:
        call()
    return err.value.code


# -- TLS ---------------------------------------------------------------------------------------


def test_mutual_tls_client_with_the_token_is_answered(secured):
    with secured.client(token=INFER_TOKEN) as client:
        out = client.infer("mlp", {"INPUT__0": X})["OUTPUT__0"]
    np.testing.assert_allclose(out, reference("mlp", X), rtol=1e-4, atol=1e-5)


def test_plaintext_client_is_refused(secured):
    with Client(secured.address, timeout_s=10, retry=NO_RETRY, token=INFER_TOKEN) as client:
        assert code_of(lambda: client.infer("mlp", {"INPUT__0": X})) is grpc.StatusCode.UNAVAILABLE


def test_tls_client_without_a_client_certificate_is_refused(secured):
    with secured.client(token=INFER_TOKEN, client_cert=False) as client:
        assert code_of(lambda: client.server_live()) is grpc.StatusCode.UNAVAILABLE


def test_client_certificate_of_another_ca_is_refused(secured):
    with Client(secured.address, timeout_s=10, retry=NO_RETRY, token=INFER_TOKEN,
                root_certificates=secured.pki["ca"],
                certificate_chain=secured.pki["rogue_cert"],
                private_key=secured.pki["rogue_key"]) as client:
        assert code_of(lambda: client.server_live()) is grpc.StatusCode.UNAVAILABLE


def test_client_that_does_not_trust_the_server_is_refused(secured):
    # The system's CAs did not sign the test server's certificate.
    with Client(secured.address, timeout_s=10, retry=NO_RETRY, tls=True, token=INFER_TOKEN,
                certificate_chain=secured.pki["client_cert"],
                private_key=secured.pki["client_key"]) as client:
        assert code_of(lambda: client.server_live()) is grpc.StatusCode.UNAVAILABLE


def test_tls_without_client_certificates(pki, tmp_path):
    """TLS alone (no --tls-client-ca): any client that trusts the server's CA is served."""
    running = start_server(small_repository(tmp_path / "models"),
                           tls_cert=pki["server_cert"], tls_key=pki["server_key"])
    try:
        with Client(running.address, timeout_s=30, retry=NO_RETRY,
                    root_certificates=pki["ca"].read_bytes()) as client:
            out = client.infer("mlp", {"INPUT__0": X})["OUTPUT__0"]
            np.testing.assert_allclose(out, reference("mlp", X), rtol=1e-4, atol=1e-5)
            assert client.health() == "SERVING"
        with Client(running.address, timeout_s=10, retry=NO_RETRY) as plaintext:
            assert code_of(plaintext.server_live) is grpc.StatusCode.UNAVAILABLE
    finally:
        running.stop()


TRITONCLIENT_TLS = textwrap.dedent('''
    import json, os, sys
    import numpy as np
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    url, ca, cert, key, out_dir = sys.argv[1:6]
    headers = {"authorization": "Bearer " + os.environ["TOKEN"]}
    client = grpcclient.InferenceServerClient(
        url=url, ssl=True, root_certificates=ca, certificate_chain=cert, private_key=key)
    out = {"live": client.is_server_live()}
    x = np.load(out_dir + "/x.npy")
    inp = grpcclient.InferInput("INPUT__0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    np.save(out_dir + "/y.npy", client.infer("mlp", [inp], headers=headers).as_numpy("OUTPUT__0"))
    out["ready"] = client.is_model_ready("mlp", headers=headers)
    try:
        client.infer("mlp", [inp])
    except InferenceServerException as e:
        out["without_token"] = e.status()
    plain = grpcclient.InferenceServerClient(url=url)
    try:
        plain.is_server_live()
    except InferenceServerException as e:
        out["plaintext"] = e.status()
    print(json.dumps(out))
''')


def test_tritonclient_with_ssl(secured, tmp_path):
    np.save(tmp_path / "x.npy", X)
    done = subprocess.run(
        [sys.executable, "-c", TRITONCLIENT_TLS, secured.address, str(secured.pki["ca"]),
         str(secured.pki["client_cert"]), str(secured.pki["client_key"]), str(tmp_path)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "TOKEN": INFER_TOKEN},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["live"] and out["ready"]
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), reference("mlp", X),
                               rtol=1e-4, atol=1e-5)
    assert out["without_token"] == "StatusCode.UNAUTHENTICATED"
    assert out["plaintext"] == "StatusCode.UNAVAILABLE"


# -- bearer tokens -----------------------------------------------------------------------------


def test_admin_rpcs_need_the_admin_token(secured):
    with secured.client() as anonymous, secured.client(token=WRONG_TOKEN) as wrong, \
            secured.client(token=INFER_TOKEN) as inferer, \
            secured.client(token=ADMIN_TOKEN) as admin:
        for client, code in ((anonymous, grpc.StatusCode.UNAUTHENTICATED),
                             (wrong, grpc.StatusCode.PERMISSION_DENIED),
                             (inferer, grpc.StatusCode.PERMISSION_DENIED)):
            assert code_of(lambda: client.unload_model("spare")) is code
            assert code_of(lambda: client.load_model("spare")) is code
            # A load that brings its own files needs the admin token as any other does.
            assert code_of(lambda: client.load_model(
                "spare", config="{}", files={"1/model.py": b"raise SystemExit"})) is code
            assert code_of(lambda: client.repository_index()) is code
        with pytest.raises(BatchgateError) as err:
            anonymous.unload_model("spare")
        assert "authorization: Bearer <token>" in err.value.details
        assert admin.model_ready("spare")  # the refused unloads did nothing
        admin.unload_model("spare")
        assert not admin.model_ready("spare")
        assert {m.name: m.state for m in admin.repository_index()}["spare"] == "UNAVAILABLE"
        admin.load_model("spare")
        assert admin.model_ready("spare")


def test_shared_memory_rpcs_need_the_admin_token(secured):
    """They open files and device memory on the server's host by name: the infer token does not
    open them. (This server does not serve shared memory: past the token, UNIMPLEMENTED.)"""
    credentials = grpc.ssl_channel_credentials(
        secured.pki["ca"].read_bytes(), secured.pki["client_key"].read_bytes(),
        secured.pki["client_cert"].read_bytes())
    calls = (("SystemSharedMemoryStatus", pb.SystemSharedMemoryStatusRequest()),
             ("SystemSharedMemoryRegister", pb.SystemSharedMemoryRegisterRequest(name="r")),
             ("SystemSharedMemoryUnregister", pb.SystemSharedMemoryUnregisterRequest()),
             ("CudaSharedMemoryStatus", pb.CudaSharedMemoryStatusRequest()),
             ("CudaSharedMemoryRegister", pb.CudaSharedMemoryRegisterRequest()),
             ("CudaSharedMemoryUnregister", pb.CudaSharedMemoryUnregisterRequest()))
    with grpc.secure_channel(secured.address, credentials) as channel:
        stub = inference_pb2_grpc.GRPCInferenceServiceStub(channel)
        for rpc, request in calls:
            for token, code in ((None, grpc.StatusCode.UNAUTHENTICATED),
                                (INFER_TOKEN, grpc.StatusCode.PERMISSION_DENIED),
                                (ADMIN_TOKEN, grpc.StatusCode.UNIMPLEMENTED)):
                metadata = [("authorization", f"Bearer {token}")] if token else []
                with pytest.raises(grpc.RpcError) as err:
                    getattr(stub, rpc)(request, metadata=metadata, timeout=30)
                assert err.value.code() is code, (rpc, token is ADMIN_TOKEN)


def test_inference_rpcs_need_a_token(secured):
    with secured.client() as anonymous, secured.client(token=WRONG_TOKEN) as wrong, \
            secured.client(token=ADMIN_TOKEN) as admin:
        for client, code in ((anonymous, grpc.StatusCode.UNAUTHENTICATED),
                             (wrong, grpc.StatusCode.PERMISSION_DENIED)):
            assert code_of(lambda: client.infer("mlp", {"INPUT__0": X})) is code
            assert code_of(lambda: client.model_metadata("mlp")) is code
            assert code_of(lambda: client.model_statistics("mlp")) is code
            with client.stream_infer([]) as stream:
                assert code_of(lambda: list(stream)) is code
        # The admin token opens everything the infer token does.
        out = admin.infer("mlp", {"INPUT__0": X})["OUTPUT__0"]
        np.testing.assert_allclose(out, reference("mlp", X), rtol=1e-4, atol=1e-5)


def test_health_and_liveness_stay_open_for_probes(secured):
    with secured.client() as anonymous:
        assert anonymous.health() == "SERVING"
        assert anonymous.health("mlp") == "SERVING"
        assert anonymous.server_live() and anonymous.server_ready()


def test_bearer_scheme_is_case_insensitive_and_others_are_refused(secured):
    credentials = grpc.ssl_channel_credentials(
        secured.pki["ca"].read_bytes(), secured.pki["client_key"].read_bytes(),
        secured.pki["client_cert"].read_bytes())
    with grpc.secure_channel(secured.address, credentials) as channel:
        stub = inference_pb2_grpc.GRPCInferenceServiceStub(channel)
        request = pb.ModelMetadataRequest(name="mlp")
        meta = stub.ModelMetadata(request, metadata=[("authorization", f"bearer {INFER_TOKEN}")],
                                  timeout=30)
        assert meta.name == "mlp"
        for value in (f"Basic {INFER_TOKEN}", INFER_TOKEN, "Bearer", "Bearer  "):
            with pytest.raises(grpc.RpcError) as err:
                stub.ModelMetadata(request, metadata=[("authorization", value)], timeout=30)
            assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED, value


async def test_async_client_sends_the_token_over_tls(secured):
    async with AsyncClient(secured.address, timeout_s=30, retry=NO_RETRY, token=INFER_TOKEN,
                           root_certificates=secured.pki["ca"],
                           certificate_chain=secured.pki["client_cert"],
                           private_key=secured.pki["client_key"]) as client:
        out = (await client.infer("mlp", {"INPUT__0": X}))["OUTPUT__0"]
        np.testing.assert_allclose(out, reference("mlp", X), rtol=1e-4, atol=1e-5)
    async with AsyncClient(secured.address, timeout_s=30, retry=NO_RETRY,
                           root_certificates=secured.pki["ca"],
                           certificate_chain=secured.pki["client_cert"],
                           private_key=secured.pki["client_key"]) as anonymous:
        with pytest.raises(BatchgateError) as err:
            await anonymous.infer("mlp", {"INPUT__0": X})
        assert err.value.code is grpc.StatusCode.UNAUTHENTICATED


def test_tokens_never_reach_the_log_or_a_command_line(secured):
    """The whole debug log, after right and wrong tokens on every kind of RPC, holds neither
    token; nor does any process's command line (the admin token came from the environment,
    the infer token from a file)."""
    with secured.client(token=WRONG_TOKEN) as wrong, secured.client(token=ADMIN_TOKEN) as admin:
        admin.infer("mlp", {"INPUT__0": X})
        code_of(lambda: wrong.infer("mlp", {"INPUT__0": X}))
        code_of(lambda: wrong.unload_model("spare"))
        code_of(lambda: admin.infer("nope", {"INPUT__0": X}))  # logged at debug as failed
    process = secured.process
    pids = [process.proc.pid, *process.pids("frontend").values(), *process.pids("executor").values()]
    assert len(pids) == (1 if secured.mode == "single" else 3)
    for pid in pids:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        environ = Path(f"/proc/{pid}/environ").read_bytes()
        for token in (ADMIN_TOKEN, INFER_TOKEN, WRONG_TOKEN):
            assert token.encode() not in cmdline
            if pid != process.proc.pid:  # children get them in their handover only
                assert token.encode() not in environ
    assert any(b"rpc_refused" in line for line in process.lines)  # debug lines were written
    log = b"".join(process.lines)
    for token in (ADMIN_TOKEN, INFER_TOKEN, WRONG_TOKEN):
        assert token.encode() not in log


def test_which_rpcs_each_token_opens():
    both = dict(admin_token="a" * 16, infer_token="i" * 16)
    assert accepted_tokens("RepositoryModelLoad", **both) == ("a" * 16,)
    assert accepted_tokens("ModelInfer", **both) == ("i" * 16, "a" * 16)
    assert accepted_tokens("ServerLive", **both) == ()
    assert accepted_tokens("ModelInfer", admin_token="a" * 16, infer_token=None) == ()
    assert accepted_tokens("RepositoryIndex", admin_token=None, infer_token="i" * 16) == (
        "i" * 16,)
    assert bearer_token((("x", "y"), ("authorization", "Bearer t0k"))) == "t0k"
    assert bearer_token((("authorization", "Basic t0k"),)) == ""
    assert bearer_token(()) is None


@pytest.mark.parametrize("token, message", [
    ("short", r"at least 16 characters .*, got 5"),
    ("with a space in it, long enough", "visible ASCII"),
])
def test_weak_or_malformed_tokens_are_refused_without_being_echoed(model_repository, token,
                                                                   message):
    with pytest.raises(ValueError, match=message) as err:
        Settings(model_repository=model_repository, admin_token=token)
    assert token not in str(err.value)


def test_token_from_file_and_environment_conflict(tmp_path, monkeypatch):
    from batchgate.server.cli import read_token

    path = tmp_path / "t"
    path.write_text(f"  {ADMIN_TOKEN}\n")
    assert read_token("admin", path) == ADMIN_TOKEN
    monkeypatch.setenv("BATCHGATE_ADMIN_TOKEN", INFER_TOKEN)
    assert read_token("admin", None) == INFER_TOKEN
    with pytest.raises(ValueError, match="got both"):
        read_token("admin", path)


def test_tls_settings_are_checked(pki, model_repository, tmp_path):
    with pytest.raises(ValueError, match="tls_cert and tls_key go together"):
        Settings(model_repository=model_repository, tls_cert=pki["server_cert"])
    with pytest.raises(ValueError, match="readable file"):
        Settings(model_repository=model_repository, tls_cert=tmp_path / "missing.pem",
                 tls_key=pki["server_key"])
    not_pem = tmp_path / "cert.txt"
    not_pem.write_text("not a certificate")
    done = subprocess.run(
        [sys.executable, "-m", "batchgate.server.cli", "serve", "--frontend", "single", "--host", "127.0.0.1",
         "--grpc-port", "0", "--metrics-port", "-1", "--model-repository", str(tmp_path),
         "--tls-cert", str(not_pem), "--tls-key", str(pki["server_key"])],
        cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "tls_cert must be a PEM file" in done.stderr


# -- model names that would leave the repository --------------------------------------------


TRAVERSALS = ["../models", "../../etc", "/etc", "/tmp", "a/b", "mlp/../mlp", "a\\b", "..\\x",
              "m\x00", ".", "..", "", ".hidden", "x" * 256]


@pytest.mark.parametrize("name", TRAVERSALS, ids=repr)
def test_load_and_unload_refuse_names_that_leave_the_repository(server, name):
    with Client(server.address, timeout_s=30, retry=NO_RETRY) as client:
        for call in (client.load_model, client.unload_model):
            with pytest.raises(BatchgateError) as err:
                call(name)
            assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT, name
            assert "plain folder name" in err.value.details
        # Lookups by such names find nothing, and say so (not INTERNAL).
        assert not client.model_ready(name)
        assert code_of(lambda: client.model_metadata(name)) is grpc.StatusCode.NOT_FOUND


def test_a_model_folder_linked_from_outside_the_repository_is_served(server, model_repository,
                                                                    tmp_path):
    """The operator's links are followed: model stores and volume mounts are laid out so."""
    outside = write_model(tmp_path, renamed(FAILING_CONFIG, "linked"), FAILING_MODEL,
                          folder="outside")
    link = model_repository / "linked"
    link.symlink_to(outside, target_is_directory=True)
    try:
        with Client(server.address, timeout_s=60, retry=NO_RETRY) as client:
            client.load_model("linked")
            x = np.ones((1, 2), np.float32)
            np.testing.assert_array_equal(client.infer("linked", {"INPUT__0": x})["OUTPUT__0"], x + 1)
            client.unload_model("linked")
    finally:
        link.unlink()


def test_symlink_inside_the_repository_is_served(server, model_repository):
    """A link that stays inside (here into a hidden folder of the repository) is fine."""
    store = model_repository / ".store" / "alias"
    if not store.exists():
        write_model(store.parent, renamed(FAILING_CONFIG, "alias"), FAILING_MODEL)
    link = model_repository / "alias"
    link.symlink_to(store, target_is_directory=True)
    try:
        with Client(server.address, timeout_s=60, retry=NO_RETRY) as client:
            client.load_model("alias")
            x = np.ones((1, 2), np.float32)
            np.testing.assert_array_equal(client.infer("alias", {"INPUT__0": x})["OUTPUT__0"], x + 1)
            client.unload_model("alias")
    finally:
        link.unlink()


async def test_repository_skips_a_loop_of_links(tmp_path):
    root = tmp_path / "repo"
    root.mkdir()
    (root / "loop").symlink_to(root / "loop")
    repository = ModelRepository(root, cuda_available=False)
    await repository.load_all()
    assert repository.index() == []
    with pytest.raises(ModelNotFound):
        await repository.load("loop")


def test_health_check_of_a_long_name_is_not_an_error(server):
    with grpc.insecure_channel(server.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Check(health_pb2.HealthCheckRequest(service="x" * 300), timeout=30)
        assert err.value.code() is grpc.StatusCode.NOT_FOUND


# -- the executor's socket -------------------------------------------------------------------


# Sends one frame of the wire (its bytes in hex), prints whether anything came back.
WIRE_CLIENT = textwrap.dedent('''
    import socket, struct, sys
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect("\\0" + sys.argv[1])
    body = bytes.fromhex(sys.argv[2])
    sock.settimeout(30)
    try:
        sock.sendall(struct.pack("<I", len(body)) + body)
        print("answered" if sock.recv(4096) else "closed")
    except (ConnectionResetError, BrokenPipeError):
        print("closed")
''')


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and setpriv to connect as another user")
def test_another_user_cannot_talk_to_the_executor(secured):
    """The executor listens on an abstract Unix socket, which has no file permissions: a
    process of another user must not reach it (it could unload models past the admin token)."""
    if secured.mode == "single":
        pytest.skip("one process: there is no executor socket")
    name = next(e["socket"] for e in secured.process.events
                if e.get("event") == "executor_ready")

    def call(frame: wire_pb2.ToExecutor, user: list[str]) -> str:
        done = subprocess.run([*user, "/usr/bin/python3", "-c", WIRE_CLIENT, name,
                               frame.SerializeToString().hex()],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    index = wire_pb2.ToExecutor(call=[wire_pb2.Call(cid=1, index=pb.RepositoryIndexRequest())])
    unload = wire_pb2.ToExecutor(call=[wire_pb2.Call(
        cid=1, unload=pb.RepositoryModelUnloadRequest(model_name="spare"))])
    assert call(index, user=[]) == "answered"  # the same user: the check lets it through
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    assert call(unload, user=nobody) == "closed"
    with secured.client(token=ADMIN_TOKEN) as admin:
        assert admin.model_ready("spare")
