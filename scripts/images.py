"""`make images`: build the project's container images with podman or docker, whichever works here.

    python scripts/images.py [--base cuda|debian] [training] [airflow]

- ``training``: docker/training.Dockerfile, what the Kubernetes pods run. ``--base cuda`` (the
  default) builds on the Dockerfile's CUDA runtime image; ``--base debian`` on a base image made
  here from Debian packages (``mmdebstrap`` -> ``podman import``, no registry needed): the CPU
  variant the tests run.
- ``airflow``: docker/airflow.Dockerfile on the official Airflow image.

podman runs with this project's settings (docker/podman/containers.conf and storage.conf, through
CONTAINERS_CONF / CONTAINERS_STORAGE_CONF: nothing system-wide changes). The host's pip
configuration reaches the build only at build time: the config as a build secret, the CA bundle
it names as another, and local folders it names (find-links, file:// indexes, constraint files)
as read-only build volumes (podman). None of them is in any layer of the image.
"""

from __future__ import annotations

import argparse
import configparser
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
TRAINING_IMAGE = "localhost/distributed-training:latest"
AIRFLOW_IMAGE = "localhost/distributed-training-airflow:latest"
# The base made from Debian packages: what the training image needs from a distribution.
DEBIAN_SUITE = "bookworm"
DEBIAN_PACKAGES = ["python3", "python3-venv", "ca-certificates", "procps"]
DEBIAN_MIRROR = "http://deb.debian.org/debian"
HOST_MOUNTS = "/run/host"  # where the host's local pip folders appear during a build
INSTALL_HINT = ("no container engine: install podman (Debian/Ubuntu, as root: apt-get install -y podman runc "
                "fuse-overlayfs mmdebstrap containernetworking-plugins; `make podman` does it) or start Docker")


@dataclass
class Engine:
    """The podman or docker CLI, with this project's settings in its environment."""

    name: str
    env: dict[str, str] = field(default_factory=dict)

    def __call__(self, *args: str, check: bool = True, capture: bool = True, timeout: float | None = None,
                 input: str | None = None) -> subprocess.CompletedProcess:
        out = subprocess.run([self.name, *args], env=self.env, text=True, timeout=timeout, input=input,
                             capture_output=capture)
        if check and out.returncode != 0:
            raise RuntimeError(f"{self.name} {' '.join(args[:3])} ... failed ({out.returncode}): "
                               f"{(out.stderr or '')[-3000:]}")
        return out

    def has_image(self, ref: str) -> bool:
        return self("image", "inspect", ref, check=False).returncode == 0

    def image_bytes(self, ref: str) -> int:
        return int(self("image", "inspect", "--format", "{{.Size}}", ref).stdout.strip())


def podman_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("CONTAINERS_CONF", str(DOCKER / "podman" / "containers.conf"))
    env.setdefault("CONTAINERS_STORAGE_CONF", str(DOCKER / "podman" / "storage.conf"))
    return env


def engine() -> Engine | None:
    """podman if installed (it needs no daemon), else docker if its daemon answers, else None.
    CONTAINER_ENGINE=podman|docker picks one."""
    wanted = os.environ.get("CONTAINER_ENGINE")
    for name in [wanted] if wanted else ["podman", "docker"]:
        if not shutil.which(name):
            continue
        e = Engine(name, podman_env() if name == "podman" else dict(os.environ))
        if e("info", check=False, timeout=60).returncode == 0:
            return e
    return None


def require_engine() -> Engine:
    e = engine()
    if e is None:
        raise SystemExit(INSTALL_HINT)
    return e


# --------------------------------------------------------------------------- the Debian base


def _apt_mirror() -> str:
    """The Debian mirror apt uses here (a proxy or local mirror works for mmdebstrap too)."""
    for path in [Path("/etc/apt/sources.list.d/debian.sources"), Path("/etc/apt/sources.list")]:
        if path.is_file():
            m = re.search(r"^(?:URIs:\s*|deb\s+(?:\[[^]]*\]\s+)?)(\S+/debian)/?\s", path.read_text(), re.M)
            if m:
                return m.group(1)
    return DEBIAN_MIRROR


def debian_base_ref() -> str:
    """Tag by the recipe: a changed package list is a new base."""
    recipe = " ".join([DEBIAN_SUITE, *DEBIAN_PACKAGES])
    return f"localhost/debian-base:{DEBIAN_SUITE}-{hashlib.sha256(recipe.encode()).hexdigest()[:8]}"


