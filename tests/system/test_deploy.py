"""The deployment files, checked as far as a machine without a container engine allows.

- docker-compose.yml and deploy/docker-compose.gpu.yml validate against the Compose
  Specification JSON schema (the copy check-jsonschema ships, offline), and their
  wiring agrees with the Dockerfile, the settings table and the Prometheus config;
- deploy/redis.conf and the Kubernetes Redis config load in a real redis-server;
- deploy/k8s/ validates strictly against the Kubernetes schemas kubernetes-validate
  ships (the oldest release with native gRPC probes and the newest it knows), and
  its probes, grace period and memory sizing agree with its ConfigMap;
- the server started exactly as the compose ``kvserve`` service declares (Dockerfile
  ENTRYPOINT + compose command, image + compose environment; only the Redis host, the
  ports and, while no default model is packaged, the model are rewritten) completes a
  two-turn session whose second turn is restored from Redis after a restart;
- the Dockerfile's HEALTHCHECK command, run as a subprocess, tells SERVING, draining,
  unknown service and down apart.
"""

from __future__ import annotations

import copy
import json
import math
import re
import shlex
import signal
import subprocess
import sys
import tomllib
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import kubernetes_validate
import pytest
import redis
import yaml

from kvserve.clients import KVServeClient
from kvserve.proto.kvserve.v1 import generation_pb2 as pb
from kvserve.service.config import ServerConfig, env_name, parse_bytes
from kvserve.service.engine.config import DEFAULT_MODEL_DIR
from tests.fixtures.redis_server import free_port, redis_server_binary
from tests.fixtures.serving import REPO, ServerThread, subprocess_env, tiny_config, wait_until

COMPOSE = REPO / "docker-compose.yml"
GPU_OVERRIDE = REPO / "deploy" / "docker-compose.gpu.yml"
DOCKERFILE = REPO / "deploy" / "Dockerfile"
REDIS_CONF = REPO / "deploy" / "redis.conf"
PROMETHEUS = REPO / "deploy" / "prometheus.yml"
K8S = REPO / "deploy" / "k8s"
# Native gRPC probes are GA from 1.27; the newest is what kubernetes-validate ships.
K8S_VERSIONS = ("1.27.0", kubernetes_validate.latest_version())
SETTING_ENV_NAMES = {env_name(f) for f in ServerConfig.__dataclass_fields__}


# ----------------------------------------------------------------------------- parsing helpers


@dataclass(frozen=True)
class Dockerfile:
    """The instructions of one Dockerfile, continuation lines joined: [(INSTRUCTION, args)]."""

    instructions: list[tuple[str, str]]

    @classmethod
    def parse(cls, path: Path) -> Dockerfile:
        out: list[tuple[str, str]] = []
        pending = ""
        for raw in path.read_text().splitlines():
            line = raw.strip()
            if not pending and (not line or line.startswith("#")):
                continue
            if pending and line.startswith("#"):
                continue
            if line.endswith("\\"):
                pending += line[:-1] + " "
                continue
            full = (pending + line).strip()
            pending = ""
            word, _, rest = full.partition(" ")
            out.append((word.upper(), rest.strip()))
        return cls(out)

    def all(self, name: str) -> list[str]:
        return [args for ins, args in self.instructions if ins == name]

    def last_stage(self) -> list[tuple[str, str]]:
        starts = [i for i, (ins, _) in enumerate(self.instructions) if ins == "FROM"]
        return self.instructions[starts[-1] :]

    def arg_defaults(self) -> dict[str, str]:
        out = {}
        for args in self.all("ARG"):
            name, _, default = args.partition("=")
            out[name] = default
        return out

    def env(self) -> dict[str, str]:
        """ENV of the final stage (``K=V`` pairs)."""
        out = {}
        for ins, args in self.last_stage():
            if ins == "ENV":
                for pair in shlex.split(args):
                    k, _, v = pair.partition("=")
                    out[k] = v
        return out

    def exec_form(self, name: str) -> list[str]:
        """The final stage's last ``NAME ["a", "b"]`` as a list."""
        values = [args for ins, args in self.last_stage() if ins == name]
        assert values, f"no {name} in {DOCKERFILE}"
        return json.loads(values[-1])

    def healthcheck(self) -> tuple[dict[str, str], list[str]]:
        """(options, CMD argv) of the final stage's HEALTHCHECK."""
        (args,) = [a for ins, a in self.last_stage() if ins == "HEALTHCHECK"]
        options_text, _, cmd = args.partition("CMD")
        options = dict(o.lstrip("-").split("=", 1) for o in options_text.split())
        return options, json.loads(cmd.strip())

    def copies(self) -> dict[str, str]:
        """Image path -> repository path for the final stage's COPYs from the build context."""
        out = {}
        for ins, args in self.last_stage():
            if ins == "COPY" and "--from" not in args:
                *sources, dest = shlex.split(args)
                for src in sources:
                    out[dest] = src
        return out


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def compose_env(service: dict[str, Any]) -> dict[str, str]:
    """The service's environment as compose sets it when the shell sets none of the
    variables it interpolates (``${NAME:-default}`` -> default, ``${NAME}`` -> "")."""
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    unset = re.compile(r"\$\{[A-Za-z_][A-Za-z0-9_]*(?::?-([^}]*))?\}")
    return {k: unset.sub(lambda m: m.group(1) or "", str(v)) for k, v in env.items()}


