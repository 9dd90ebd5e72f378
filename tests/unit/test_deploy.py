"""Deployment files (deploy/): validated here, where no container engine or
cluster runs, with the tools a user can run offline.

- every YAML parses;
- docker compose: the compose specification's JSON schema (as bundled by
  check-jsonschema), the wiring between services, Prometheus's config with
  the project's rules (promtool), Alertmanager's (amtool);
- Kubernetes: core kinds against the official schemas (kubernetes-validate,
  strict), custom resources against deploy/schemas/ (jsonschema), pod
  templates inside PyTorchJobs against the core schema; the PrometheusRule
  equals prometheus/rules/*.yml and passes `promtool check rules`; the
  dashboard ConfigMaps equal grafana/dashboards/*.json;
- every generated file (rules, dashboards, Kubernetes copies, README catalog)
  is what deploy/generate.py renders (`deploy/generate.py --check`);
- Dockerfile: parsed with BuildKit's own parser; installs torch from the CPU
  index then the project, downloads nothing at run time;
- Slurm: scripts parse; the prolog/epilog pair registers and removes a node
  with a real Prometheus (file_sd) scraping a real exporter;
- systemd: `systemd-analyze verify` and its offline security score.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

import dockerfile
import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.helpers.promstack import poll

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "kubernetes"
SCHEMAS = DEPLOY / "schemas"
COMPOSE_FILE = DEPLOY / "docker-compose.yml"
DOCKERFILE = DEPLOY / "Dockerfile"
SLURM = DEPLOY / "slurm"
UNIT = DEPLOY / "systemd" / "rankscope-exporter.service"


def _load(name: str, path: Path):
    """A generator script by path (deploy/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


regenerate = _load("rankscope_deploy_generate", DEPLOY / "generate.py")   # deploy/generate.py
generate = regenerate._kubernetes()                                        # deploy/kubernetes/generate.py

# Oldest Kubernetes the manifests claim (native sidecars: 1.29) and the newest
# schema kubernetes-validate bundles.
KUBERNETES_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
CRD_SCHEMAS = {
    ("kubeflow.org/v1", "PyTorchJob"): "pytorchjob_v1.json",
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitor_v1.json",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrule_v1.json",
}
NO_NETWORK_AT_RUN_TIME = re.compile(r"\b(pip|pip3|curl|wget|git|apt-get|apt|conda|uv)\b")


def yaml_files() -> list[Path]:
    return sorted(p for ext in ("*.yml", "*.yaml") for p in DEPLOY.rglob(ext))


def kubernetes_docs() -> list[tuple[Path, dict]]:
    docs = []
    for path in sorted(K8S.rglob("*.yaml")):
        docs.extend((path, doc) for doc in yaml.safe_load_all(path.read_text()) if doc)
    return docs


def docs_of_kind(kind: str) -> list[dict]:
    return [doc for _, doc in kubernetes_docs() if doc["kind"] == kind]


def rules_job() -> str:
    """The scrape job the rules select (prometheus/thresholds.yaml `selector`)."""
    selector = yaml.safe_load((REPO / "prometheus" / "thresholds.yaml").read_text())["selector"]
    return re.fullmatch(r'job="([^"]+)"', selector).group(1)


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kw)


def _start_exporter(port: int, directory: Path, command: list[str] | None = None,
                    env: dict[str, str] | None = None) -> subprocess.Popen:
    command = command or [sys.executable, "-m", "rankscope.exporter", "--addr", "127.0.0.1", "--port", str(port),
                          "--dir", str(directory), "--no-nvml"]
    log_path = directory.parent / f"exporter-{port}.log"   # a file: an undrained pipe could block it
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=log, start_new_session=True)

    def healthy() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"exporter exited: {log_path.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    try:
        poll(healthy, timeout=30, what="exporter /healthz")
    except BaseException:
        _stop(proc)
        raise
    return proc


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# --- every YAML ---------------------------------------------------------------

