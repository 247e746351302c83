"""The documents' `diffserve` (`diffserve.testing.command_launcher`): to a shell it is the command, output,
exit code and signals included, though the command runs in a fork of the test's preloaded interpreter."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from diffserve import __version__
from diffserve.cli.main import main as cli_main
from diffserve.testing.command_launcher import CommandLauncher
from diffserve.testing.ports import unassigned_port


@pytest.fixture(scope="module")
def script(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, str]]]:
    bin_dir = tmp_path_factory.mktemp("bin")
    with CommandLauncher(cli_main) as launcher:
        yield launcher.install(bin_dir), {**os.environ, **launcher.environment()}


def serve(script: tuple[Path, dict[str, str]], model: Path) -> tuple[subprocess.Popen, str]:
    path, env = script
    port = unassigned_port()
    argv = [str(path), "serve", "--model-path", str(model), "--port", str(port), "--no-warmup"]
    process = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while not _healthy(url):
        assert process.poll() is None and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.1)
    return process, url


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def test_output_and_exit_codes_are_the_commands(script, tmp_path) -> None:
    path, env = script
    shown = subprocess.run([str(path), "--version"], env=env, capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and shown.stdout.strip() == f"diffserve {__version__}"
    refused = subprocess.run(
        f"cd {tmp_path} && {path} generate --no-such-flag",
        shell=True,
        env=env,
        capture_output=True,
        text=True,
    )
    assert refused.returncode == 2 and refused.stderr.startswith("error:"), refused.stderr


def test_sigterm_to_the_script_stops_the_command_as_it_would_stop_it(script, tiny_flux_dir) -> None:
    """The server drains and exits 0: the script exits 0 and the port is closed."""
    process, url = serve(script, tiny_flux_dir)
    process.send_signal(signal.SIGTERM)
    assert process.wait(60) == 0
    assert not _healthy(url)


def test_a_killed_script_takes_its_command_with_it(script, tiny_flux_dir) -> None:
    process, url = serve(script, tiny_flux_dir)
    process.kill()
    process.wait(10)
    deadline = time.monotonic() + 30
    while _healthy(url):
        assert time.monotonic() < deadline, "the server outlived its script"
        time.sleep(0.2)