def debian_base(e: Engine) -> str:
    """A minimal Debian with Python 3.11 made from packages (mmdebstrap), imported as an image."""
    ref = debian_base_ref()
    if e.has_image(ref):
        return ref
    if not shutil.which("mmdebstrap"):
        raise SystemExit("mmdebstrap is missing (apt-get install -y mmdebstrap): it builds the base image from Debian "
                         "packages when no registry is reachable")
    mirror = _apt_mirror()
    security = mirror.rsplit("/", 1)[0] + "/debian-security"
    with tempfile.TemporaryDirectory(prefix="debian-base-") as tmp:
        tar = Path(tmp) / "base.tar"
        subprocess.run(["mmdebstrap", "--quiet", "--variant=minbase", f"--include={','.join(DEBIAN_PACKAGES)}",
                        DEBIAN_SUITE, str(tar), f"deb {mirror} {DEBIAN_SUITE} main",
                        f"deb {mirror} {DEBIAN_SUITE}-updates main", f"deb {security} {DEBIAN_SUITE}-security main"],
                       check=True)
        e("import", "--change", 'CMD ["/bin/bash"]', str(tar), ref)
    return ref


# --------------------------------------------------------------------------- pip at build time


def _pip_config() -> dict[str, dict[str, str]]:
    """The host's effective pip configuration (files and PIP_* variables), by section."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    config: dict[str, dict[str, str]] = {}
    for line in out.stdout.splitlines():
        m = re.match(r"^(:env:|[\w-]+)\.([\w-]+)='(.*)'$", line)
        if m:
            section = "global" if m.group(1) == ":env:" else m.group(1)
            config.setdefault(section, {})[m.group(2)] = m.group(3)
    return config


def pip_build_args(e: Engine, workdir: Path) -> list[str]:
    """Build arguments that hand the host's pip configuration to the build, and nothing more."""
    config = _pip_config()
    if not config:
        return []
    mounts: dict[str, str] = {}
    secrets = {}

    def local(value: str) -> str:
        """Local paths and file:// URLs in a value, re-pointed to where the build sees them."""
        def repoint(m: re.Match) -> str:
            path = Path(m.group(2))
            if not path.exists():
                return m.group(0)
            if path.is_file() and path.suffix in (".crt", ".pem"):
                secrets["pip-ca"] = str(path)
                return m.group(1) + "/run/secrets/pip-ca"
            # A file comes with its folder; a file:// index with the folder above it, which its
            # pages usually link into (simple/ beside the package files).
            folder = path.parent if path.is_file() or m.group(1) == "file://" else path
            mounts[str(folder)] = f"{HOST_MOUNTS}{folder}"
            return m.group(1) + f"{HOST_MOUNTS}{path}"
        return re.sub(r"(^|\s|file://)(/[^\s]+)", repoint, value)

    parser = configparser.ConfigParser(interpolation=None)
    for section, values in config.items():
        parser[section] = {k: local(v) for k, v in values.items()}
    conf = workdir / "pip.conf"
    with conf.open("w") as f:
        parser.write(f)
    args = ["--secret", f"id=pip.conf,src={conf}"]
    args += [a for sid, src in secrets.items() for a in ("--secret", f"id={sid},src={src}")]
    if e.name == "podman":
        args += [a for src, dst in mounts.items() for a in ("--volume", f"{src}:{dst}:ro")]
    elif mounts:
        print(f"note: docker builds cannot mount the local pip folders {sorted(mounts)}; packages come from the "
              "indexes only (TORCH_INDEX_URL picks torch's)", file=sys.stderr)
    return args


# --------------------------------------------------------------------------- builds


def build(e: Engine, dockerfile: str, tag: str, *, build_args: dict[str, str] | None = None,
          context: Path = ROOT, target: str | None = None) -> str:
    """Build docker/<dockerfile> from `context` (the repository by default) with the host's pip
    configuration at build time only; `target` picks a stage of a multi-stage file."""
    cmd = ["build", "--file", str(DOCKER / dockerfile), "--tag", tag, "--network=host"]
    if e.name == "podman":
        cmd += ["--format", "docker"]  # else the Dockerfile's SHELL line is ignored and RUN uses /bin/sh
    if target:
        cmd += ["--target", target]
    cmd += [a for k, v in (build_args or {}).items() for a in ("--build-arg", f"{k}={v}")]
    with tempfile.TemporaryDirectory(prefix="pip-build-") as tmp:
        cmd += pip_build_args(e, Path(tmp))
        out = e(*cmd, str(context), capture=False, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{e.name} build of {dockerfile} failed ({out.returncode}); its output is above")
    return tag


def training_image(e: Engine, *, base: str = "cuda") -> str:
    args = {"BASE_IMAGE": debian_base(e)} if base == "debian" else {}
    return build(e, "training.Dockerfile", TRAINING_IMAGE, build_args=args)


def airflow_image(e: Engine) -> str:
    return build(e, "airflow.Dockerfile", AIRFLOW_IMAGE)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("images", nargs="*", choices=["training", "airflow"], default=["training", "airflow"])
    p.add_argument("--base", choices=["cuda", "debian"], default="cuda",
                   help="training image base: the CUDA runtime image (default) or a Debian base made here")
    a = p.parse_args(argv)
    e = require_engine()
    for name in a.images:
        ref = training_image(e, base=a.base) if name == "training" else airflow_image(e)
        print(f"built {ref} with {e.name}: {e.image_bytes(ref) / 1e9:.2f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