def compose_duration(text: str) -> float:
    """Compose durations: ``45s``, ``1m30s``, ``500ms``, ``1h``."""
    parts = re.findall(r"(\d+(?:\.\d+)?)(us|ms|s|m|h)", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"not a compose duration: {text!r}"
    scale = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
    return sum(float(n) * scale[u] for n, u in parts)


def container_argv(service: dict[str, Any], dockerfile: Dockerfile) -> list[str]:
    """What the container runs: the compose entrypoint/command over the image's (Docker's rules)."""

    def as_list(v: Any) -> list[str]:
        return shlex.split(v) if isinstance(v, str) else [str(x) for x in v]

    if "entrypoint" in service:
        entrypoint = as_list(service["entrypoint"])
        command = as_list(service.get("command", []))  # an overridden entrypoint drops the image's CMD
    else:
        entrypoint = dockerfile.exec_form("ENTRYPOINT")
        cmd = [a for i, a in dockerfile.last_stage() if i == "CMD"]
        command = as_list(service["command"]) if "command" in service else (json.loads(cmd[-1]) if cmd else [])
    return entrypoint + command


def console_script_argv(argv: list[str]) -> list[str]:
    """Run ``argv[0]``, a [project.scripts] entry of pyproject.toml, with this interpreter."""
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert argv[0] in scripts, f"{argv[0]!r} is not a console script of the project: {sorted(scripts)}"
    module, func = scripts[argv[0]].split(":")
    return [sys.executable, "-c", f"import sys; from {module} import {func}; sys.exit({func}())", *argv[1:]]


def image_command_argv(argv: list[str], dockerfile: Dockerfile) -> list[str]:
    """A ``python /image/path.py ...`` command as it runs here: this interpreter, the repo file."""
    assert argv[0] == "python", argv
    copies = dockerfile.copies()
    assert argv[1] in copies, f"{argv[1]} is not copied into the image"
    return [sys.executable, str(REPO / copies[argv[1]]), *argv[2:]]


def k8s_documents() -> dict[str, list[dict[str, Any]]]:
    """file name -> its resources, for every file kustomization.yaml lists."""
    kustomization = load_yaml(K8S / "kustomization.yaml")
    return {name: [d for d in yaml.safe_load_all((K8S / name).read_text()) if d] for name in kustomization["resources"]}


def k8s_resource(kind: str, name: str) -> dict[str, Any]:
    found = [d for docs in k8s_documents().values() for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def redis_conf_directives(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition(" ")
            out[key.lower()] = value.strip()
    return out


# ----------------------------------------------------------------------------- compose: schema


def _check_compose_schema(*paths: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", *map(str, paths)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_compose_files_validate_against_the_compose_spec_schema(tmp_path):
    result = _check_compose_schema(COMPOSE, GPU_OVERRIDE)
    assert result.returncode == 0, result.stdout + result.stderr

    # The same check rejects a broken copy: the validation is not vacuous.
    broken = load_yaml(COMPOSE)
    broken["services"]["kvserve"]["depends_on"]["redis"]["condition"] = "healthy"  # not a compose condition
    broken["services"]["redis"]["helthcheck"] = broken["services"]["redis"].pop("healthcheck")  # a typo
    bad = tmp_path / "docker-compose.yml"
    bad.write_text(yaml.safe_dump(broken))
    result = _check_compose_schema(bad)
    assert result.returncode != 0
    assert "helthcheck" in result.stdout and "healthy" in result.stdout


# ----------------------------------------------------------------------------- compose: wiring


def test_compose_redis_is_the_official_image_with_lru_config_and_a_ping_healthcheck():
    redis_svc = load_yaml(COMPOSE)["services"]["redis"]
    assert redis_svc["image"].split(":")[0] == "redis" and redis_svc["image"].split(":")[1].startswith("7")
    assert redis_svc["healthcheck"]["test"][-2:] == ["redis-cli", "ping"]
    # The command loads the mounted deploy/redis.conf.
    mounts = {m.split(":")[1]: m.split(":")[0] for m in redis_svc["volumes"]}
    conf_in_container = redis_svc["command"][1]
    assert redis_svc["command"][0] == "redis-server" and conf_in_container in mounts
    assert (REPO / mounts[conf_in_container]).resolve() == REDIS_CONF.resolve()
    conf = redis_conf_directives(REDIS_CONF.read_text())
    assert conf["maxmemory-policy"] == "volatile-lru" and parse_bytes(conf["maxmemory"]) > 0
    assert conf["save"] == '""' and conf["appendonly"] == "no"


def test_compose_kvserve_service_is_wired_to_the_image_settings_redis_and_probe():
    compose = load_yaml(COMPOSE)
    svc = compose["services"]["kvserve"]
    dockerfile = Dockerfile.parse(DOCKERFILE)
    assert (REPO / svc["build"]["context"] / svc["build"]["dockerfile"]).resolve() == DOCKERFILE.resolve()
    assert svc["depends_on"]["redis"]["condition"] == "service_healthy"

    # Configuration by environment, every variable a real setting with a valid value.
    env = compose_env(svc)
    image_settings = {k for k in dockerfile.env() if k.startswith("KVSERVE_")}
    env_settings = {k for k in env if not k.startswith("OTEL_")}  # OpenTelemetry's own variables: test_tracing.py
    assert env_settings | image_settings <= SETTING_ENV_NAMES, f"unknown: {(env_settings | image_settings) - SETTING_ENV_NAMES}"
    config = ServerConfig.from_args([], {**dockerfile.env(), **env})
    assert urlsplit(env["KVSERVE_REDIS_URL"]).hostname == "redis"
    assert config.metrics_port > 0

    # Ports: published, exposed by the image.
    published = {int(p.split(":")[-1]) for p in svc["ports"]}
    exposed = {int(p.split("/")[0]) for args in dockerfile.all("EXPOSE") for p in args.split()}
    assert {config.port, config.metrics_port, config.http_port} <= published
    assert {config.port, config.metrics_port, config.http_port} <= exposed

    # `docker stop` sends SIGTERM, then SIGKILL after stop_grace_period: the drain must fit.
    assert compose_duration(svc["stop_grace_period"]) > config.drain_delay + config.drain_timeout

    # The healthcheck runs the probe the image carries, on the server's own port.
    test = svc["healthcheck"]["test"]
    assert test[0] == "CMD" and test[2] in dockerfile.copies()
    assert dockerfile.copies()[test[2]] == "deploy/grpc_health_probe.py"


def test_compose_monitoring_profile_scrapes_the_kvserve_metrics_port():
    compose = load_yaml(COMPOSE)
    prom = compose["services"]["prometheus"]
    assert prom["profiles"] == ["monitoring"]
    assert prom["image"].split(":")[0] in ("prom/prometheus", "quay.io/prometheus/prometheus")
    assert all("profiles" not in compose["services"][s] for s in ("redis", "kvserve"))
    mounts = {m.split(":")[1]: m.split(":")[0] for m in prom["volumes"]}
    config_path = next(a.split("=", 1)[1] for a in prom["command"] if a.startswith("--config.file="))
    assert (REPO / mounts[config_path]).resolve() == PROMETHEUS.resolve()

    metrics_port = int(compose_env(compose["services"]["kvserve"])["KVSERVE_METRICS_PORT"])
    (job,) = [j for j in load_yaml(PROMETHEUS)["scrape_configs"] if j["job_name"] == "kvserve"]
    targets = [(n, sd["port"]) for sd in job.get("dns_sd_configs", []) for n in sd["names"]]
    targets += [tuple(t.rsplit(":", 1)) for sc in job.get("static_configs", []) for t in sc["targets"]]
    assert targets and all(host == "kvserve" and int(port) == metrics_port for host, port in targets)


def test_gpu_override_reserves_an_nvidia_device_and_builds_cuda_torch():
    gpu = load_yaml(GPU_OVERRIDE)["services"]["kvserve"]
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"] and device["count"] >= 1
    assert re.fullmatch(r"cu\d+", gpu["build"]["args"]["TORCH_VARIANT"])
    assert "TORCH_VARIANT" in Dockerfile.parse(DOCKERFILE).arg_defaults()
    base_env = compose_env(load_yaml(COMPOSE)["services"]["kvserve"])
    config = ServerConfig.from_args([], {**base_env, **compose_env(gpu)})  # the merged environment
    assert config.device == "cuda"


def test_dockerfile_cpu_torch_by_default_non_root_health_checked_kvserve_serve():
    df = Dockerfile.parse(DOCKERFILE)
    args = df.arg_defaults()
    assert args["PYTHON_IMAGE"] == "python:3.11-slim"
    assert all(f in ("${PYTHON_IMAGE}", "python:3.11-slim") for f in (a.split()[0] for a in df.all("FROM")))
    assert args["TORCH_VARIANT"] == "cpu" and "${TORCH_VARIANT}" in args["TORCH_INDEX_URL"]
    assert any("--index-url" in a and "TORCH_INDEX_URL" in a for a in df.all("RUN"))
    user = [a for i, a in df.last_stage() if i == "USER"][-1].split(":")[0]
    assert user not in ("root", "0")
    options, cmd = df.healthcheck()
    assert cmd[1] in df.copies() and "start-period" in options
    assert df.exec_form("ENTRYPOINT") == ["kvserve", "serve"]
    assert console_script_argv(["kvserve"])[2].startswith("import sys; from kvserve.service.cli import main")
    for ins, a in df.instructions:  # every COPY from the context names a file that exists
        if ins == "COPY" and "--from" not in a:
            for src in shlex.split(a)[:-1]:
                assert (REPO / src).exists() or src == "README.md", f"COPY {src}: not in the repository"


# ----------------------------------------------------------------------------- redis configs


@pytest.mark.parametrize("source", ["deploy/redis.conf", "deploy/k8s/redis.yaml"])
def test_redis_config_loads_in_a_real_redis_server(source, tmp_path):
    if redis_server_binary() is None:
        pytest.skip("redis-server not installed")
    if source.endswith(".conf"):
        conf_path = REPO / source
    else:
        conf_path = tmp_path / "redis.conf"
        conf_path.write_text(k8s_resource("ConfigMap", "kvserve-redis-config")["data"]["redis.conf"])
    port = free_port()
    proc = subprocess.Popen(
        [redis_server_binary(), str(conf_path), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        client = redis.Redis(port=port, socket_timeout=2)

        def up() -> bool:
            assert proc.poll() is None, f"redis-server rejected {source}:\n{proc.stdout.read()}"
            try:
                return bool(client.ping())
            except redis.ConnectionError:
                return False

        assert wait_until(up, timeout=20)
        cfg = client.config_get("*")
        assert cfg["maxmemory-policy"] == "volatile-lru"
        assert int(cfg["maxmemory"]) > 0
        assert cfg["save"] == "" and cfg["appendonly"] == "no"
        assert cfg["lazyfree-lazy-eviction"] == "yes"
        client.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_k8s_redis_config_matches_deploy_redis_conf_but_for_maxmemory():
    compose_conf = redis_conf_directives(REDIS_CONF.read_text())
    k8s_conf = redis_conf_directives(k8s_resource("ConfigMap", "kvserve-redis-config")["data"]["redis.conf"])
    assert {k: v for k, v in compose_conf.items() if k != "maxmemory"} == {
        k: v for k, v in k8s_conf.items() if k != "maxmemory"
    }


# ----------------------------------------------------------------------------- kubernetes


def test_kustomization_lists_every_manifest():
    listed = set(load_yaml(K8S / "kustomization.yaml")["resources"])
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk
    kinds = {d["kind"] for docs in k8s_documents().values() for d in docs}
    assert {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget", "StatefulSet"} <= kinds


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_k8s_manifests_validate_strictly_against_the_kubernetes_schemas(version):
    for name, docs in k8s_documents().items():
        for doc in docs:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{name}: {doc['kind']}/{doc['metadata']['name']} against {version}: {e.message}")

    # Not vacuous: a misplaced field and a named port where gRPC probes need a number fail.
    deployment = copy.deepcopy(k8s_resource("Deployment", "kvserve"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["port"] = "grpc"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, version, strict=True)
    pdb = copy.deepcopy(k8s_resource("PodDisruptionBudget", "kvserve"))
    pdb["spec"]["minAvailble"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pdb, version, strict=True)


def _k8s_server_config() -> ServerConfig:
    data = k8s_resource("ConfigMap", "kvserve-config")["data"]
    assert set(data) <= SETTING_ENV_NAMES, f"unknown settings: {set(data) - SETTING_ENV_NAMES}"
    return ServerConfig.from_args([], data)


def test_k8s_deployment_probes_ports_and_grace_agree_with_the_configmap():
    config = _k8s_server_config()
    deployment = k8s_resource("Deployment", "kvserve")
    spec = deployment["spec"]
    assert spec["replicas"] == 2
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    assert {"configMapRef": {"name": "kvserve-config"}} in container["envFrom"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": config.port, "metrics": config.metrics_port, "http": config.http_port}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == config.port, probe
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    pre_stop_s = float(pre_stop[1]) if pre_stop[0] == "sleep" else 0.0
    assert pod["terminationGracePeriodSeconds"] > pre_stop_s + config.drain_timeout
    assert pod["securityContext"]["runAsNonRoot"] is True

    labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    service = k8s_resource("Service", "kvserve")
    assert service["spec"]["selector"].items() <= labels.items()
    assert {p["targetPort"] for p in service["spec"]["ports"]} == set(ports)
    pdb = k8s_resource("PodDisruptionBudget", "kvserve")
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_k8s_memory_request_is_the_sizing_formula_over_the_configmap():
    config = _k8s_server_config()
    deployment = k8s_resource("Deployment", "kvserve")
    sizing = deployment["spec"]["template"]["metadata"]["annotations"]["kvserve/memory-sizing"]
    terms = dict((name, parse_bytes(v + "B" if v.endswith("i") else v)) for name, v in re.findall(r"(\w+) (\d+\w*)", sizing))
    total = parse_bytes(sizing.rsplit("=", 1)[1].strip() + "B")
    assert set(terms) == {"weights", "kv_cache_memory", "host_cache_memory", "overhead"}
    assert terms["kv_cache_memory"] == config.kv_cache_memory
    assert terms["host_cache_memory"] == config.host_cache_memory
    assert total == sum(terms.values())
    resources = deployment["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert parse_bytes(resources["requests"]["memory"] + "B") == total
    assert parse_bytes(resources["limits"]["memory"] + "B") >= total

    # The weights budget covers the packaged model in the configured dtype.
    if (DEFAULT_MODEL_DIR / "config.json").exists():
        from safetensors import safe_open

        numel = 0
        for f in DEFAULT_MODEL_DIR.glob("*.safetensors"):
            with safe_open(f, "pt") as st:
                numel += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())
        assert numel * {"float32": 4, "bfloat16": 2, "float16": 2}[config.dtype] <= terms["weights"]


def test_k8s_redis_statefulset_is_behind_the_headless_service_the_configmap_names():
    config = _k8s_server_config()
    url = urlsplit(config.redis_url)
    service = k8s_resource("Service", url.hostname)
    assert service["spec"]["clusterIP"] == "None"
    assert any(p["port"] == (url.port or 6379) for p in service["spec"]["ports"])
    sts = k8s_resource("StatefulSet", "kvserve-redis")
    assert sts["spec"]["serviceName"] == url.hostname
    assert service["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    assert container["image"].split(":")[0] == "redis"
    conf = redis_conf_directives(k8s_resource("ConfigMap", "kvserve-redis-config")["data"]["redis.conf"])
    assert conf["maxmemory-policy"] == "volatile-lru"
    assert parse_bytes(conf["maxmemory"]) < parse_bytes(container["resources"]["limits"]["memory"] + "B")


# ----------------------------------------------------------------------------- the compose service, run


class ComposeServer:
    """The compose ``kvserve`` service as a local process: its argv and environment with
    the Redis host, the ports and (while no default model is packaged) the model rewritten."""

    def __init__(self, redis_url: str, model_dir: Path | None, log_dir: Path) -> None:
        compose = load_yaml(COMPOSE)
        self.service = compose["services"]["kvserve"]
        self.dockerfile = Dockerfile.parse(DOCKERFILE)
        self.argv = console_script_argv(container_argv(self.service, self.dockerfile))
        declared = {**{k: v for k, v in self.dockerfile.env().items() if k.startswith("KVSERVE_")}, **compose_env(self.service)}
        target = urlsplit(redis_url)
        declared_url = urlsplit(declared["KVSERVE_REDIS_URL"])
        self.env_overrides = dict(
            declared,
            KVSERVE_REDIS_URL=urlunsplit(declared_url._replace(netloc=target.netloc)),
            KVSERVE_PORT=str(free_port()),
            KVSERVE_METRICS_PORT=str(free_port()),
            KVSERVE_HTTP_PORT=str(free_port()),
        )
        if model_dir is not None:
            self.env_overrides["KVSERVE_MODEL"] = str(model_dir)
        self.log_dir = log_dir
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.env_overrides['KVSERVE_PORT']}"

    def env(self) -> dict[str, str]:
        base = {k: v for k, v in subprocess_env().items() if not k.startswith("KVSERVE_")}
        return {**base, "OMP_NUM_THREADS": "1", **self.env_overrides}

    def healthcheck(self) -> subprocess.CompletedProcess[str]:
        """The compose healthcheck command, as docker would run it in the container."""
        test = self.service["healthcheck"]["test"]
        assert test[0] == "CMD"
        argv = image_command_argv(test[1:], self.dockerfile)
        return subprocess.run(argv, env=self.env(), capture_output=True, text=True, timeout=60)

    def log(self) -> str:
        return "".join(p.read_text()[-4000:] for p in sorted(self.log_dir.glob("server*.log")))

    def start(self) -> None:
        self.starts += 1
        with open(self.log_dir / f"server{self.starts}.log", "wb") as log:
            self.proc = subprocess.Popen(self.argv, cwd=self.log_dir, env=self.env(), stdout=log, stderr=log)

        def healthy() -> bool:
            assert self.proc is not None and self.proc.poll() is None, f"server exited:\n{self.log()}"
            return self.healthcheck().returncode == 0

        assert wait_until(healthy, timeout=180, interval=0.5), f"server never became healthy:\n{self.log()}"

    def stop(self) -> int:
        """SIGTERM (what ``docker stop`` sends), then the exit status after the drain."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=90)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.proc = None


@pytest.fixture
def compose_server(request, redis_url, tmp_path):
    model = None if (DEFAULT_MODEL_DIR / "config.json").exists() else request.getfixturevalue("tiny_llama_dir")
    server = ComposeServer(redis_url, model, tmp_path)
    yield server
    if server.proc is not None:
        server.proc.kill()
        server.proc.wait()


def _block_keys(r: redis.Redis, key_prefix: str) -> int:
    return sum(1 for _ in r.scan_iter(match=f"{key_prefix}blk:*", count=1000))


@pytest.mark.slow
def test_compose_service_serves_a_two_turn_session_restored_from_redis_after_restart(compose_server, redis_server):
    session = f"compose-{uuid.uuid4().hex[:8]}"
    compose_server.start()
    with KVServeClient(compose_server.address, timeout=120) as client:
        info = client.model_info()
        assert pb.CACHE_TIER_REDIS in info.tiers, "the compose service must configure the Redis tier"
        turn1 = client.chat(session, "Hello there! Tell me a short story about a fox.", max_new_tokens=12)
        assert turn1.start.cached_tokens == 0 and turn1.end.completion_tokens > 0
        block_size = info.block_size
        prompt_blocks = turn1.start.prompt_tokens // block_size
        assert prompt_blocks > 0, "the first prompt must fill a block for the test to mean anything"

    # The idle session's blocks are spilled to Redis (KVSERVE_SPILL_AFTER); wait for them.
    prefix = ServerConfig.from_args([], compose_server.env_overrides).redis_key_prefix
    with redis_server.client() as r:
        assert wait_until(lambda: _block_keys(r, prefix) >= prompt_blocks, timeout=120, interval=0.2), (
            f"{_block_keys(r, prefix)} block keys in Redis, wanted >= {prompt_blocks}\n{compose_server.log()}"
        )
    assert compose_server.stop() == 0, compose_server.log()

    # A fresh process: no device or host blocks, so every cached token comes from Redis.
    compose_server.start()
    with KVServeClient(compose_server.address, timeout=120) as client:
        turn2 = client.chat(session, "And then what happened?", max_new_tokens=12)
        assert turn2.start.prompt_tokens > turn1.start.prompt_tokens + turn1.end.completion_tokens
        assert turn2.start.cached_tokens >= prompt_blocks * block_size
        assert turn2.start.cached_by_tier.get("redis", 0) == turn2.start.cached_tokens
        assert turn2.start.cached_tier == "redis"

        # The restored KV is right: the same prompt, prefilled cold (another cache salt,
        # so no block can match), greedily continues with the same tokens.
        transcript = client.get_session(session, include_token_ids=True).token_ids
        assert transcript is not None
        assert len(transcript) == turn2.start.prompt_tokens + turn2.end.completion_tokens
        cold = client.complete(
            token_ids=transcript[: turn2.start.prompt_tokens], cache_salt="cold-reference", max_new_tokens=12
        )
        assert cold.start.cached_tokens == 0
        assert cold.token_ids == turn2.token_ids
    assert compose_server.stop() == 0, compose_server.log()


# ----------------------------------------------------------------------------- HEALTHCHECK probe


def test_dockerfile_healthcheck_probe_reports_serving_draining_unknown_and_down(tiny_llama_dir):
    df = Dockerfile.parse(DOCKERFILE)
    _, cmd = df.healthcheck()
    probe = image_command_argv(cmd, df)

    def run(port: int, *extra: str) -> subprocess.CompletedProcess[str]:
        env = {**subprocess_env(), "KVSERVE_PORT": str(port)}  # the probe finds the port as in the image
        return subprocess.run([*probe, *extra], env=env, capture_output=True, text=True, timeout=60)

    with ServerThread(tiny_config(tiny_llama_dir)) as server:
        port = server.running.port
        ok = run(port)
        assert ok.returncode == 0 and "SERVING" in ok.stdout, ok.stdout + ok.stderr
        named = run(port, "--service", "kvserve.v1.GenerationService")
        assert named.returncode == 0, named.stdout + named.stderr
        unknown = run(port, "--service", "no.such.Service")
        assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stdout

        server.call(server.running.health.enter_graceful_shutdown())  # what SIGTERM does first
        draining = run(port)
        assert draining.returncode == 1 and "NOT_SERVING" in draining.stdout
    down = run(port, "--timeout", "2")
    assert down.returncode == 1 and "UNAVAILABLE" in down.stdout