def test_every_yaml_file_parses():
    files = yaml_files()
    assert len(files) >= 8, files
    for path in files:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        assert docs, f"{path} has no document"
        assert all(isinstance(d, dict) for d in docs), path


# --- docker compose -----------------------------------------------------------

@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def test_compose_file_matches_the_compose_specification():
    # check-jsonschema bundles the compose-spec JSON schema (vendor.compose-spec).
    result = run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
                  str(COMPOSE_FILE)])
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_schema_check_rejects_a_broken_file(tmp_path):
    """The check above is not vacuous: a misspelt service key fails it."""
    broken = yaml.safe_load(COMPOSE_FILE.read_text())
    broken["services"]["exporter"]["comand"] = broken["services"]["exporter"].pop("command")
    path = tmp_path / "docker-compose.yml"
    path.write_text(yaml.safe_dump(broken))
    result = run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", str(path)])
    assert result.returncode != 0


def test_compose_runs_the_two_rank_trainer_against_the_exporter_service(compose):
    services = compose["services"]
    assert set(services) >= {"exporter", "trainer", "prometheus", "alertmanager", "grafana", "tempo"}
    exporter, trainer = services["exporter"], services["trainer"]

    assert exporter["command"][:9] == ["python", "-m", "rankscope.exporter", "--addr", "0.0.0.0", "--port", "9400",
                                       "--dir", "/metrics"]
    assert trainer["command"][:6] == ["torchrun", "--standalone", "--nproc-per-node", "2", "-m", "rankscope.train"]
    env = trainer["environment"]
    assert env["RANKSCOPE_EXPORTER"] == "external"
    assert env["RANKSCOPE_METRICS_DIR"] == "/metrics"
    assert env["RANKSCOPE_METRICS_ADDR"] == "exporter"
    assert env["RANKSCOPE_NODE"] == exporter["environment"]["RANKSCOPE_NODE"]
    # The same named volume at the same path: the exporter checks that the
    # ranks' directory is the one it serves.
    assert "metrics:/metrics" in exporter["volumes"] and "metrics:/metrics" in trainer["volumes"]
    assert compose["volumes"]["metrics"]["driver_opts"]["type"] == "tmpfs"
    # The exporter must see the ranks' PIDs to tell dead from frozen.
    assert trainer["pid"] == "service:exporter"
    assert trainer["depends_on"]["exporter"]["condition"] == "service_healthy"
    assert any("/healthz" in part for part in exporter["healthcheck"]["test"])


def test_compose_sends_spans_to_the_trace_backend(compose):
    endpoint = urlparse(compose["services"]["trainer"]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"])
    assert endpoint.hostname in compose["services"]
    tempo = yaml.safe_load((DEPLOY / "compose" / "tempo.yaml").read_text())
    grpc = tempo["distributor"]["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]
    assert grpc == f"0.0.0.0:{endpoint.port}"


def test_compose_images_are_pinned_and_bind_mounts_exist(compose):
    for name, service in compose["services"].items():
        image = service["image"]
        assert ":" in image and not image.endswith(":latest"), f"{name}: pin the image tag ({image})"
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"{name} mounts {source}, which does not exist"
    build = compose["services"]["exporter"]["build"]
    assert (DEPLOY / build["context"]).resolve() == REPO
    assert (REPO / build["dockerfile"]).resolve() == DOCKERFILE


def test_compose_grafana_finds_its_datasources_and_dashboards(compose):
    grafana = compose["services"]["grafana"]
    mounts = dict(v.split(":")[:2] for v in grafana["volumes"])
    assert mounts["../grafana/provisioning"] == "/etc/grafana/provisioning"
    for path in (REPO / "grafana" / "provisioning" / "dashboards").glob("*.y*ml"):
        for provider in yaml.safe_load(path.read_text())["providers"]:
            assert mounts["../grafana/dashboards"] == provider["options"]["path"]
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (REPO / "grafana" / "dashboards" / Path(home).name).exists()
    for path in (REPO / "grafana" / "provisioning" / "datasources").glob("*.y*ml"):
        for source in yaml.safe_load(path.read_text())["datasources"]:
            url = urlparse(source["url"])
            assert url.hostname in compose["services"], f"datasource {source['name']}: no service {url.hostname}"


def test_compose_prometheus_config_with_the_project_rules_passes_promtool(compose, tmp_path):
    config = yaml.safe_load((DEPLOY / "compose" / "prometheus.yml").read_text())
    mounts = dict(v.split(":")[:2] for v in compose["services"]["prometheus"]["volumes"])
    assert mounts["../prometheus/rules"] == "/etc/prometheus/rules"
    assert config["rule_files"] == ["/etc/prometheus/rules/*.yml"]
    assert config["scrape_configs"][0]["job_name"] == rules_job()
    assert config["scrape_configs"][0]["static_configs"][0]["targets"] == ["exporter:9400"]
    # promtool resolves the rule files: point them at the repo's files.
    config["rule_files"] = [str(REPO / "prometheus" / "rules" / "*.yml")]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    result = run(["promtool", "check", "config", str(path)])
    assert result.returncode == 0, result.stdout + result.stderr
    for rule_file in sorted((REPO / "prometheus" / "rules").glob("*.yml")):
        assert rule_file.name in result.stdout, f"promtool did not check {rule_file}"


def _run_job(command: list[str], env: dict[str, str], timeout: float) -> int:
    """Run torchrun; on timeout SIGTERM it, which it forwards to its ranks
    (each rank has its own session: SIGKILL to torchrun would orphan them)."""
    job = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, start_new_session=True)
    try:
        output, _ = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        job.terminate()
        try:
            output, _ = job.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            job.kill()
            output, _ = job.communicate()
        pytest.fail(f"the job did not finish in {timeout} s:\n{output[-3000:]}")
    assert job.returncode == 0, output[-3000:]
    return job.returncode


def _with_option(command: list[str], option: str, value: str) -> list[str]:
    command = list(command)
    command[command.index(option) + 1] = value
    return command


def test_compose_alertmanager_config_is_valid():
    result = run(["amtool", "check-config", str(REPO / "prometheus" / "alertmanager.yml")])
    assert result.returncode == 0, result.stdout + result.stderr


# --- Dockerfile ---------------------------------------------------------------

@pytest.fixture(scope="module")
def dockerfile_commands() -> list:
    return list(dockerfile.parse_file(str(DOCKERFILE)))


def _args(commands) -> dict[str, str]:
    return dict(c.value[0].split("=", 1) for c in commands if c.cmd == "ARG" and "=" in c.value[0])


def test_dockerfile_installs_cpu_torch_then_the_project(dockerfile_commands):
    from importlib.metadata import version

    args = _args(dockerfile_commands)
    runs = [c.value[0] for c in dockerfile_commands if c.cmd == "RUN"]
    torch_run = next(i for i, r in enumerate(runs) if "torch==${TORCH_VERSION}" in r)
    assert "--index-url ${TORCH_INDEX_URL}" in runs[torch_run]
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    # The torch the tests run with.
    assert args["TORCH_VERSION"] == version("torch").split("+")[0]
    project_run = next(i for i, r in enumerate(runs) if re.search(r"\bpip install \.(\s|$)", r))
    assert project_run > torch_run, "torch must be installed before the project, as in the README"


def test_dockerfile_matches_the_readme_install(dockerfile_commands):
    # The README's first command runs deploy/local/setup.sh, which does the installing.
    readme = (REPO / "README.md").read_text()
    assert "bash deploy/local/demo.sh" in readme and "deploy/local/setup.sh" in (REPO / "deploy/local/demo.sh").read_text()
    install = readme + (REPO / "deploy/local/setup.sh").read_text()
    pins = set(re.findall(r"pip install[^\n]*\btorch==([0-9][0-9.]*)", install))
    assert pins == {_args(dockerfile_commands)["TORCH_VERSION"]}, pins
    assert re.search(r"pip install [^\n]*(-e )?[\"']?\.", install), "the project is installed with pip install ."


def test_dockerfile_copies_only_what_exists_and_downloads_nothing_at_run_time(dockerfile_commands):
    for c in dockerfile_commands:
        if c.cmd in ("COPY", "ADD"):
            assert c.cmd == "COPY", "ADD can fetch URLs at build time: use COPY"
            for source in c.value[:-1]:
                assert (REPO / source).exists(), f"COPY {source}: not in the repository"
    run_time = [c for c in dockerfile_commands if c.cmd in ("CMD", "ENTRYPOINT", "HEALTHCHECK")]
    assert run_time
    for c in run_time:
        assert not NO_NETWORK_AT_RUN_TIME.search(" ".join(c.value)), c.original
    envs = " ".join(" ".join(c.value) for c in dockerfile_commands if c.cmd == "ENV")
    assert "PIP_NO_INDEX" in envs, "a run-time pip install must fail, not download"
    # The compose file's commands download nothing either.
    compose = yaml.safe_load(COMPOSE_FILE.read_text())
    for service in compose["services"].values():
        command = service.get("command", [])
        assert not NO_NETWORK_AT_RUN_TIME.search(" ".join(command) if isinstance(command, list) else command)


def test_dockerfile_ignore_keeps_the_sources():
    patterns = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    for needed in ("pyproject.toml", "README.md", "training/**", "exporter/**"):
        assert f"!{needed}" in patterns


# --- Kubernetes ---------------------------------------------------------------

def validate_kubernetes(doc: dict, version: str) -> None:
    key = (doc["apiVersion"], doc["kind"])
    if key not in CRD_SCHEMAS:
        kubernetes_validate.validate(doc, version, strict=True)
        return
    schema = json.loads((SCHEMAS / CRD_SCHEMAS[key]).read_text())
    jsonschema.validate(doc, schema, cls=jsonschema.Draft202012Validator)
    if doc["kind"] == "PyTorchJob":
        # The CRD schema leaves pod templates open: check them as core PodTemplates.
        for name, replica in doc["spec"]["pytorchReplicaSpecs"].items():
            template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name.lower()},
                        "template": replica["template"]}
            kubernetes_validate.validate(template, version, strict=True)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_kubernetes_manifests_validate_against_their_schemas(version):
    docs = kubernetes_docs()
    kinds = {doc["kind"] for _, doc in docs}
    assert kinds >= {"PyTorchJob", "DaemonSet", "PodMonitor", "PrometheusRule", "ConfigMap"}, kinds
    for path, doc in docs:
        try:
            validate_kubernetes(doc, version)
        except (kubernetes_validate.ValidationError, jsonschema.ValidationError) as e:
            pytest.fail(f"{path.relative_to(REPO)} {doc['kind']}/{doc['metadata']['name']}: {e}")


def test_kubernetes_validation_rejects_unknown_fields():
    """Strict on both sides: a misspelt field fails, in a core kind and a CRD."""
    job = yaml.safe_load((K8S / "sidecar" / "pytorchjob.yaml").read_text())
    job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["enviroment"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_kubernetes(job, KUBERNETES_VERSIONS[0])
    monitor = yaml.safe_load((K8S / "podmonitor.yaml").read_text())
    monitor["spec"]["podMetricEndpoints"] = monitor["spec"].pop("podMetricsEndpoints")
    with pytest.raises(jsonschema.ValidationError):
        validate_kubernetes(monitor, KUBERNETES_VERSIONS[0])


def test_crd_schemas_name_their_source():
    for name in CRD_SCHEMAS.values():
        schema = json.loads((SCHEMAS / name).read_text())
        jsonschema.Draft202012Validator.check_schema(schema)
        assert "==" in schema["$comment"] and "make_crd_schemas.py" in schema["$comment"]


def _pod_specs(kind: str) -> list[dict]:
    specs = []
    for doc in docs_of_kind(kind):
        if kind == "PyTorchJob":
            specs += [r["template"] for r in doc["spec"]["pytorchReplicaSpecs"].values()]
        else:
            specs.append(doc["spec"]["template"])
    return specs


def test_sidecar_exporter_shares_the_metrics_dir_and_pids_with_the_trainer():
    job = yaml.safe_load((K8S / "sidecar" / "pytorchjob.yaml").read_text())
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        spec = replica["template"]["spec"]
        assert spec["shareProcessNamespace"] is True
        (sidecar,) = spec["initContainers"]
        assert sidecar["restartPolicy"] == "Always"          # native sidecar: the job can complete
        trainer = next(c for c in spec["containers"] if c["name"] == "pytorch")
        env = {e["name"]: e.get("value") for e in trainer["env"]}
        assert env["RANKSCOPE_EXPORTER"] == "external"
        directory = sidecar["command"][sidecar["command"].index("--dir") + 1]
        assert env["RANKSCOPE_METRICS_DIR"] == directory
        volume = {m["name"] for m in sidecar["volumeMounts"] if m["mountPath"] == directory}
        assert volume == {m["name"] for m in trainer["volumeMounts"] if m["mountPath"] == directory}
        (empty_dir,) = [v["emptyDir"] for v in spec["volumes"] if v["name"] in volume]
        assert empty_dir["medium"] == "Memory"


def test_daemonset_and_its_training_pods_share_a_host_directory_and_pid_namespace():
    (ds,) = docs_of_kind("DaemonSet")
    ds_spec = ds["spec"]["template"]["spec"]
    (exporter,) = ds_spec["containers"]
    directory = exporter["command"][exporter["command"].index("--dir") + 1]
    (host_dir,) = [v["hostPath"]["path"] for v in ds_spec["volumes"] if "hostPath" in v]
    assert ds_spec["hostPID"] is True
    job = yaml.safe_load((K8S / "daemonset" / "pytorchjob.yaml").read_text())
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        spec = replica["template"]["spec"]
        assert spec["hostPID"] is True
        trainer = spec["containers"][0]
        env = {e["name"]: e.get("value") for e in trainer["env"]}
        mount = next(m for m in trainer["volumeMounts"] if m["mountPath"] == env["RANKSCOPE_METRICS_DIR"])
        (source,) = [v["hostPath"]["path"] for v in spec["volumes"] if v["name"] == mount["name"]]
        assert source == host_dir
    assert directory == "/rankscope"


def test_podmonitor_scrapes_every_exporter_as_the_rules_job():
    (monitor,) = docs_of_kind("PodMonitor")
    selector = monitor["spec"]["selector"]["matchLabels"]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    relabel = {r["targetLabel"]: r["replacement"] for r in endpoint["relabelings"]}
    assert relabel["job"] == rules_job()
    exporter_pods = _pod_specs("DaemonSet") + [
        t for t in _pod_specs("PyTorchJob") if t["spec"].get("initContainers")]
    assert len(exporter_pods) >= 3
    for template in exporter_pods:
        assert selector.items() <= template["metadata"]["labels"].items()
        containers = template["spec"]["containers"] + template["spec"].get("initContainers", [])
        ports = {p["name"] for c in containers for p in c.get("ports", [])}
        assert endpoint["port"] in ports


def test_kube_prometheus_stack_release_label_on_everything_it_selects():
    for kind in ("PodMonitor", "PrometheusRule", "ConfigMap"):
        for doc in docs_of_kind(kind):
            assert doc["metadata"]["labels"]["release"] == generate.DEFAULT_RELEASE, doc["metadata"]["name"]
    docs = (REPO / "docs" / "deploying.md").read_text()
    assert "release" in docs and "grafana_dashboard" in docs


def test_prometheusrule_groups_equal_the_rule_files_and_pass_promtool(tmp_path):
    (rule,) = docs_of_kind("PrometheusRule")
    groups = rule["spec"]["groups"]
    expected = []
    for path in sorted((REPO / "prometheus" / "rules").glob("*.yml")):
        expected += yaml.safe_load(path.read_text())["groups"]
    assert expected, "prometheus/rules/*.yml has no rule group"
    assert groups == expected
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    result = run(["promtool", "check", "rules", str(path)])
    assert result.returncode == 0, result.stdout + result.stderr


def test_dashboard_configmaps_equal_the_dashboards():
    maps = docs_of_kind("ConfigMap")
    dashboards = sorted((REPO / "grafana" / "dashboards").glob("*.json"))
    assert dashboards and len(maps) == len(dashboards)
    by_file = {name: (cm, text) for cm in maps for name, text in cm["data"].items()}
    for path in dashboards:
        cm, text = by_file[path.name]
        assert text == path.read_text()
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        json.loads(text)
        # A ConfigMap holds at most 1 MiB.
        assert len(text.encode()) < 1024 * 1024


def test_every_generated_file_is_up_to_date():
    """The one check of all four generators: rules, dashboards, their Kubernetes copies, the README catalog."""
    result = run([sys.executable, str(DEPLOY / "generate.py"), "--check"], cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert "up to date" in result.stdout


def test_generators_cover_every_generated_file():
    rendered = regenerate.render_all()
    rel = {str(p.relative_to(REPO)) for p in rendered}
    assert {"prometheus/rules/recording.yml", "prometheus/rules/alerts.yml", "README.md",
            "deploy/kubernetes/generated/prometheusrule.yaml",
            "deploy/kubernetes/generated/grafana-dashboards.yaml"} <= rel
    assert len([r for r in rel if r.startswith("grafana/dashboards/")]) == 4
    assert regenerate.leftovers(rendered) == []
    # The Kubernetes copies come from the rendered rules and dashboards, not the files on disk.
    changed = {p: t for p, t in rendered.items() if p.parent.name in ("rules", "dashboards")}
    changed[REPO / "prometheus" / "rules" / "alerts.yml"] = "groups: [{name: only, rules: []}]\n"
    (rule,) = yaml.safe_load_all(generate.outputs(upstream=changed)[K8S / "generated" / "prometheusrule.yaml"])
    assert rule["spec"]["groups"] == [{"name": "only", "rules": []}] + yaml.safe_load(
        rendered[REPO / "prometheus" / "rules" / "recording.yml"])["groups"]


def test_check_lists_stale_files_and_the_fix_and_a_plain_run_fixes_them(tmp_path, monkeypatch, capsys):
    fresh, old, leftover = tmp_path / "fresh.yml", tmp_path / "old.yml", tmp_path / "gone.yml"
    fresh.write_text("a\n")
    old.write_text("before\n")
    leftover.write_text("x\n")
    monkeypatch.setattr(regenerate, "render_all", lambda: {fresh: "a\n", old: "after\n", tmp_path / "new.yml": "n\n"})
    monkeypatch.setattr(regenerate, "GENERATED_ONLY", ((tmp_path, "*.yml"),))
    assert regenerate.main(["--check"]) == 1
    err = capsys.readouterr().err
    listed = [line.strip() for line in err.splitlines() if line.startswith("  ")]
    assert listed == [str(leftover), str(tmp_path / "new.yml"), str(old)]
    assert "regenerate them with: .venv/bin/python deploy/generate.py" in err
    assert old.read_text() == "before\n" and leftover.exists()      # --check writes nothing
    assert regenerate.main([]) == 0
    assert old.read_text() == "after\n" and (tmp_path / "new.yml").read_text() == "n\n" and not leftover.exists()
    assert regenerate.main(["--check"]) == 0


def test_each_generator_cli_is_the_shared_one_or_writes_a_variant(monkeypatch):
    from grafana import generate as grafana_generate
    from prometheus import generate as prometheus_generate

    calls = []
    monkeypatch.setattr(subprocess, "call", lambda argv: calls.append(argv[1:]) or 0)
    for main in (prometheus_generate.main, grafana_generate.main, generate.main):
        assert main(["--check"]) == 0 and main([]) == 0
    shared = str(DEPLOY / "generate.py")
    assert calls == [[shared, "--check"], [shared]] * 3
    with pytest.raises(SystemExit):  # a variant of the committed rules needs somewhere else to go
        prometheus_generate.main(["--override", str(REPO / "prometheus" / "fast.yaml")])


def test_generator_release_option(tmp_path):
    assert generate.main(["--release", "monitoring", "--out", str(tmp_path)]) == 0
    for path in tmp_path.glob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            assert doc["metadata"]["labels"]["release"] == "monitoring"


# --- Slurm --------------------------------------------------------------------

def test_slurm_scripts_parse_and_launch_one_exporter_per_node():
    for name in ("train.sbatch", "prolog.sh", "epilog.sh"):
        result = run(["bash", "-n", str(SLURM / name)])
        assert result.returncode == 0, result.stderr
        assert os.access(SLURM / name, os.X_OK), f"{name} is not executable"
    script = (SLURM / "train.sbatch").read_text()
    assert re.search(r"^#SBATCH --nodes=\d+", script, re.M)
    commands = " ".join(script.replace("\\\n", " ").split())
    assert re.search(r"srun --overlap --nodes=\S+ --ntasks-per-node=1 .*?python -m rankscope.exporter --addr 0\.0\.0\.0",
                     commands)
    assert re.search(r"srun --nodes=\S+ --ntasks-per-node=1 .*?torchrun .*--rdzv-id=\"\$SLURM_JOB_ID\" "
                     r"-m rankscope\.train", commands)
    assert "RANKSCOPE_EXPORTER=external" in script


def test_slurm_prometheus_config_passes_promtool(tmp_path):
    config = yaml.safe_load((SLURM / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["job_name"] == rules_job()
    config["rule_files"] = [str(REPO / "prometheus" / "rules" / "*.yml")]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    result = run(["promtool", "check", "config", str(path)])
    assert result.returncode == 0, result.stdout + result.stderr


def test_slurm_prolog_never_fails_the_job(tmp_path):
    """A failing prolog drains the node: a bad setting is logged, exit 0."""
    env = {**os.environ, "RANKSCOPE_SD_DIR": str(tmp_path / "sd"), "RANKSCOPE_STATE_DIR": str(tmp_path / "st"),
           "RANKSCOPE_PORT": "not-a-port", "SLURM_JOB_ID": "7", "SLURMD_NODENAME": "n1"}
    result = run(["bash", str(SLURM / "prolog.sh")], env=env)
    assert result.returncode == 0
    assert not list((tmp_path / "sd").glob("*.json"))


# --- systemd ------------------------------------------------------------------

def _unit_settings() -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.lstrip().startswith(("#", ";")):
            key, value = line.split("=", 1)
            settings.setdefault(key.strip(), []).append(value.strip())
    return settings


def _unit_for_verify(tmp_path: Path) -> Path:
    """The unit with ExecStart pointing at an executable that exists here:
    `systemd-analyze verify` checks that it does."""
    exec_start = _unit_settings()["ExecStart"][0].split()[0]
    path = tmp_path / UNIT.name
    path.write_text(UNIT.read_text().replace(exec_start, sys.executable))
    return path


def test_systemd_unit_verifies(tmp_path):
    result = run(["systemd-analyze", "verify", str(_unit_for_verify(tmp_path))])
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr


def test_systemd_unit_is_hardened(tmp_path):
    # systemd's own exposure score, 0 (locked down) to 10 (unprotected).
    result = run(["systemd-analyze", "security", "--offline=yes", "--threshold=30",
                  str(_unit_for_verify(tmp_path))])
    assert result.returncode == 0, result.stdout[-2000:]
    s = _unit_settings()
    args = shlex.split(s["ExecStart"][0])
    directory = args[args.index("--dir") + 1]
    assert directory == "/run/" + s["RuntimeDirectory"][0]
    assert directory in s["ReadWritePaths"][0].split()
    assert s["NoNewPrivileges"] == ["yes"] and s["ProtectSystem"] == ["strict"]
    assert s["User"] != ["root"]
    # The exporter reads /proc/<pid> of other users' ranks.
    assert "ProtectProc" not in s and "ProcSubset" not in s
